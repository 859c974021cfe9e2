//! [`AdamW`] over named candle [`Var`]s, with gradient accumulation over
//! micro-batches and clipping by global norm.
//!
//! Written here rather than taken from `candle_nn::AdamW` because that one
//! defaults to weight decay 0.01, has no clipping and takes one
//! `GradStore` per step; the trainers need gradients summed over several
//! backward passes, clipped together, then one step.
//!
//! The update is PyTorch's `torch.optim.AdamW` (decoupled weight decay,
//! bias-corrected moments):
//!
//! ```text
//! θ ← θ − lr·wd·θ
//! m ← β1·m + (1−β1)·g          v ← β2·v + (1−β2)·g²
//! θ ← θ − lr · (m / (1−β1^t)) / (sqrt(v / (1−β2^t)) + eps)
//! ```
//!
//! Use: [`AdamW::accumulate`] after every `loss.backward()`, then
//! [`AdamW::step`] once. Parameters that received no gradient are left
//! alone (as PyTorch does for `grad is None`).
//!
//! State ([`AdamW::save`] / [`AdamW::load`]): one safetensors file with
//! `<param>.exp_avg` and `<param>.exp_avg_sq` (PyTorch's names) for every
//! parameter that has moments, and the step count in the metadata
//! (`steps`). Accumulated, unapplied gradients are not saved.

use std::collections::HashMap;
use std::path::Path;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

pub use relay_config::hyper::objective::AdamWConfig;

use crate::train_error::{TrainError, TrainResult};

#[derive(Debug)]
struct Param {
    name: String,
    var: Var,
    /// Gradient summed over the micro-batches since the last step.
    grad: Option<Tensor>,
    first_moment: Option<Tensor>,
    second_moment: Option<Tensor>,
}

/// What one [`AdamW::step`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// Global L2 norm of the summed gradient, before clipping.
    pub grad_norm: f64,
    /// Whether clipping scaled the gradient down.
    pub clipped: bool,
}

/// AdamW over a fixed list of named vars (a LoRA adapter's factors, or
/// every weight of a model loaded into a `VarMap`).
#[derive(Debug)]
pub struct AdamW {
    config: AdamWConfig,
    params: Vec<Param>,
    steps: u64,
}

impl AdamW {
    /// An optimizer over `params` (name, var), e.g.
    /// [`crate::LoraAdapter::named_vars`].
    pub fn new(params: Vec<(String, Var)>, config: AdamWConfig) -> TrainResult<Self> {
        config.validate()?;
        if params.is_empty() {
            return Err(TrainError::BadInput("no parameters to optimize".into()));
        }
        Ok(Self {
            config,
            params: params
                .into_iter()
                .map(|(name, var)| Param {
                    name,
                    var,
                    grad: None,
                    first_moment: None,
                    second_moment: None,
                })
                .collect(),
            steps: 0,
        })
    }

