//! Adam, RMSprop and global gradient-norm clipping.
//!
//! Our own Adam rather than candle-nn's `AdamW` (which defaults to weight
//! decay 0.01 and cannot save its state): the update is exactly
//! `torch.optim.Adam`'s, and its state (step count, first and second
//! moments) saves to safetensors so a resumed run continues bit-for-bit.
//! [`RmsProp`] (A2C's optimizer in SB3) is `torch.optim.RMSprop`, with the
//! same resumable state.
//!
//! Where the update runs follows the vars ([`crate::ops::fused_on`]): for
//! vars on the CPU the moments are host buffers and one fused kernel per
//! var updates parameter and moments in place (no temporaries); for vars on
//! a GPU the moments are tensors beside them and the same formula runs as a
//! handful of elementwise candle ops per var, so nothing crosses to the
//! host. Both save the same state files.
//!
//! This file holds Adam and what both optimizers share (the buffers, the
//! choice of path) and the tests that run both paths; [`RmsProp`] is
//! `optim/rmsprop.rs`, [`clip_grad_norm`] `optim/clip.rs`.

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::Path;

use candle_core::backprop::GradStore;
use candle_core::{bail, CpuStorage, DType, InplaceOp2, Layout, Tensor, Var};
use serde::{Deserialize, Serialize};

use crate::error::{NnError, Result};
use crate::io::{read_safetensors, write_safetensors, NamedTensor};
use crate::kernels::{self, AdamCoeffs};
use crate::ops::{cpu_f32, fused_on};

mod clip;
mod rmsprop;

pub use clip::clip_grad_norm;
pub use rmsprop::{RmsProp, RmsPropConfig, RmsPropState, RMSPROP_FORMAT};

/// One buffer per var (a moment, an average): host vectors updated in place
/// by the fused kernels when the vars are on the CPU, tensors on the vars'
/// device otherwise. An unused buffer (RMSprop without centring or
/// momentum) is empty.
#[derive(Debug, Clone)]
enum Buffers {
    Host(Vec<Vec<f32>>),
    Device(Vec<Tensor>),
}

impl Buffers {
    /// Zeros shaped like each var (empty when `used` is false), where `fused` says.
    fn zeros(vars: &[Var], used: bool, fused: bool) -> Result<Self> {
        let host: Vec<Vec<f32>> = vars
            .iter()
            .map(|v| vec![0f32; if used { v.elem_count() } else { 0 }])
            .collect();
        Self::from_host(host, vars, fused)
    }

    /// Buffers holding `data` (validated by the caller against the vars).
    fn from_host(data: Vec<Vec<f32>>, vars: &[Var], fused: bool) -> Result<Self> {
        if fused {
            return Ok(Self::Host(data));
        }
        let tensors = data
            .into_iter()
            .zip(vars)
            .map(|(d, var)| {
                if d.is_empty() {
                    Tensor::zeros(0, DType::F32, var.device())
                } else {
                    Tensor::from_vec(d, var.shape(), var.device())
                }
            })
            .collect::<candle_core::Result<_>>()?;
        Ok(Self::Device(tensors))
    }

    /// A host copy.
    fn to_host(&self) -> Result<Vec<Vec<f32>>> {
        match self {
            Self::Host(h) => Ok(h.clone()),
            Self::Device(ts) => Ok(ts
                .iter()
                .map(|t| t.flatten_all()?.to_vec1::<f32>())
                .collect::<candle_core::Result<_>>()?),
        }
    }
}

/// Whether `vars` take the fused CPU update; all must share one device and be f32.
fn fused_vars(vars: &[Var]) -> Result<bool> {
    let Some(first) = vars.first() else {
        return Ok(true);
    };
    for (i, v) in vars.iter().enumerate() {
        if v.dtype() != DType::F32 || !v.device().same_device(first.device()) {
            return Err(NnError::bad_input(
                "vars",
                format!("f32 vars on one device ({:?})", first.device().location()),
                format!("var {i}: {:?} on {:?}", v.dtype(), v.device().location()),
            ));
        }
    }
    Ok(fused_on(first.device()))
}

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
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
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
    /// Number of steps taken.
    step: u64,
    m: Buffers,
    v: Buffers,
}

impl std::fmt::Debug for Adam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Adam")
            .field("config", &self.config)
            .field("step", &self.step)
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

