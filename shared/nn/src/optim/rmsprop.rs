//! [`RmsProp`], `torch.optim.RMSprop` (A2C's optimizer in SB3): its
//! config, the fused CPU update and the composed one for other devices,
//! and its resumable state.
//!
//! Its own file because it shares nothing with Adam but the buffers and
//! the choice of path ([`super`]), which stay in the parent.

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::Path;

use candle_core::backprop::GradStore;
use candle_core::{bail, CpuStorage, InplaceOp2, Layout, Tensor, Var};
use serde::{Deserialize, Serialize};

use super::{fused_vars, Buffers};
use crate::error::{NnError, Result};
use crate::io::{read_safetensors, write_safetensors, NamedTensor};
use crate::ops::cpu_f32;

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
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
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
    /// Number of steps taken.
    step: u64,
    square_avg: Buffers,
    grad_avg: Buffers,
    momentum_buffer: Buffers,
}

impl std::fmt::Debug for RmsProp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RmsProp")
            .field("config", &self.config)
            .field("step", &self.step)
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

/// The RMSprop update of one var in elementwise candle ops on its device,
/// the same formula as [`RmsPropKernel`]; `buffers` are the square average,
/// the gradient average and the momentum buffer (the last two empty when
/// unused).
fn rmsprop_composed(
    c: &RmsPropConfig,
    var: &Var,
    grad: &Tensor,
    buffers: [&mut Tensor; 3],
) -> Result<()> {
    let [square_avg, grad_avg, momentum_buffer] = buffers;
    let p = var.as_detached_tensor();
    let mut g = grad.detach();
    if c.weight_decay != 0.0 {
        g = g.add(&p.affine(c.weight_decay, 0.0)?)?;
    }
    let keep = |t: &Tensor, new: &Tensor| -> candle_core::Result<Tensor> {
        t.affine(c.alpha, 0.0)?
            .add(&new.affine(1.0 - c.alpha, 0.0)?)
    };
    *square_avg = keep(square_avg, &g.sqr()?)?;
    let spread = if c.centered {
        *grad_avg = keep(grad_avg, &g)?;
        square_avg.sub(&grad_avg.sqr()?)?
    } else {
        square_avg.clone()
    };
    let step = g.div(&spread.sqrt()?.affine(1.0, c.eps)?)?;
    let update = if c.momentum > 0.0 {
        *momentum_buffer = momentum_buffer.affine(c.momentum, 0.0)?.add(&step)?;
        momentum_buffer.clone()
    } else {
        step
    };
    var.set(&p.sub(&update.affine(c.lr, 0.0)?)?)?;
    Ok(())
}

impl RmsProp {
    /// A fresh optimizer (zero averages) over `vars`.
    /// The vars must be f32 and on one device; the update runs there.
    pub fn new(vars: Vec<Var>, config: RmsPropConfig) -> Result<Self> {
        config.validate()?;
        let fused = fused_vars(&vars)?;
        Ok(Self {
            square_avg: Buffers::zeros(&vars, true, fused)?,
            grad_avg: Buffers::zeros(&vars, config.centered, fused)?,
            momentum_buffer: Buffers::zeros(&vars, config.momentum > 0.0, fused)?,
            vars,
            config,
            step: 0,
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
        self.step
    }

    /// The vars being optimised, in the order given to [`Self::new`].
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// One step using the gradients in `grads`; updates the vars in place.
    pub fn step(&mut self, grads: &GradStore) -> Result<()> {
        self.step += 1;
        match (
            &mut self.square_avg,
            &mut self.grad_avg,
            &mut self.momentum_buffer,
        ) {
            (Buffers::Host(sq), Buffers::Host(avg), Buffers::Host(mom)) => {
                for (i, var) in self.vars.iter().enumerate() {
                    let Some(g) = grads.get(var) else { continue };
                    let kernel = RmsPropKernel {
                        config: self.config,
                        square_avg: RefCell::new(&mut sq[i]),
                        grad_avg: RefCell::new(&mut avg[i]),
                        momentum_buffer: RefCell::new(&mut mom[i]),
                    };
                    if g.is_contiguous() {
                        var.inplace_op2(g, &kernel)?;
                    } else {
                        var.inplace_op2(&g.contiguous()?, &kernel)?;
                    }
                }
            }
            (Buffers::Device(sq), Buffers::Device(avg), Buffers::Device(mom)) => {
                for (i, var) in self.vars.iter().enumerate() {
                    let Some(g) = grads.get(var) else { continue };
                    rmsprop_composed(&self.config, var, g, [&mut sq[i], &mut avg[i], &mut mom[i]])?;
                }
            }
            _ => unreachable!("every buffer is built on the same side"),
        }
        Ok(())
    }

    /// A copy of the resumable state (read back from the device when the
    /// vars live on one).
    pub fn state(&self) -> Result<RmsPropState> {
        Ok(RmsPropState {
            step: self.step,
            square_avg: self.square_avg.to_host()?,
            grad_avg: self.grad_avg.to_host()?,
            momentum_buffer: self.momentum_buffer.to_host()?,
        })
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
        let fused = matches!(self.square_avg, Buffers::Host(_));
        let square_avg = Buffers::from_host(state.square_avg, &self.vars, fused)?;
        let grad_avg = Buffers::from_host(state.grad_avg, &self.vars, fused)?;
        let momentum_buffer = Buffers::from_host(state.momentum_buffer, &self.vars, fused)?;
        self.step = state.step;
        (self.square_avg, self.grad_avg, self.momentum_buffer) =
            (square_avg, grad_avg, momentum_buffer);
        Ok(())
    }

    /// Writes the state (step in the metadata; `square_avg.{i}`, and
    /// `grad_avg.{i}` / `momentum_buffer.{i}` when used) to a safetensors file.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let state = self.state()?;
        let mut tensors: Vec<NamedTensor> = Vec::new();
        for (kind, bufs) in [
            ("square_avg", state.square_avg),
            ("grad_avg", state.grad_avg),
            ("momentum_buffer", state.momentum_buffer),
        ] {
            for (i, (buf, var)) in bufs.into_iter().zip(&self.vars).enumerate() {
                if !buf.is_empty() {
                    tensors.push((format!("{kind}.{i}"), var.dims().to_vec(), buf));
                }
            }
        }
        let c = &self.config;
        let meta: HashMap<String, String> = [
            ("format", RMSPROP_FORMAT.to_string()),
            ("step", state.step.to_string()),
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
mod tests {
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
                    state_after_2 = Some(opt.state().unwrap());
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
