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
    /// The buckets of the last step with their flat moments (each
    /// parameter's moments are views of them), reused while the same
    /// parameters get gradients.
    flat: Vec<Bucket>,
    /// [`BUCKET_ELEMENTS`] (smaller in tests).
    bucket_elements: usize,
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
            flat: Vec::new(),
            bucket_elements: BUCKET_ELEMENTS,
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

    /// Sums the accumulated gradients, and `extra` (statistics the caller
    /// summed the same way), across learner replicas with `share`: one f32
    /// buffer, one all-reduce. A parameter has a gradient afterwards when
    /// any replica had one, so every replica steps the same parameters.
    /// Alone: nothing to do.
    pub fn sum_accumulated(
        &mut self,
        share: &mut relay_nn::BatchShare<'_>,
        extra: &mut [f32],
    ) -> TrainResult<()> {
        let vars: Vec<candle_core::Var> = self.params.iter().map(|p| p.var.clone()).collect();
        let mut grads: Vec<Option<Tensor>> =
            self.params.iter_mut().map(|p| p.grad.take()).collect();
        let summed = share.sum_each(&vars, &mut grads, extra);
        for (p, grad) in self.params.iter_mut().zip(grads) {
            p.grad = grad;
        }
        Ok(summed?)
    }

    /// Forgets the accumulated gradients without stepping.
    pub fn zero_grad(&mut self) {
        for p in &mut self.params {
            p.grad = None;
        }
    }

    /// Global L2 norm of the accumulated gradients: each gradient's sum of
    /// squares stays on its device, and their sum crosses to the host once,
    /// so a step waits for the device once rather than once per parameter.
    pub fn grad_norm(&self) -> TrainResult<f64> {
        let sums = self
            .params
            .iter()
            .filter_map(|p| p.grad.as_ref())
            .map(|g| g.to_dtype(DType::F32)?.sqr()?.sum_all())
            .collect::<candle_core::Result<Vec<_>>>()?;
        if sums.is_empty() {
            return Ok(0.0);
        }
        let sum = Tensor::stack(&sums, 0)?
            .to_dtype(DType::F64)?
            .sum_all()?
            .to_scalar::<f64>()?;
        Ok(sum.sqrt())
    }

    /// Clips the accumulated gradients, applies one AdamW update to every
    /// parameter that has a gradient, and clears the sums. A non-finite
    /// gradient norm is an error, and then nothing changes but the sums
    /// are cleared.
    ///
    /// Multi-tensor, as PyTorch's `foreach` AdamW: the parameters with a
    /// gradient are cut into buckets ([`BUCKET_ELEMENTS`]) on one device in
    /// one dtype, and each bucket is updated as one flat
    /// tensor, so the dozen elementwise kernels of the update run once per
    /// bucket, not once per parameter (a LoRA adapter of a 28-layer model
    /// has 392 factors). The arithmetic is the same element by element.
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
        let buckets = self.buckets();
        let mut previous = std::mem::take(&mut self.flat);
        if buckets
            .iter()
            .map(|b| &b.members)
            .ne(previous.iter().map(|f| &f.members))
        {
            // Other parameters got gradients than last step: the moments
            // are gathered afresh from each parameter's.
            previous.clear();
        }
        for (i, bucket) in buckets.into_iter().enumerate() {
            match self.update_bucket(bucket, previous.get(i), scale) {
                Ok(updated) => self.flat.push(updated),
                Err(e) => {
                    self.flat.clear();
                    self.zero_grad();
                    return Err(e);
                }
            }
        }
        self.zero_grad();
        Ok(StepReport {
            grad_norm,
            clipped: scale.is_some(),
        })
    }

    /// The parameters that have a gradient, in order, in buckets on one
    /// device in one dtype, each of at most `bucket_elements` elements (or
    /// one parameter larger than that).
    fn buckets(&self) -> Vec<Bucket> {
        let mut buckets: Vec<Bucket> = Vec::new();
        let mut elements = 0;
        for (i, p) in self.params.iter().enumerate() {
            let Some(g) = &p.grad else { continue };
            let n = g.elem_count();
            let joins = buckets.last().is_some_and(|b| {
                let last = &self.params[*b.members.last().expect("a bucket has members")];
                let t = last.var.as_tensor();
                t.dtype() == p.var.dtype()
                    && t.device().same_device(p.var.device())
                    && elements + n <= self.bucket_elements
            });
            if !joins {
                buckets.push(Bucket::default());
                elements = 0;
            }
            let bucket = buckets.last_mut().expect("just pushed");
            bucket.members.push(i);
            elements += n;
        }
        buckets
    }

    /// One AdamW update of `bucket`'s parameters as one flat tensor; its
    /// moments come from `previous` (the same members' flat moments of the
    /// last step) or are gathered from the parameters'. Returns the bucket
    /// with its new flat moments; each parameter's moments become views
    /// of them.
    fn update_bucket(
        &mut self,
        mut bucket: Bucket,
        previous: Option<&Bucket>,
        scale: Option<f64>,
    ) -> TrainResult<Bucket> {
        let c = &self.config;
        let t = self.steps as i32;
        let bias1 = 1.0 - c.beta1.powi(t);
        let bias2 = 1.0 - c.beta2.powi(t);
        let members: Vec<&Param> = bucket.members.iter().map(|&i| &self.params[i]).collect();
        let flat = |part: &dyn Fn(&Param) -> candle_core::Result<Tensor>| -> TrainResult<Tensor> {
            let parts = members
                .iter()
                .map(|p| part(p)?.flatten_all())
                .collect::<candle_core::Result<Vec<_>>>()?;
            Ok(match parts.as_slice() {
                [one] => one.clone(),
                _ => Tensor::cat(&parts, 0)?,
            })
        };
        let g = flat(&|p| Ok(p.grad.clone().expect("a bucket's members have gradients")))?;
        let g = match scale {
            Some(s) => (g * s)?,
            None => g,
        };
        // A parameter's first step starts from zero moments: `β·0 + x` is
        // exactly `x`, so this is the update without moments, bit for bit.
        let moment = |m: &Option<Tensor>, p: &Param| match m {
            Some(m) => Ok(m.clone()),
            None => p.var.zeros_like(),
        };
        let previous =
            previous.and_then(|b| Some((b.first_moment.clone()?, b.second_moment.clone()?)));
        let (m, v) = match previous {
            Some(moments) => moments,
            None => (
                flat(&|p| moment(&p.first_moment, p))?,
                flat(&|p| moment(&p.second_moment, p))?,
            ),
        };
        let m = ((m * c.beta1)? + (&g * (1.0 - c.beta1))?)?;
        let v = ((v * c.beta2)? + (g.sqr()? * (1.0 - c.beta2))?)?;
        let theta = flat(&|p| Ok(p.var.as_tensor().detach()))?;
        let theta = if c.weight_decay > 0.0 {
            (&theta * (1.0 - c.lr * c.weight_decay))?
        } else {
            theta
        };
        let denom = ((&v / bias2)?.sqrt()? + c.eps)?;
        let update = ((&m / bias1)? / denom)?;
        let theta = (theta - (update * c.lr)?)?;
        let mut offset = 0;
        for &i in &bucket.members {
            let p = &mut self.params[i];
            let shape = p.var.shape().clone();
            let n = shape.elem_count();
            let view = |t: &Tensor| t.narrow(0, offset, n)?.reshape(&shape);
            p.var.set(&view(&theta)?)?;
            p.first_moment = Some(view(&m)?);
            p.second_moment = Some(view(&v)?);
            offset += n;
        }
        bucket.first_moment = Some(m);
        bucket.second_moment = Some(v);
        Ok(bucket)
    }
}