/// The Adam update of one var from its gradient in elementwise candle ops
/// on the var's device, the same formula as [`kernels::adam`].
fn adam_composed(
    var: &Var,
    grad: &Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    c: AdamCoeffs,
) -> Result<()> {
    let p = var.as_detached_tensor();
    let mut g = grad.detach();
    if c.weight_decay != 0.0 {
        g = g.add(&p.affine(c.weight_decay as f64, 0.0)?)?;
    }
    let new_m = m
        .affine(c.beta1 as f64, 0.0)?
        .add(&g.affine(1.0 - c.beta1 as f64, 0.0)?)?;
    let new_v = v
        .affine(c.beta2 as f64, 0.0)?
        .add(&g.sqr()?.affine(1.0 - c.beta2 as f64, 0.0)?)?;
    let denom = new_v.sqrt()?.affine(c.inv_bc2_sqrt as f64, c.eps as f64)?;
    let update = new_m.div(&denom)?.affine(c.step_size as f64, 0.0)?;
    var.set(&p.sub(&update)?)?;
    (*m, *v) = (new_m, new_v);
    Ok(())
}

impl Adam {
    /// A fresh optimizer (step 0, zero moments) over `vars`.
    /// The vars must be f32 and on one device; the update runs there.
    pub fn new(vars: Vec<Var>, config: AdamConfig) -> Result<Self> {
        config.validate()?;
        let fused = fused_vars(&vars)?;
        Ok(Self {
            m: Buffers::zeros(&vars, true, fused)?,
            v: Buffers::zeros(&vars, true, fused)?,
            vars,
            config,
            step: 0,
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
        self.step
    }

    /// The vars being optimised, in the order given to [`Self::new`].
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// One Adam step using the gradients in `grads` (from `loss.backward()`,
    /// optionally clipped by [`clip_grad_norm`]). Updates the vars in place.
    pub fn step(&mut self, grads: &GradStore) -> Result<()> {
        self.step += 1;
        let t = self.step as f64;
        let c = &self.config;
        let coeffs = AdamCoeffs {
            beta1: c.beta1 as f32,
            beta2: c.beta2 as f32,
            step_size: (c.lr / (1.0 - c.beta1.powf(t))) as f32,
            inv_bc2_sqrt: (1.0 / (1.0 - c.beta2.powf(t)).sqrt()) as f32,
            eps: c.eps as f32,
            weight_decay: c.weight_decay as f32,
        };
        match (&mut self.m, &mut self.v) {
            (Buffers::Host(ms), Buffers::Host(vs)) => {
                for ((var, m), v) in self.vars.iter().zip(ms).zip(vs) {
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
            }
            (Buffers::Device(ms), Buffers::Device(vs)) => {
                for ((var, m), v) in self.vars.iter().zip(ms).zip(vs) {
                    let Some(g) = grads.get(var) else { continue };
                    adam_composed(var, g, m, v, coeffs)?;
                }
            }
            _ => unreachable!("both moments are built on the same side"),
        }
        Ok(())
    }

    /// A copy of the resumable state (read back from the device when the
    /// vars live on one).
    pub fn state(&self) -> Result<AdamState> {
        Ok(AdamState {
            step: self.step,
            m: self.m.to_host()?,
            v: self.v.to_host()?,
        })
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
        let fused = matches!(self.m, Buffers::Host(_));
        let m = Buffers::from_host(state.m, &self.vars, fused)?;
        let v = Buffers::from_host(state.v, &self.vars, fused)?;
        (self.step, self.m, self.v) = (state.step, m, v);
        Ok(())
    }

    /// Writes the state (step in the metadata, moments as `m.{i}` / `v.{i}`
    /// tensors) to a safetensors file. The hyperparameters are recorded in
    /// the metadata for reference but are not restored by [`Self::load`]:
    /// they come from the config the optimizer is built with.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let state = self.state()?;
        let mut tensors: Vec<NamedTensor> = Vec::with_capacity(2 * self.vars.len());
        for ((i, var), (m, v)) in self
            .vars
            .iter()
            .enumerate()
            .zip(state.m.into_iter().zip(state.v))
        {
            tensors.push((format!("m.{i}"), var.dims().to_vec(), m));
            tensors.push((format!("v.{i}"), var.dims().to_vec(), v));
        }
        let c = &self.config;
        let meta: HashMap<String, String> = [
            ("format", ADAM_FORMAT.to_string()),
            ("step", state.step.to_string()),
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

#[cfg(test)]
mod composed_tests {
    //! The device-generic updates (what a GPU runs) against the fused CPU
    //! kernels: same parameters step by step, same saved state, and a state
    //! taken on one side resumes on the other.
    use super::*;
    use crate::ops::composed_on_cpu;
    use candle_core::Device;

    fn vars() -> Vec<Var> {
        [vec![0.5f32, 1.0, -2.0, 0.25], vec![3.0f32, -0.5]]
            .iter()
            .map(|p| Var::from_slice(p, p.len(), &Device::Cpu).unwrap())
            .collect()
    }

    /// `sum(k * p^2 / 2)` with a per-step `k`: gradients vary in sign and size.
    fn grads(vars: &[Var], step: usize) -> GradStore {
        let mut loss = Tensor::new(0f32, &Device::Cpu).unwrap();
        for (i, v) in vars.iter().enumerate() {
            let k = (((step * 7 + i * 3) % 5) as f64 - 2.0) * 0.7 + 0.1;
            let term = (v.as_tensor().sqr().unwrap().sum_all().unwrap() * (0.5 * k)).unwrap();
            loss = (loss + term).unwrap();
        }
        loss.backward().unwrap()
    }

    fn values(vars: &[Var]) -> Vec<Vec<f32>> {
        vars.iter()
            .map(|v| v.as_tensor().to_vec1().unwrap())
            .collect()
    }

    fn close(a: &[Vec<f32>], b: &[Vec<f32>], tol: f32) {
        for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
            assert!((x - y).abs() <= tol * (1.0 + y.abs()), "{x} vs {y}");
        }
    }

    #[test]
    fn adam_on_the_device_path_matches_the_fused_kernel() {
        let config = AdamConfig {
            lr: 0.05,
            weight_decay: 0.01,
            ..Default::default()
        };
        let (fused_vars, device_vars) = (vars(), vars());
        let mut fused = Adam::new(fused_vars.clone(), config).unwrap();
        let mut device = composed_on_cpu(|| Adam::new(device_vars.clone(), config)).unwrap();
        assert!(matches!(device.m, Buffers::Device(_)));
        for step in 0..6 {
            fused.step(&grads(&fused_vars, step)).unwrap();
            device.step(&grads(&device_vars, step)).unwrap();
            close(&values(&fused_vars), &values(&device_vars), 1e-6);
        }
        let (a, b) = (fused.state().unwrap(), device.state().unwrap());
        assert_eq!(a.step, b.step);
        close(&a.m, &b.m, 1e-6);
        close(&a.v, &b.v, 1e-6);
        // The fused state resumes on the device path and goes on alike.
        device.set_state(a).unwrap();
        for step in 6..8 {
            fused.step(&grads(&fused_vars, step)).unwrap();
            device.step(&grads(&device_vars, step)).unwrap();
        }
        close(&values(&fused_vars), &values(&device_vars), 1e-6);
    }

    #[test]
    fn rmsprop_on_the_device_path_matches_the_fused_kernel() {
        for config in [
            RmsPropConfig::default(),
            RmsPropConfig {
                lr: 0.01,
                centered: true,
                momentum: 0.9,
                weight_decay: 0.1,
                ..Default::default()
            },
        ] {
            let (fused_vars, device_vars) = (vars(), vars());
            let mut fused = RmsProp::new(fused_vars.clone(), config).unwrap();
            let mut device = composed_on_cpu(|| RmsProp::new(device_vars.clone(), config)).unwrap();
            for step in 0..6 {
                fused.step(&grads(&fused_vars, step)).unwrap();
                device.step(&grads(&device_vars, step)).unwrap();
                close(&values(&fused_vars), &values(&device_vars), 1e-6);
            }
            let (a, b) = (fused.state().unwrap(), device.state().unwrap());
            close(&a.square_avg, &b.square_avg, 1e-6);
            close(&a.grad_avg, &b.grad_avg, 1e-6);
            close(&a.momentum_buffer, &b.momentum_buffer, 1e-6);
            assert_eq!(
                a.momentum_buffer.iter().map(Vec::len).collect::<Vec<_>>(),
                b.momentum_buffer.iter().map(Vec::len).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn clipping_on_the_device_path_matches_the_fused_one() {
        let vars = vars();
        let mut fused = grads(&vars, 1);
        let mut device = grads(&vars, 1);
        let n1 = clip_grad_norm(&mut fused, &vars, 0.3).unwrap();
        let n2 = composed_on_cpu(|| clip_grad_norm(&mut device, &vars, 0.3)).unwrap();
        assert!((n1 - n2).abs() < 1e-6 * n1, "{n1} vs {n2}");
        assert!(n1 > 0.3, "the test must clip");
        for v in &vars {
            let a: Vec<f32> = fused.get(v).unwrap().to_vec1().unwrap();
            let b: Vec<f32> = device.get(v).unwrap().to_vec1().unwrap();
            close(&[a], &[b], 1e-6);
        }
    }

    #[test]
    fn vars_on_different_devices_or_dtypes_are_refused() {
        let bf16 = Var::from_tensor(&Tensor::zeros(2, DType::BF16, &Device::Cpu).unwrap()).unwrap();
        let err = Adam::new(vec![vars()[0].clone(), bf16], AdamConfig::default()).unwrap_err();
        assert!(err.to_string().contains("var 1"), "{err}");
    }
}
