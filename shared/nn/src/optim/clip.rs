//! Global gradient-norm clipping, [`clip_grad_norm`]
//! (`torch.nn.utils.clip_grad_norm_`), on the fused path in place and on
//! other devices with one read-back. Its own file because it is no
//! optimizer: it works on any gradients, before any of them.

use candle_core::backprop::GradStore;
use candle_core::{bail, CpuStorage, DType, InplaceOp1, Layout, Storage, Tensor, Var};

use crate::error::Result;
use crate::ops::{cpu_f32, fused_on};

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
///
/// Gradients off the fused path are summed on their device and read back
/// once, so a GPU step synchronises once here, not once per parameter.
pub fn clip_grad_norm(grads: &mut GradStore, vars: &[Var], max_norm: f32) -> Result<f32> {
    let mut total = 0f64;
    let mut on_device: Option<Tensor> = None;
    for var in vars {
        if let Some(g) = grads.get(var) {
            if fused_on(g.device()) {
                total += sum_sq(g)?;
            } else {
                let sq = g.to_dtype(DType::F32)?.sqr()?.sum_all()?;
                on_device = Some(match on_device {
                    None => sq,
                    Some(sum) => sum.add(&sq)?,
                });
            }
        }
    }
    if let Some(sum) = on_device {
        total += sum.to_scalar::<f32>()? as f64;
    }
    let norm = total.sqrt() as f32;
    if !norm.is_finite() {
        return Ok(norm);
    }
    let coef = max_norm / (norm + 1e-6);
    if coef < 1.0 {
        for var in vars {
            if let Some(g) = grads.get(var) {
                let g = if fused_on(g.device()) {
                    let g = g.contiguous()?;
                    g.inplace_op1(&Scale(coef))?;
                    g
                } else {
                    g.affine(coef as f64, 0.0)?
                };
                grads.insert(var, g);
            }
        }
    }
    Ok(norm)
}