/// Most elements one bucket of [`AdamW::step`] holds (64 MiB of f32): few
/// buckets for an adapter, and a bound on the flat copies a step makes
/// when every weight of a model trains.
const BUCKET_ELEMENTS: usize = 1 << 24;

/// Neighbouring parameters updated together by [`AdamW::step`], with the
/// flat moments of their last update.
#[derive(Debug, Default)]
struct Bucket {
    /// Indices into the optimizer's parameters.
    members: Vec<usize>,
    first_moment: Option<Tensor>,
    second_moment: Option<Tensor>,
}

/// Metadata key of the step count in a saved optimizer state.
const STEPS_KEY: &str = "steps";

impl AdamW {
    /// Writes the moments and the step count to a safetensors file
    /// (written beside it and renamed into place).
    pub fn save(&self, path: &Path) -> TrainResult<()> {
        let bytes = self.state_bytes()?;
        let tmp = path.with_extension("safetensors.tmp");
        let io = |e: std::io::Error| TrainError::BadInput(format!("{}: {e}", path.display()));
        std::fs::write(&tmp, bytes).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }

    /// The moments and the step count as the bytes of a safetensors file
    /// (what [`AdamW::save`] writes): learner replicas hand them over in
    /// memory.
    pub fn state_bytes(&self) -> TrainResult<Vec<u8>> {
        let mut tensors: Vec<(String, Tensor)> = Vec::new();
        for p in &self.params {
            if let (Some(m), Some(v)) = (&p.first_moment, &p.second_moment) {
                tensors.push((format!("{}.exp_avg", p.name), m.contiguous()?));
                tensors.push((format!("{}.exp_avg_sq", p.name), v.contiguous()?));
            }
        }
        let metadata = HashMap::from([(STEPS_KEY.to_string(), self.steps.to_string())]);
        safetensors::serialize(tensors.iter().map(|(n, t)| (n.as_str(), t)), Some(metadata))
            .map_err(|e| TrainError::BadInput(format!("optimizer state: {e}")))
    }

