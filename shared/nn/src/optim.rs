//! Adam, RMSprop and global gradient-norm clipping.
//!
//! Our own Adam rather than candle-nn's `AdamW` (which defaults to weight
//! decay 0.01 and cannot save its state): the update is exactly
//! `torch.optim.Adam`'s, computed in f32 directly on each `Var`'s storage in
//! place (no temporaries), and its state (step count, first and second
//! moments) saves to safetensors so a resumed run continues bit-for-bit.
//! [`RmsProp`] (A2C's optimizer in SB3) is `torch.optim.RMSprop`, with the
//! same in-place update and resumable state.

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::Path;

use candle_core::backprop::GradStore;
use candle_core::{bail, CpuStorage, InplaceOp1, InplaceOp2, Layout, Storage, Tensor, Var};
use serde::{Deserialize, Serialize};

use crate::error::{NnError, Result};
use crate::io::{read_safetensors, write_safetensors, NamedTensor};
use crate::kernels::{self, AdamCoeffs};
use crate::ops::cpu_f32;

/// `format` metadata written into optimizer state files.
pub const ADAM_FORMAT: &str = "relay-nn/adam";

/// Hyperparameters of [`Adam`]. Defaults are Stable-Baselines3's PPO ones.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdamConfig {
    /// Learning rate (step size). SB3 PPO default `3e-4`; CleanRL uses
    /// `2.5e-4` with linear annealing (call [`Adam::set_lr`] each update).
    pub lr: f64,
    /// Exponential decay rate of the first-moment estimate. Default `0.9`.
    pub beta1: f64,
    /// Exponential decay rate of the second-moment estimate. Default `0.999`.
    pub beta2: f64,
    /// Added to the denominator for numerical stability. SB3 PPO passes
    /// `1e-5` (PyTorch's own default is `1e-8`). Default `1e-5`.
    pub eps: f64,
    /// L2 penalty added to the gradient (`g + weight_decay * p`, as
    /// `torch.optim.Adam`, not decoupled AdamW). Default `0.0`.
    pub weight_decay: f64,
}

impl Default for AdamConfig {
    fn default() -> Self {
        Self {
            lr: 3e-4,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-5,
            weight_decay: 0.0,
        }
    }
}

impl AdamConfig {
    /// Checks ranges; the error names the field.
    pub fn validate(&self) -> Result<()> {
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return Err(NnError::config(
                "lr",
                format!("must be finite and >= 0, got {}", self.lr),
            ));
        }
        if !(0.0..1.0).contains(&self.beta1) {
            return Err(NnError::config(
                "beta1",
                format!("must be in [0, 1), got {}", self.beta1),
            ));
        }
        if !(0.0..1.0).contains(&self.beta2) {
            return Err(NnError::config(
                "beta2",
                format!("must be in [0, 1), got {}", self.beta2),
            ));
        }
        if !(self.eps.is_finite() && self.eps >= 0.0) {
            return Err(NnError::config(
                "eps",
                format!("must be finite and >= 0, got {}", self.eps),
            ));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(NnError::config(
                "weight_decay",
                format!("must be finite and >= 0, got {}", self.weight_decay),
            ));
        }
        Ok(())
    }
}

/// The resumable state of [`Adam`].
#[derive(Debug, Clone, PartialEq)]
pub struct AdamState {
    /// Number of steps taken.
    pub step: u64,
    /// First moment of each var, in var order.
    pub m: Vec<Vec<f32>>,
    /// Second moment of each var, in var order.
    pub v: Vec<Vec<f32>>,
}

/// Adam over a fixed list of `Var`s (as `torch.optim.Adam`, `amsgrad=False`).
///
/// One step count is shared by all vars; a var without a gradient in a
/// step is left untouched (moments included).
pub struct Adam {
    vars: Vec<Var>,
    config: AdamConfig,
    state: AdamState,
}

