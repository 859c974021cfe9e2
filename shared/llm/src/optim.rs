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

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use serde::{Deserialize, Serialize};

use crate::train_error::{TrainError, TrainResult};

/// Hyperparameters of [`AdamW`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdamWConfig {
    /// Learning rate.
    pub lr: f64,
    /// Decay of the first-moment (mean) estimate.
    pub beta1: f64,
    /// Decay of the second-moment (uncentred variance) estimate.
    pub beta2: f64,
    /// Added to the square root of the second moment, for stability.
    pub eps: f64,
    /// Decoupled weight decay per step (`θ ← θ − lr·wd·θ`). Default 0, as
    /// in TRL; `candle_nn::ParamsAdamW` and PyTorch default to 0.01. On a
    /// LoRA adapter it pulls the update towards the base model.
    pub weight_decay: f64,
    /// Clip the summed gradient to this global L2 norm before the step
    /// (PyTorch's `clip_grad_norm_`); `None` turns clipping off.
    pub max_grad_norm: Option<f64>,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            lr: 1e-4,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            max_grad_norm: Some(1.0),
        }
    }
}

impl AdamWConfig {
    /// Checks every field's range.
    pub fn validate(&self) -> TrainResult<()> {
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return Err(TrainError::config("lr", "must be finite and >= 0"));
        }
        if !(0.0..1.0).contains(&self.beta1) {
            return Err(TrainError::config("beta1", "must be in [0, 1)"));
        }
        if !(0.0..1.0).contains(&self.beta2) {
            return Err(TrainError::config("beta2", "must be in [0, 1)"));
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(TrainError::config("eps", "must be finite and > 0"));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(TrainError::config(
                "weight_decay",
                "must be finite and >= 0",
            ));
        }
        if let Some(n) = self.max_grad_norm {
            if !(n.is_finite() && n > 0.0) {
                return Err(TrainError::config(
                    "max_grad_norm",
                    "must be finite and > 0 (or absent to turn clipping off)",
                ));
            }
        }
        Ok(())
    }
}

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