    /// Restores the moments and step count saved by [`AdamW::save`] for
    /// the same parameters (names and shapes must match; a parameter
    /// without saved moments starts afresh, as one that never had a
    /// gradient). Accumulated gradients are cleared. On error nothing
    /// changes.
    pub fn load(&mut self, path: &Path) -> TrainResult<()> {
        let bytes = std::fs::read(path)
            .map_err(|e| TrainError::BadInput(format!("{}: {e}", path.display())))?;
        self.restore_bytes(&bytes, &path.display().to_string())
    }

    /// [`AdamW::load`] from the bytes of [`AdamW::state_bytes`]; `origin`
    /// names them in errors.
    pub fn restore_bytes(&mut self, bytes: &[u8], origin: &str) -> TrainResult<()> {
        let fail = |detail: String| TrainError::BadInput(format!("{origin}: {detail}"));
        let (_, metadata) =
            safetensors::SafeTensors::read_metadata(bytes).map_err(|e| fail(e.to_string()))?;
        let steps: u64 = metadata
            .metadata()
            .as_ref()
            .and_then(|m| m.get(STEPS_KEY))
            .ok_or_else(|| fail(format!("no `{STEPS_KEY}` in the metadata")))?
            .parse()
            .map_err(|e| fail(format!("`{STEPS_KEY}`: {e}")))?;
        let mut saved = candle_core::safetensors::load_buffer(bytes, &Device::Cpu)
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
        self.flat.clear();
        Ok(())
    }
}

#[cfg(test)]
mod state_tests {
    use super::*;

    /// PyTorch's AdamW one parameter at a time, as written in the module
    /// docs: what the multi-tensor step must equal.
    struct Reference {
        theta: Vec<Vec<f32>>,
        m: Vec<Option<Vec<f32>>>,
        v: Vec<Option<Vec<f32>>>,
        steps: i32,
    }