impl std::fmt::Debug for Adam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Adam")
            .field("config", &self.config)
            .field("step", &self.state.step)
            .field("vars", &self.vars.len())
            .finish()
    }
}

/// In-place update of a parameter storage from its gradient.
struct AdamKernel<'a> {
    m: RefCell<&'a mut [f32]>,
    v: RefCell<&'a mut [f32]>,
    coeffs: AdamCoeffs,
}

impl InplaceOp2 for AdamKernel<'_> {
    fn name(&self) -> &'static str {
        "relay-adam"
    }

    fn cpu_fwd(
        &self,
        ps: &mut CpuStorage,
        pl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> candle_core::Result<()> {
        let g = cpu_f32(gs, gl, "adam grad")?;
        let CpuStorage::F32(p) = ps else {
            bail!("adam: parameters must be f32")
        };
        let Some((a, b)) = pl.contiguous_offsets() else {
            bail!("adam: parameters must be contiguous")
        };
        let p = &mut p[a..b];
        let (mut m, mut v) = (self.m.borrow_mut(), self.v.borrow_mut());
        if p.len() != g.len() || m.len() != p.len() || v.len() != p.len() {
            bail!(
                "adam: parameter has {} values, gradient {}, state {}",
                p.len(),
                g.len(),
                m.len()
            )
        }
        kernels::adam(p, g, &mut m, &mut v, self.coeffs);
        Ok(())
    }
}

/// Multiplies a gradient in place.
struct Scale(f32);

impl InplaceOp1 for Scale {
    fn name(&self) -> &'static str {
        "relay-scale"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
        let CpuStorage::F32(x) = s else {
            bail!("scale: expected f32")
        };
        let Some((a, b)) = l.contiguous_offsets() else {
            bail!("scale: expected a contiguous tensor")
        };
        for x in &mut x[a..b] {
            *x *= self.0;
        }
        Ok(())
    }
}

/// Sum of squares of a tensor's f32 values (f64 accumulation).
fn sum_sq(t: &Tensor) -> Result<f64> {
    let (guard, layout) = t.storage_and_layout();
    let Storage::Cpu(s) = &*guard else {
        return Err(candle_core::Error::Msg("gradients must live on the CPU".into()).into());
    };
    match cpu_f32(s, layout, "grad norm") {
        Ok(x) => Ok(x.iter().map(|&v| (v as f64) * (v as f64)).sum()),
        Err(_) => {
            drop(guard);
            let x: Vec<f32> = t
                .flatten_all()?
                .to_dtype(candle_core::DType::F32)?
                .to_vec1()?;
            Ok(x.iter().map(|&v| (v as f64) * (v as f64)).sum())
        }
    }
}

/// Global gradient-norm clipping (`torch.nn.utils.clip_grad_norm_`).
///
/// Computes the L2 norm over the gradients of all `vars` (those without a
/// gradient are skipped) and returns it (pre-clip). If it exceeds `max_norm`
/// every gradient is scaled in place by `max_norm / (norm + 1e-6)`. When the
/// norm is not finite the gradients are left as they are: skip the step.
pub fn clip_grad_norm(grads: &mut GradStore, vars: &[Var], max_norm: f32) -> Result<f32> {
    let mut total = 0f64;
    for var in vars {
        if let Some(g) = grads.get(var) {
            total += sum_sq(g)?;
        }
    }
    let norm = total.sqrt() as f32;
    if !norm.is_finite() {
        return Ok(norm);
    }
    let coef = max_norm / (norm + 1e-6);
    if coef < 1.0 {
        for var in vars {
            if let Some(g) = grads.get(var) {
                let g = g.contiguous()?;
                g.inplace_op1(&Scale(coef))?;
                grads.insert(var, g);
            }
        }
    }
    Ok(norm)
}

