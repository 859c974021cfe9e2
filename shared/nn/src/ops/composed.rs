//! The fused ops of [`super`] composed from candle's basic ops, each with
//! candle's own backward and a kernel on every device: what
//! [`super::linear`], [`super::categorical_logprob`],
//! [`super::categorical_entropy`], [`super::gaussian_logprob`] and
//! [`super::gaussian_entropy`] run for tensors off the CPU, where the
//! fused ops (CPU code) cannot. Its own file because it is the other
//! device path, not more ops: the tests (`ops/tests.rs`) check each
//! function here against its fused op.

use candle_core::{DType, Tensor, D};

use super::HALF_LN_2PI;
use crate::spec::Activation;

/// `act(x W^T + b)`.
pub(crate) fn linear(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    act: Option<Activation>,
) -> candle_core::Result<Tensor> {
    let y = x.matmul(&w.t()?)?.broadcast_add(b)?;
    match act {
        Some(Activation::Tanh) => y.tanh(),
        Some(Activation::Relu) => y.relu(),
        None => Ok(y),
    }
}

/// `log_softmax(logits)[b, actions[b]]`, `[B]`.
pub(crate) fn categorical_logprob(logits: &Tensor, actions: &[u32]) -> candle_core::Result<Tensor> {
    let rows = logits.dim(0)?;
    if actions.len() != rows {
        candle_core::bail!(
            "categorical logprob: {} actions for {rows} rows",
            actions.len()
        )
    }
    let actions = Tensor::from_slice(actions, (rows, 1), logits.device())?;
    candle_nn::ops::log_softmax(logits, D::Minus1)?
        .gather(&actions, 1)?
        .squeeze(1)
}

/// `-sum_j p_j log p_j` per row, `[B]`.
pub(crate) fn categorical_entropy(logits: &Tensor) -> candle_core::Result<Tensor> {
    let log_p = candle_nn::ops::log_softmax(logits, D::Minus1)?;
    log_p.exp()?.mul(&log_p)?.sum(1)?.neg()
}

/// `sum_d -0.5 z^2 - log_std[d] - 0.5 ln 2π` per row, `[B]`.
pub(crate) fn gaussian_logprob(
    mean: &Tensor,
    log_std: &Tensor,
    actions: &[f32],
) -> candle_core::Result<Tensor> {
    let actions = Tensor::from_slice(actions, mean.shape(), mean.device())?;
    let z = actions.sub(mean)?.broadcast_mul(&log_std.neg()?.exp()?)?;
    let per_dim = (z.sqr()? * -0.5)?
        .broadcast_sub(log_std)?
        .affine(1.0, -(HALF_LN_2PI as f64))?;
    per_dim.sum(1)
}

/// A scalar worth `loss` whose gradient with respect to `inputs[i]` is
/// `grads[i]`: `loss + s - detach(s)` with `s = Σ_i sum(inputs[i] *
/// grads[i])`, so the value is exactly `loss` (`s - s` is 0) and
/// backward is candle's own, on any device.
pub(crate) fn precomputed_loss(
    inputs: &[&Tensor],
    loss: f32,
    grads: &[Vec<f32>],
) -> candle_core::Result<Tensor> {
    let mut linear: Option<Tensor> = None;
    for (t, g) in inputs.iter().zip(grads) {
        let g = Tensor::from_slice(g, t.shape(), t.device())?.to_dtype(t.dtype())?;
        let term = t.mul(&g)?.sum_all()?.to_dtype(DType::F32)?;
        linear = Some(match linear {
            None => term,
            Some(sum) => sum.add(&term)?,
        });
    }
    let Some(linear) = linear else {
        candle_core::bail!("precomputed loss: no inputs")
    };
    linear.sub(&linear.detach())?.affine(1.0, loss as f64)
}

/// `[tanh(u), Σ_j (-0.5 eps_j^2 - log_std_j - 0.5 ln 2π - ln(1 - tanh(u_j)^2))]`
/// per row with `u = mean + exp(log_std) eps`, the last term in the
/// stable form `2 (ln 2 - u - softplus(-2u))`; `[B, A + 1]`.
pub(crate) fn squashed_gaussian(
    mean: &Tensor,
    log_std: &Tensor,
    eps: &[f32],
) -> candle_core::Result<Tensor> {
    let eps = Tensor::from_slice(eps, mean.shape(), mean.device())?;
    let u = mean.add(&log_std.exp()?.mul(&eps)?)?;
    // softplus(x) = max(x, 0) + ln(1 + e^-|x|)
    let x = u.affine(-2.0, 0.0)?;
    let softplus = x
        .relu()?
        .add(&x.abs()?.neg()?.exp()?.affine(1.0, 1.0)?.log()?)?;
    let log_jacobian = u
        .neg()?
        .sub(&softplus)?
        .affine(2.0, 2.0 * std::f64::consts::LN_2)?;
    let logp = eps
        .sqr()?
        .affine(-0.5, -(HALF_LN_2PI as f64))?
        .sub(log_std)?
        .sub(&log_jacobian)?
        .sum_keepdim(1)?;
    Tensor::cat(&[&u.tanh()?, &logp], 1)
}

/// `sum_d 0.5 + 0.5 ln 2π + log_std[d]`, repeated for `rows` rows.
pub(crate) fn gaussian_entropy(log_std: &Tensor, rows: usize) -> candle_core::Result<Tensor> {
    let d = log_std.elem_count();
    let h = (log_std.to_dtype(DType::F32)?.sum_all()? + (d as f64) * (0.5 + HALF_LN_2PI as f64))?;
    h.broadcast_as(rows)?.contiguous()
}