    /// The hyperparameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// Changes the learning rate (schedules).
    pub fn set_lr(&mut self, lr: f64) {
        self.config.lr = lr;
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Whether `var` is one of the optimized vars (same storage).
    pub fn contains(&self, var: &Var) -> bool {
        self.params
            .iter()
            .any(|p| p.var.as_tensor().id() == var.as_tensor().id())
    }

    /// Names and vars, in the order given to [`AdamW::new`].
    pub fn params(&self) -> impl Iterator<Item = (&str, &Var)> {
        self.params.iter().map(|p| (p.name.as_str(), &p.var))
    }

    /// Adds this backward pass's gradients to the running sums.
    pub fn accumulate(&mut self, grads: &GradStore) -> TrainResult<()> {
        for p in &mut self.params {
            if let Some(g) = grads.get(p.var.as_tensor()) {
                let g = g.detach();
                p.grad = Some(match p.grad.take() {
                    Some(sum) => (sum + g)?,
                    None => g,
                });
            }
        }
        Ok(())
    }

    /// The accumulated gradient of each parameter (`None`: it got none),
    /// with its name, in parameter order.
    pub fn accumulated_grads(&self) -> impl Iterator<Item = (&str, Option<&Tensor>)> {
        self.params
            .iter()
            .map(|p| (p.name.as_str(), p.grad.as_ref()))
    }

    /// Forgets the accumulated gradients without stepping.
    pub fn zero_grad(&mut self) {
        for p in &mut self.params {
            p.grad = None;
        }
    }

    /// Global L2 norm of the accumulated gradients.
    pub fn grad_norm(&self) -> TrainResult<f64> {
        let mut sum = 0.0f64;
        for p in &self.params {
            if let Some(g) = &p.grad {
                sum += g
                    .sqr()?
                    .sum_all()?
                    .to_dtype(candle_core::DType::F64)?
                    .to_scalar::<f64>()?;
            }
        }
        Ok(sum.sqrt())
    }

    /// Clips the accumulated gradients, applies one AdamW update to every
    /// parameter that has a gradient, and clears the sums. A non-finite
    /// gradient norm is an error, and then nothing changes but the sums
    /// are cleared.
    pub fn step(&mut self) -> TrainResult<StepReport> {
        let grad_norm = self.grad_norm()?;
        if !grad_norm.is_finite() {
            self.zero_grad();
            return Err(TrainError::NonFinite {
                what: "gradient norm",
                value: grad_norm,
            });
        }
        let scale = match self.config.max_grad_norm {
            Some(max) if grad_norm > max => Some(max / (grad_norm + 1e-6)),
            _ => None,
        };
        self.steps += 1;
        let c = &self.config;
        let t = self.steps as i32;
        let bias1 = 1.0 - c.beta1.powi(t);
        let bias2 = 1.0 - c.beta2.powi(t);
        for p in &mut self.params {
            let Some(g) = p.grad.take() else { continue };
            let g = match scale {
                Some(s) => (g * s)?,
                None => g,
            };
            let m = match &p.first_moment {
                Some(m) => ((m * c.beta1)? + (&g * (1.0 - c.beta1))?)?,
                None => (&g * (1.0 - c.beta1))?,
            };
            let v = match &p.second_moment {
                Some(v) => ((v * c.beta2)? + (g.sqr()? * (1.0 - c.beta2))?)?,
                None => (g.sqr()? * (1.0 - c.beta2))?,
            };
            let theta = p.var.as_tensor().detach();
            let theta = if c.weight_decay > 0.0 {
                (&theta * (1.0 - c.lr * c.weight_decay))?
            } else {
                theta
            };
            let denom = ((&v / bias2)?.sqrt()? + c.eps)?;
            let update = ((&m / bias1)? / denom)?;
            p.var.set(&(theta - (update * c.lr)?)?)?;
            p.first_moment = Some(m);
            p.second_moment = Some(v);
        }
        Ok(StepReport {
            grad_norm,
            clipped: scale.is_some(),
        })
    }
}

/// Metadata key of the step count in a saved optimizer state.
const STEPS_KEY: &str = "steps";

impl AdamW {
    /// Writes the moments and the step count to a safetensors file
    /// (written beside it and renamed into place).
    pub fn save(&self, path: &Path) -> TrainResult<()> {
        let mut tensors: Vec<(String, Tensor)> = Vec::new();
        for p in &self.params {
            if let (Some(m), Some(v)) = (&p.first_moment, &p.second_moment) {
                tensors.push((format!("{}.exp_avg", p.name), m.contiguous()?));
                tensors.push((format!("{}.exp_avg_sq", p.name), v.contiguous()?));
            }
        }
        let metadata = HashMap::from([(STEPS_KEY.to_string(), self.steps.to_string())]);
        let bytes =
            safetensors::serialize(tensors.iter().map(|(n, t)| (n.as_str(), t)), Some(metadata))
                .map_err(|e| TrainError::BadInput(format!("optimizer state: {e}")))?;
        let tmp = path.with_extension("safetensors.tmp");
        let io = |e: std::io::Error| TrainError::BadInput(format!("{}: {e}", path.display()));
        std::fs::write(&tmp, bytes).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }

    /// Restores the moments and step count saved by [`AdamW::save`] for
    /// the same parameters (names and shapes must match; a parameter
    /// without saved moments starts afresh, as one that never had a
    /// gradient). Accumulated gradients are cleared. On error nothing
    /// changes.
    pub fn load(&mut self, path: &Path) -> TrainResult<()> {
        let fail = |detail: String| TrainError::BadInput(format!("{}: {detail}", path.display()));
        let bytes = std::fs::read(path).map_err(|e| fail(e.to_string()))?;
        let (_, metadata) =
            safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| fail(e.to_string()))?;
        let steps: u64 = metadata
            .metadata()
            .as_ref()
            .and_then(|m| m.get(STEPS_KEY))
            .ok_or_else(|| fail(format!("no `{STEPS_KEY}` in the metadata")))?
            .parse()
            .map_err(|e| fail(format!("`{STEPS_KEY}`: {e}")))?;
        let mut saved = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu)
            .map_err(|e| fail(e.to_string()))?;
        let mut moments = Vec::with_capacity(self.params.len());
        for p in &self.params {
            let shape = p.var.as_tensor().shape().clone();
            let mut take = |suffix: &str| -> TrainResult<Option<Tensor>> {
                let name = format!("{}.{suffix}", p.name);
                match saved.remove(&name) {
                    Some(t) if t.shape() == &shape => Ok(Some(
                        t.to_dtype(DType::F32)?
                            .to_device(p.var.as_tensor().device())?,
                    )),
                    Some(t) => Err(fail(format!(
                        "{name} has shape {:?}, the parameter {:?}",
                        t.dims(),
                        shape.dims()
                    ))),
                    None => Ok(None),
                }
            };
            let (m, v) = (take("exp_avg")?, take("exp_avg_sq")?);
            if m.is_some() != v.is_some() {
                return Err(fail(format!("{} has only one of its two moments", p.name)));
            }
            moments.push((m, v));
        }
        if let Some(extra) = saved.keys().next() {
            return Err(fail(format!("{extra} matches no parameter")));
        }
        for (p, (m, v)) in self.params.iter_mut().zip(moments) {
            p.first_moment = m;
            p.second_moment = v;
            p.grad = None;
        }
        self.steps = steps;
        Ok(())
    }
}

#[cfg(test)]
mod state_tests {
    use super::*;

    fn var(values: &[f32]) -> Var {
        Var::from_tensor(&Tensor::new(values, &Device::Cpu).unwrap()).unwrap()
    }

    fn step_with(opt: &mut AdamW, x: &Var) {
        let loss = (x.as_tensor().sqr().unwrap().sum_all().unwrap() * 0.5).unwrap();
        opt.accumulate(&loss.backward().unwrap()).unwrap();
        opt.step().unwrap();
    }

    #[test]
    fn a_restored_optimizer_continues_exactly() {
        let config = AdamWConfig {
            lr: 0.1,
            ..Default::default()
        };
        let x = var(&[1.0, -2.0, 3.0]);
        let mut opt = AdamW::new(vec![("x".into(), x.clone())], config.clone()).unwrap();
        step_with(&mut opt, &x);
        step_with(&mut opt, &x);
        let path =
            std::env::temp_dir().join(format!("relay-adamw-{}.safetensors", std::process::id()));
        opt.save(&path).unwrap();

        // The same start point and state in a new optimizer.
        let y = var(&x.as_tensor().to_vec1::<f32>().unwrap());
        let mut restored = AdamW::new(vec![("x".into(), y.clone())], config.clone()).unwrap();
        restored.load(&path).unwrap();
        assert_eq!(restored.steps(), 2);
        step_with(&mut opt, &x);
        step_with(&mut restored, &y);
        assert_eq!(
            x.as_tensor().to_vec1::<f32>().unwrap(),
            y.as_tensor().to_vec1::<f32>().unwrap()
        );
        // Without the state the step differs (bias correction restarts).
        let z = var(&[1.0, -2.0, 3.0]);
        let mut fresh = AdamW::new(vec![("x".into(), z.clone())], config.clone()).unwrap();
        step_with(&mut fresh, &z);
        let w = var(&[1.0, -2.0, 3.0]);
        let mut loaded = AdamW::new(vec![("x".into(), w.clone())], config).unwrap();
        loaded.load(&path).unwrap();
        step_with(&mut loaded, &w);
        assert_ne!(
            z.as_tensor().to_vec1::<f32>().unwrap(),
            w.as_tensor().to_vec1::<f32>().unwrap()
        );

        // Another parameter set is refused, and nothing changes.
        let other = var(&[1.0, 2.0]);
        let mut wrong = AdamW::new(vec![("x".into(), other)], AdamWConfig::default()).unwrap();
        let err = wrong.load(&path).unwrap_err().to_string();
        assert!(err.contains("shape"), "{err}");
        assert_eq!(wrong.steps(), 0);
        let _ = std::fs::remove_file(&path);
    }
}