impl Adam {
    /// A fresh optimizer (step 0, zero moments) over `vars`.
    pub fn new(vars: Vec<Var>, config: AdamConfig) -> Result<Self> {
        config.validate()?;
        for (i, v) in vars.iter().enumerate() {
            if v.dtype() != candle_core::DType::F32 || !v.device().is_cpu() {
                return Err(NnError::bad_input(
                    "vars",
                    "f32 vars on the CPU",
                    format!("var {i}: {:?}", v.dtype()),
                ));
            }
        }
        let zeros = || {
            vars.iter()
                .map(|v| vec![0f32; v.elem_count()])
                .collect::<Vec<_>>()
        };
        let state = AdamState {
            step: 0,
            m: zeros(),
            v: zeros(),
        };
        Ok(Self {
            vars,
            config,
            state,
        })
    }

    /// The hyperparameters.
    pub fn config(&self) -> &AdamConfig {
        &self.config
    }

    /// The current learning rate.
    pub fn lr(&self) -> f64 {
        self.config.lr
    }

    /// Changes the learning rate (for schedules); takes effect on the next step.
    pub fn set_lr(&mut self, lr: f64) {
        self.config.lr = lr;
    }

    /// Number of steps taken so far.
    pub fn step_count(&self) -> u64 {
        self.state.step
    }

    /// The vars being optimised, in the order given to [`Self::new`].
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// One Adam step using the gradients in `grads` (from `loss.backward()`,
    /// optionally clipped by [`clip_grad_norm`]). Updates the vars in place.
    pub fn step(&mut self, grads: &GradStore) -> Result<()> {
        self.state.step += 1;
        let t = self.state.step as f64;
        let c = &self.config;
        let coeffs = AdamCoeffs {
            beta1: c.beta1 as f32,
            beta2: c.beta2 as f32,
            step_size: (c.lr / (1.0 - c.beta1.powf(t))) as f32,
            inv_bc2_sqrt: (1.0 / (1.0 - c.beta2.powf(t)).sqrt()) as f32,
            eps: c.eps as f32,
            weight_decay: c.weight_decay as f32,
        };
        for ((var, m), v) in self
            .vars
            .iter()
            .zip(&mut self.state.m)
            .zip(&mut self.state.v)
        {
            let Some(g) = grads.get(var) else { continue };
            let kernel = AdamKernel {
                m: RefCell::new(m),
                v: RefCell::new(v),
                coeffs,
            };
            if g.is_contiguous() {
                var.inplace_op2(g, &kernel)?;
            } else {
                var.inplace_op2(&g.contiguous()?, &kernel)?;
            }
        }
        Ok(())
    }

    /// A copy of the resumable state.
    pub fn state(&self) -> AdamState {
        self.state.clone()
    }

    /// Restores a state taken from an optimizer over vars of the same shapes.
    /// All-or-nothing: on error the optimizer is unchanged.
    pub fn set_state(&mut self, state: AdamState) -> Result<()> {
        if state.m.len() != self.vars.len() || state.v.len() != self.vars.len() {
            return Err(NnError::bad_input(
                "adam state",
                format!("{} vars", self.vars.len()),
                format!(
                    "{} first and {} second moments",
                    state.m.len(),
                    state.v.len()
                ),
            ));
        }
        for (i, var) in self.vars.iter().enumerate() {
            for (kind, buf) in [("m", &state.m[i]), ("v", &state.v[i])] {
                let name = format!("{kind}.{i}");
                if buf.len() != var.elem_count() {
                    return Err(NnError::ShapeMismatch {
                        name,
                        expected: var.dims().to_vec(),
                        got: vec![buf.len()],
                        detail: String::new(),
                    });
                }
                if let Some((index, &value)) = buf.iter().enumerate().find(|(_, x)| !x.is_finite())
                {
                    return Err(NnError::NonFinite {
                        name,
                        shape: var.dims().to_vec(),
                        index,
                        value,
                    });
                }
            }
        }
        self.state = state;
        Ok(())
    }