    impl Reference {
        fn step(&mut self, c: &AdamWConfig, grads: &[Option<Vec<f32>>]) {
            let norm = grads
                .iter()
                .flatten()
                .map(|g| g.iter().map(|x| f64::from(x * x)).sum::<f64>())
                .sum::<f64>()
                .sqrt();
            let scale = c
                .max_grad_norm
                .filter(|max| norm > *max)
                .map(|max| max / (norm + 1e-6));
            self.steps += 1;
            let bias1 = 1.0 - c.beta1.powi(self.steps);
            let bias2 = 1.0 - c.beta2.powi(self.steps);
            for (i, g) in grads.iter().enumerate() {
                let Some(g) = g else { continue };
                let m = self.m[i].get_or_insert(vec![0.0; g.len()]);
                let v = self.v[i].get_or_insert(vec![0.0; g.len()]);
                for (j, &g) in g.iter().enumerate() {
                    let g = match scale {
                        Some(s) => (f64::from(g) * s) as f32,
                        None => g,
                    };
                    m[j] = (m[j] as f64 * c.beta1) as f32 + (g as f64 * (1.0 - c.beta1)) as f32;
                    v[j] =
                        (v[j] as f64 * c.beta2) as f32 + ((g * g) as f64 * (1.0 - c.beta2)) as f32;
                    let theta = &mut self.theta[i][j];
                    if c.weight_decay > 0.0 {
                        *theta = (*theta as f64 * (1.0 - c.lr * c.weight_decay)) as f32;
                    }
                    let denom = ((v[j] as f64 / bias2) as f32).sqrt() + c.eps as f32;
                    let update = (m[j] as f64 / bias1) as f32 / denom;
                    *theta -= (update as f64 * c.lr) as f32;
                }
            }
        }
    }

    /// Three parameters over four steps, one of them without a gradient
    /// on some steps, clipped and with weight decay, in buckets of every
    /// size: the same values as one parameter at a time, within an ulp or
    /// two (the reference rounds its scalar products as candle does not).
    #[test]
    fn the_multi_tensor_step_is_adamw_per_parameter() {
        let config = AdamWConfig {
            lr: 0.05,
            weight_decay: 0.1,
            max_grad_norm: Some(1.0),
            ..Default::default()
        };
        let start = [
            vec![1.0f32, -2.0, 3.0],
            vec![0.5, 0.25],
            vec![-1.0, 4.0, 2.0, 1.0],
        ];
        let grads_at = |step: usize| -> Vec<Option<Vec<f32>>> {
            (0..3)
                .map(|i| {
                    (i != 1 || step.is_multiple_of(2)).then(|| {
                        (0..start[i].len())
                            .map(|j| ((step * 7 + i * 3 + j) as f32 * 0.37).sin() * 2.0)
                            .collect()
                    })
                })
                .collect()
        };
        let mut finals = Vec::new();
        for bucket_elements in [1, 4, 5, 100] {
            let vars: Vec<Var> = start.iter().map(|s| var(s)).collect();
            let named = vars
                .iter()
                .enumerate()
                .map(|(i, v)| (format!("p{i}"), v.clone()));
            let mut opt = AdamW::new(named.collect(), config.clone()).unwrap();
            opt.bucket_elements = bucket_elements;
            let mut reference = Reference {
                theta: start.to_vec(),
                m: vec![None; 3],
                v: vec![None; 3],
                steps: 0,
            };
            for step in 0..4 {
                let grads = grads_at(step);
                for (p, g) in opt.params.iter_mut().zip(&grads) {
                    p.grad = g
                        .as_ref()
                        .map(|g| Tensor::new(g.as_slice(), &Device::Cpu).unwrap());
                }
                opt.step().unwrap();
                reference.step(&config, &grads);
                for (i, v) in vars.iter().enumerate() {
                    let got = v.as_tensor().to_vec1::<f32>().unwrap();
                    for (a, b) in got.iter().zip(&reference.theta[i]) {
                        assert!(
                            (a - b).abs() <= 4.0 * f32::EPSILON * b.abs().max(1.0),
                            "buckets of {bucket_elements}, step {step}, p{i}: {got:?} != {:?}",
                            reference.theta[i]
                        );
                    }
                }
            }
            finals.push(
                vars.iter()
                    .map(|v| v.as_tensor().to_vec1::<f32>().unwrap())
                    .collect::<Vec<_>>(),
            );
        }
        // And bit for bit the same whatever the buckets.
        assert!(finals.windows(2).all(|w| w[0] == w[1]), "{finals:?}");
    }

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