    /// Writes the state (step in the metadata, moments as `m.{i}` / `v.{i}`
    /// tensors) to a safetensors file. The hyperparameters are recorded in
    /// the metadata for reference but are not restored by [`Self::load`]:
    /// they come from the config the optimizer is built with.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let mut tensors: Vec<NamedTensor> = Vec::with_capacity(2 * self.vars.len());
        for (i, var) in self.vars.iter().enumerate() {
            tensors.push((
                format!("m.{i}"),
                var.dims().to_vec(),
                self.state.m[i].clone(),
            ));
            tensors.push((
                format!("v.{i}"),
                var.dims().to_vec(),
                self.state.v[i].clone(),
            ));
        }
        let c = &self.config;
        let meta: HashMap<String, String> = [
            ("format", ADAM_FORMAT.to_string()),
            ("step", self.state.step.to_string()),
            ("num_vars", self.vars.len().to_string()),
            ("lr", c.lr.to_string()),
            ("beta1", c.beta1.to_string()),
            ("beta2", c.beta2.to_string()),
            ("eps", c.eps.to_string()),
            ("weight_decay", c.weight_decay.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        write_safetensors(path.as_ref(), &tensors, meta)
    }

    /// Restores the state written by [`Self::save`] (validated, all-or-nothing).
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let err = |reason: String| NnError::Checkpoint {
            path: path.to_path_buf(),
            reason,
        };
        let (tensors, meta) = read_safetensors(path)?;
        if meta.get("format").map(String::as_str) != Some(ADAM_FORMAT) {
            return Err(err(format!(
                "format is {:?}, expected `{ADAM_FORMAT}`",
                meta.get("format")
            )));
        }
        let step: u64 = meta
            .get("step")
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| err("missing or bad `step` metadata".into()))?;
        let mut by_name: HashMap<String, (Vec<usize>, Vec<f32>)> =
            tensors.into_iter().map(|(n, s, d)| (n, (s, d))).collect();
        let mut m = Vec::with_capacity(self.vars.len());
        let mut v = Vec::with_capacity(self.vars.len());
        for (i, var) in self.vars.iter().enumerate() {
            for (kind, out) in [("m", &mut m), ("v", &mut v)] {
                let name = format!("{kind}.{i}");
                let Some((shape, data)) = by_name.remove(&name) else {
                    return Err(NnError::MissingParameter {
                        name,
                        expected: var.dims().to_vec(),
                    });
                };
                if shape != var.dims() {
                    return Err(NnError::ShapeMismatch {
                        name,
                        expected: var.dims().to_vec(),
                        got: shape,
                        detail: String::new(),
                    });
                }
                out.push(data);
            }
        }
        if let Some((name, (shape, _))) = by_name.into_iter().min_by(|a, b| a.0.cmp(&b.0)) {
            return Err(NnError::UnexpectedParameter { name, got: shape });
        }
        self.set_state(AdamState { step, m, v })
    }
}

// ---------------------------------------------------------------- RMSprop

/// `format` metadata written into RMSprop state files.
pub const RMSPROP_FORMAT: &str = "relay-nn/rmsprop";

/// Hyperparameters of [`RmsProp`]. Defaults are Stable-Baselines3's A2C
/// (`RMSprop(alpha=0.99, eps=1e-5, weight_decay=0)`, lr `7e-4`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RmsPropConfig {
    /// Learning rate. Default `7e-4` (SB3 A2C).
    pub lr: f64,
    /// Decay of the running mean of squared gradients. Default `0.99`.
    pub alpha: f64,
    /// Added to the root-mean-square. Default `1e-5` (SB3 A2C; PyTorch's own
    /// default is `1e-8`).
    pub eps: f64,
    /// L2 penalty added to the gradient. Default `0.0`.
    pub weight_decay: f64,
    /// Momentum of the update (0 disables the buffer). Default `0.0`.
    pub momentum: f64,
    /// Divide by the centred second moment `E[g^2] - E[g]^2`. Default `false`.
    pub centered: bool,
}

impl Default for RmsPropConfig {
    fn default() -> Self {
        Self {
            lr: 7e-4,
            alpha: 0.99,
            eps: 1e-5,
            weight_decay: 0.0,
            momentum: 0.0,
            centered: false,
        }
    }
}

impl RmsPropConfig {
    /// Checks ranges; the error names the field.
    pub fn validate(&self) -> Result<()> {
        let nonneg = |field: &'static str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(NnError::config(
                    field,
                    format!("must be finite and >= 0, got {v}"),
                ))
            }
        };
        nonneg("lr", self.lr)?;
        nonneg("eps", self.eps)?;
        nonneg("weight_decay", self.weight_decay)?;
        if !(0.0..1.0).contains(&self.momentum) {
            return Err(NnError::config(
                "momentum",
                format!("must be in [0, 1), got {}", self.momentum),
            ));
        }
        if !(0.0..1.0).contains(&self.alpha) {
            return Err(NnError::config(
                "alpha",
                format!("must be in [0, 1), got {}", self.alpha),
            ));
        }
        Ok(())
    }
}

/// The resumable state of [`RmsProp`] (one entry per var, in var order;
/// `grad_avg` only when centred and `momentum_buffer` only with momentum,
/// empty vectors otherwise).
#[derive(Debug, Clone, PartialEq)]
pub struct RmsPropState {
    /// Number of steps taken.
    pub step: u64,
    /// Running mean of squared gradients.
    pub square_avg: Vec<Vec<f32>>,
    /// Running mean of gradients (centred only).
    pub grad_avg: Vec<Vec<f32>>,
    /// Momentum buffers (momentum > 0 only).
    pub momentum_buffer: Vec<Vec<f32>>,
}

/// RMSprop over a fixed list of `Var`s, exactly `torch.optim.RMSprop`:
///
/// ```text
/// g  = grad + weight_decay * p
/// v  = alpha * v + (1 - alpha) g^2
/// d  = sqrt(v) + eps                      (centred: sqrt(v - m^2) + eps, m = alpha m + (1 - alpha) g)
/// p -= lr * g / d                         (momentum: b = momentum b + g / d; p -= lr b)
/// ```
///
/// A var without a gradient in a step is left untouched.
pub struct RmsProp {
    vars: Vec<Var>,
    config: RmsPropConfig,
    state: RmsPropState,
}

impl std::fmt::Debug for RmsProp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RmsProp")
            .field("config", &self.config)
            .field("step", &self.state.step)
            .field("vars", &self.vars.len())
            .finish()
    }
}

struct RmsPropKernel<'a> {
    config: RmsPropConfig,
    square_avg: RefCell<&'a mut [f32]>,
    grad_avg: RefCell<&'a mut [f32]>,
    momentum_buffer: RefCell<&'a mut [f32]>,
}

impl InplaceOp2 for RmsPropKernel<'_> {
    fn name(&self) -> &'static str {
        "relay-rmsprop"
    }

    fn cpu_fwd(
        &self,
        ps: &mut CpuStorage,
        pl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> candle_core::Result<()> {
        let g = cpu_f32(gs, gl, "rmsprop grad")?;
        let CpuStorage::F32(p) = ps else {
            bail!("rmsprop: parameters must be f32")
        };
        let Some((a, b)) = pl.contiguous_offsets() else {
            bail!("rmsprop: parameters must be contiguous")
        };
        let p = &mut p[a..b];
        let mut v = self.square_avg.borrow_mut();
        let mut m = self.grad_avg.borrow_mut();
        let mut buf = self.momentum_buffer.borrow_mut();
        let c = &self.config;
        if p.len() != g.len()
            || v.len() != p.len()
            || (c.centered && m.len() != p.len())
            || (c.momentum > 0.0 && buf.len() != p.len())
        {
            bail!(
                "rmsprop: parameter has {} values, gradient {}",
                p.len(),
                g.len()
            )
        }
        let (alpha, eps, lr, wd, mom) = (
            c.alpha as f32,
            c.eps as f32,
            c.lr as f32,
            c.weight_decay as f32,
            c.momentum as f32,
        );
        for i in 0..p.len() {
            let gi = g[i] + wd * p[i];
            v[i] = alpha * v[i] + (1.0 - alpha) * gi * gi;
            let denom = if c.centered {
                m[i] = alpha * m[i] + (1.0 - alpha) * gi;
                (v[i] - m[i] * m[i]).sqrt() + eps
            } else {
                v[i].sqrt() + eps
            };
            if mom > 0.0 {
                buf[i] = mom * buf[i] + gi / denom;
                p[i] -= lr * buf[i];
            } else {
                p[i] -= lr * gi / denom;
            }
        }
        Ok(())
    }
}

impl RmsProp {
    /// A fresh optimizer (zero averages) over `vars`.
    pub fn new(vars: Vec<Var>, config: RmsPropConfig) -> Result<Self> {
        config.validate()?;
        for (i, v) in vars.iter().enumerate() {
            if v.dtype() != candle_core::DType::F32 || !v.device().is_cpu() {
                return Err(NnError::bad_input(
                    "vars",
                    "f32 vars on the CPU",
                    format!("var {i}: {:?}", v.dtype()),
                ));
            }
        }
        let buffers = |on: bool| -> Vec<Vec<f32>> {
            vars.iter()
                .map(|v| {
                    if on {
                        vec![0f32; v.elem_count()]
                    } else {
                        Vec::new()
                    }
                })
                .collect()
        };
        let state = RmsPropState {
            step: 0,
            square_avg: buffers(true),
            grad_avg: buffers(config.centered),
            momentum_buffer: buffers(config.momentum > 0.0),
        };
        Ok(Self {
            vars,
            config,
            state,
        })
    }

    /// The hyperparameters.
    pub fn config(&self) -> &RmsPropConfig {
        &self.config
    }

    /// The current learning rate.
    pub fn lr(&self) -> f64 {
        self.config.lr
    }

    /// Changes the learning rate (for schedules); takes effect on the next step.
    pub fn set_lr(&mut self, lr: f64) {
        self.config.lr = lr;
    }

    /// Number of steps taken so far.
    pub fn step_count(&self) -> u64 {
        self.state.step
    }

    /// The vars being optimised, in the order given to [`Self::new`].
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// One step using the gradients in `grads`; updates the vars in place.
    pub fn step(&mut self, grads: &GradStore) -> Result<()> {
        self.state.step += 1;
        let s = &mut self.state;
        for (i, var) in self.vars.iter().enumerate() {
            let Some(g) = grads.get(var) else { continue };
            let kernel = RmsPropKernel {
                config: self.config,
                square_avg: RefCell::new(&mut s.square_avg[i]),
                grad_avg: RefCell::new(&mut s.grad_avg[i]),
                momentum_buffer: RefCell::new(&mut s.momentum_buffer[i]),
            };
            if g.is_contiguous() {
                var.inplace_op2(g, &kernel)?;
            } else {
                var.inplace_op2(&g.contiguous()?, &kernel)?;
            }
        }
        Ok(())
    }

    /// A copy of the resumable state.
    pub fn state(&self) -> RmsPropState {
        self.state.clone()
    }

    /// Restores a state taken from an optimizer with the same config over
    /// vars of the same shapes. All-or-nothing.
    pub fn set_state(&mut self, state: RmsPropState) -> Result<()> {
        let n = self.vars.len();
        for (kind, bufs, on) in [
            ("square_avg", &state.square_avg, true),
            ("grad_avg", &state.grad_avg, self.config.centered),
            (
                "momentum_buffer",
                &state.momentum_buffer,
                self.config.momentum > 0.0,
            ),
        ] {
            if bufs.len() != n {
                return Err(NnError::bad_input(
                    "rmsprop state",
                    format!("{n} {kind} buffers"),
                    bufs.len(),
                ));
            }
            for (i, (buf, var)) in bufs.iter().zip(&self.vars).enumerate() {
                let want = if on { var.elem_count() } else { 0 };
                if buf.len() != want {
                    return Err(NnError::ShapeMismatch {
                        name: format!("{kind}.{i}"),
                        expected: vec![want],
                        got: vec![buf.len()],
                        detail: String::new(),
                    });
                }
                if let Some((index, &value)) = buf.iter().enumerate().find(|(_, x)| !x.is_finite())
                {
                    return Err(NnError::NonFinite {
                        name: format!("{kind}.{i}"),
                        shape: var.dims().to_vec(),
                        index,
                        value,
                    });
                }
            }
        }
        self.state = state;
        Ok(())
    }

    /// Writes the state (step in the metadata; `square_avg.{i}`, and
    /// `grad_avg.{i}` / `momentum_buffer.{i}` when used) to a safetensors file.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let mut tensors: Vec<NamedTensor> = Vec::new();
        for (kind, bufs) in [
            ("square_avg", &self.state.square_avg),
            ("grad_avg", &self.state.grad_avg),
            ("momentum_buffer", &self.state.momentum_buffer),
        ] {
            for (i, (buf, var)) in bufs.iter().zip(&self.vars).enumerate() {
                if !buf.is_empty() {
                    tensors.push((format!("{kind}.{i}"), var.dims().to_vec(), buf.clone()));
                }
            }
        }
        let c = &self.config;
        let meta: HashMap<String, String> = [
            ("format", RMSPROP_FORMAT.to_string()),
            ("step", self.state.step.to_string()),
            ("num_vars", self.vars.len().to_string()),
            ("lr", c.lr.to_string()),
            ("alpha", c.alpha.to_string()),
            ("eps", c.eps.to_string()),
            ("weight_decay", c.weight_decay.to_string()),
            ("momentum", c.momentum.to_string()),
            ("centered", c.centered.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        write_safetensors(path.as_ref(), &tensors, meta)
    }

    /// Restores the state written by [`Self::save`] (validated,
    /// all-or-nothing; the hyperparameters come from the config).
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let (tensors, meta) = read_safetensors(path)?;
        let err = |reason: String| NnError::Checkpoint {
            path: path.to_path_buf(),
            reason,
        };
        if meta.get("format").map(String::as_str) != Some(RMSPROP_FORMAT) {
            return Err(err(format!(
                "format is {:?}, expected `{RMSPROP_FORMAT}`",
                meta.get("format")
            )));
        }
        let step: u64 = meta
            .get("step")
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| err("missing or bad `step` metadata".into()))?;
        let mut by_name: HashMap<String, (Vec<usize>, Vec<f32>)> =
            tensors.into_iter().map(|(n, s, d)| (n, (s, d))).collect();
        let mut take = |kind: &str, on: bool| -> Result<Vec<Vec<f32>>> {
            let mut out = Vec::with_capacity(self.vars.len());
            for (i, var) in self.vars.iter().enumerate() {
                if !on {
                    out.push(Vec::new());
                    continue;
                }
                let name = format!("{kind}.{i}");
                let Some((shape, data)) = by_name.remove(&name) else {
                    return Err(NnError::MissingParameter {
                        name,
                        expected: var.dims().to_vec(),
                    });
                };
                if shape != var.dims() {
                    return Err(NnError::ShapeMismatch {
                        name,
                        expected: var.dims().to_vec(),
                        got: shape,
                        detail: String::new(),
                    });
                }
                out.push(data);
            }
            Ok(out)
        };
        let square_avg = take("square_avg", true)?;
        let grad_avg = take("grad_avg", self.config.centered)?;
        let momentum_buffer = take("momentum_buffer", self.config.momentum > 0.0)?;
        if let Some((name, (shape, _))) = by_name.into_iter().min_by(|a, b| a.0.cmp(&b.0)) {
            return Err(NnError::UnexpectedParameter { name, got: shape });
        }
        self.set_state(RmsPropState {
            step,
            square_avg,
            grad_avg,
            momentum_buffer,
        })
    }
}

#[cfg(test)]
mod rmsprop_tests {
    use super::*;
    use candle_core::Device;

    /// `torch.optim.RMSprop` by hand, in f64, for one scalar parameter.
    fn reference(c: &RmsPropConfig, mut p: f64, grads: &[f64]) -> f64 {
        let (mut v, mut m, mut b) = (0f64, 0f64, 0f64);
        for &g in grads {
            let g = g + c.weight_decay * p;
            v = c.alpha * v + (1.0 - c.alpha) * g * g;
            let d = if c.centered {
                m = c.alpha * m + (1.0 - c.alpha) * g;
                (v - m * m).sqrt() + c.eps
            } else {
                v.sqrt() + c.eps
            };
            if c.momentum > 0.0 {
                b = c.momentum * b + g / d;
                p -= c.lr * b;
            } else {
                p -= c.lr * g / d;
            }
        }
        p
    }

    #[test]
    fn matches_the_pytorch_update_and_resumes() {
        let configs = [
            RmsPropConfig::default(),
            RmsPropConfig {
                lr: 0.01,
                centered: true,
                momentum: 0.9,
                weight_decay: 0.1,
                ..Default::default()
            },
        ];
        for c in configs {
            // loss = sum(k * p^2 / 2) => grad = k * p.
            let k = [1.0f32, -3.0, 0.5];
            let p0 = [0.5f32, 1.0, -2.0];
            let var = Var::from_slice(&p0, 3, &Device::Cpu).unwrap();
            let kt = Tensor::new(&k, &Device::Cpu).unwrap();
            let mut opt = RmsProp::new(vec![var.clone()], c).unwrap();
            let loss = |var: &Var| {
                ((var.as_tensor().sqr().unwrap() * &kt)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    * 0.5)
                    .unwrap()
            };
            let mut grads_seen: Vec<Vec<f64>> = vec![Vec::new(); 3];
            let mut state_after_2 = None;
            let mut p_after_2 = None;
            for step in 0..4 {
                let p: Vec<f32> = var.as_tensor().to_vec1().unwrap();
                for i in 0..3 {
                    grads_seen[i].push((k[i] * p[i]) as f64);
                }
                opt.step(&loss(&var).backward().unwrap()).unwrap();
                if step == 1 {
                    state_after_2 = Some(opt.state());
                    p_after_2 = Some(var.as_tensor().to_vec1::<f32>().unwrap());
                }
            }
            let p: Vec<f32> = var.as_tensor().to_vec1().unwrap();
            for i in 0..3 {
                let r = reference(&c, p0[i] as f64, &grads_seen[i]);
                assert!((p[i] as f64 - r).abs() < 1e-5, "{c:?} {i}: {} vs {r}", p[i]);
            }
            // Resume from the saved state after 2 steps: same result bit for bit.
            let path = std::env::temp_dir().join(format!(
                "relay-nn-rmsprop-{}-{}.safetensors",
                std::process::id(),
                c.centered
            ));
            let var2 = Var::from_slice(&p_after_2.unwrap(), 3, &Device::Cpu).unwrap();
            let mut saved = RmsProp::new(vec![var2.clone()], c).unwrap();
            saved.set_state(state_after_2.unwrap()).unwrap();
            saved.save(&path).unwrap();
            let mut resumed = RmsProp::new(vec![var2.clone()], c).unwrap();
            resumed.load(&path).unwrap();
            std::fs::remove_file(&path).unwrap();
            assert_eq!(resumed.step_count(), 2);
            for _ in 0..2 {
                resumed.step(&loss(&var2).backward().unwrap()).unwrap();
            }
            assert_eq!(var2.as_tensor().to_vec1::<f32>().unwrap(), p);
        }
        assert!(RmsProp::new(
            vec![],
            RmsPropConfig {
                alpha: 1.0,
                ..Default::default()
            }
        )
        .is_err());
    }
}
