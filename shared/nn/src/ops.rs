//! Differentiable candle custom ops used by the training path.
//!
//! candle builds one graph node per op and, on the backward pass, allocates
//! a zero tensor and an add for every input of every node; at PPO sizes
//! (batches of a few hundred, layers of 64) that bookkeeping costs more than
//! the arithmetic. These ops fuse what the model needs into a few nodes, each
//! with a hand-written backward:
//!
//! - [`linear`]: `act(x W^T + b)` (matmul through candle's gemm, bias and the
//!   fast `tanh`/ReLU of [`crate::kernels`] in place);
//! - [`categorical_logprob`] / [`categorical_entropy`]: log-softmax based
//!   log-probability of given actions and entropy of a categorical over logits;
//! - [`gaussian_logprob`] / [`gaussian_entropy`]: the same for a diagonal
//!   Gaussian with a state-independent `log_std`;
//! - [`mask_logits`]: invalid-action masking of categorical logits (not fused:
//!   one `where_cond` node, whose own backward passes exactly zero to the
//!   replaced logits), checked by [`check_masks`];
//! - [`squashed_gaussian`]: SAC's reparameterised tanh-Gaussian sample with
//!   its log-probability;
//! - precomputed losses: a scalar whose value and input gradients the
//!   caller computed in one host pass (PPO, A2C, DQN losses).
//!
//! Every op passes gradients to every tensor input that needs one (unlike
//! candle-nn's fused `softmax_last_dim`, which has no backward); the tests compare
//! each against the same function composed from basic candle ops.
//!
//! Files: the fused ops here; `ops/composed.rs` the same functions from
//! candle's basic ops (the path off the CPU); [`mask`] invalid-action
//! masking (what a mask is and how logits are masked, [`MASKED_LOGIT`],
//! [`check_masks`], [`mask_logits`], [`masked_argmax`]); `ops/tests.rs`.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Device, Layout, Shape, Storage,
    Tensor,
};

use crate::kernels;
use crate::spec::Activation;

pub(crate) mod composed;
pub mod mask;

pub(crate) use mask::{apply_masks, check_mask_row, masked_log_softmax_row, masks_host};
pub use mask::{check_masks, mask_logits, masked_argmax, MASKED_LOGIT};

/// `0.5 * ln(2π)`.
pub(crate) const HALF_LN_2PI: f32 = 0.918_938_5;

thread_local! {
    static COMPOSED_ON_CPU: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether work on `device` takes the fused CPU code (ops, losses,
/// optimizer kernels, the graph-free acting path) or the device-generic
/// path composed from candle's basic ops. Off the CPU it is always the
/// composed path; on the CPU it is the fused one unless the calling thread
/// is inside [`composed_on_cpu`].
pub fn fused_on(device: &Device) -> bool {
    device.is_cpu() && !COMPOSED_ON_CPU.with(|c| c.get())
}

/// Runs `f` with every relay-nn op, loss and optimizer built inside it taking
/// the device-generic path a GPU takes, on the CPU: so that path is checked
/// against the fused one on machines without a GPU (the tests, and the GPU
/// bundle's dry run). Affects only the calling thread; an optimizer keeps
/// the path it was built with.
pub fn composed_on_cpu<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            COMPOSED_ON_CPU.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(COMPOSED_ON_CPU.with(|c| c.replace(true)));
    f()
}

/// The contiguous f32 data behind a CPU storage and layout.
pub(crate) fn cpu_f32<'a>(
    s: &'a CpuStorage,
    l: &Layout,
    op: &'static str,
) -> candle_core::Result<&'a [f32]> {
    let CpuStorage::F32(v) = s else {
        bail!("{op}: expected f32, got {:?}", s.dtype())
    };
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => bail!("{op}: expected a contiguous tensor"),
    }
}

/// Runs `f` on the contiguous f32 data of a tensor: in place on the CPU
/// (copying only when the tensor is not contiguous), copied to the host from
/// a device (the losses read their `[B]` inputs so; the fused ops run only on
/// the CPU).
pub(crate) fn with_f32<R>(
    t: &Tensor,
    op: &'static str,
    f: impl FnOnce(&[f32]) -> R,
) -> candle_core::Result<R> {
    if !t.device().is_cpu() {
        let host: Vec<f32> = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
        return Ok(f(&host));
    }
    let t = t.contiguous()?;
    let (guard, layout) = t.storage_and_layout();
    match &*guard {
        Storage::Cpu(s) => Ok(f(cpu_f32(s, layout, op)?)),
        _ => bail!("{op}: only the CPU device is supported"),
    }
}

fn new_f32(data: Vec<f32>, shape: impl Into<Shape>) -> candle_core::Result<Tensor> {
    Tensor::from_vec(data, shape, &Device::Cpu)
}

// ---------------------------------------------------------------- linear

/// `act(x W^T + b)` on CPU storages: the matmul through candle's gemm (with
/// `W` read in place, transposed by layout only), then bias and activation
/// in place on the result. Shared by the graph op and the no-graph path.
pub(crate) fn linear_cpu(
    xs: &CpuStorage,
    xl: &Layout,
    ws: &CpuStorage,
    wl: &Layout,
    bias: &[f32],
    act: Option<Activation>,
) -> candle_core::Result<Vec<f32>> {
    let (rows, inp) = xl.shape().dims2()?;
    let (outw, winp) = wl.shape().dims2()?;
    if winp != inp || bias.len() != outw {
        bail!(
            "linear: x {:?}, W {:?}, b [{}] do not fit",
            xl.dims(),
            wl.dims(),
            bias.len()
        )
    }
    if xs.dtype() != DType::F32 || ws.dtype() != DType::F32 {
        bail!("linear: expected f32 inputs")
    }
    let y = xs.matmul(ws, (1, rows, outw, inp), xl, &wl.transpose(0, 1)?)?;
    let CpuStorage::F32(mut y) = y else {
        bail!("linear: matmul returned a non-f32 result")
    };
    kernels::add_row_bias(&mut y, bias);
    match act {
        Some(Activation::Tanh) => kernels::tanh_inplace(&mut y),
        Some(Activation::Relu) => kernels::relu_inplace(&mut y),
        None => {}
    }
    Ok(y)
}

/// `y = act(x W^T + b)`, `x: [B, in]`, `W: [out, in]`, `b: [out]`, `y: [B, out]`.
struct LinearAct {
    act: Option<Activation>,
}

impl CustomOp3 for LinearAct {
    fn name(&self) -> &'static str {
        "relay-linear-act"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let bias = cpu_f32(bs, bl, "linear bias")?;
        let rows = xl.shape().dims2()?.0;
        let y = linear_cpu(xs, xl, ws, wl, bias, self.act)?;
        Ok((CpuStorage::F32(y), Shape::from((rows, bias.len()))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        y: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // Gradient with respect to the pre-activation z = x W^T + b, and the
        // bias gradient (column sums of it) in the same pass: candle's
        // `sum(0)` is a strided reduction and cost a third of a train step.
        let (rows, outw) = y.dims2()?;
        let (gz, gb) = with_f32(y, "linear bwd", |y| {
            with_f32(g, "linear bwd", |g| {
                let mut gz = vec![0f32; y.len()];
                match self.act {
                    None => gz.copy_from_slice(g),
                    Some(Activation::Tanh) => kernels::tanh_grad(y, g, &mut gz),
                    Some(Activation::Relu) => kernels::relu_grad(y, g, &mut gz),
                }
                let mut gb = vec![0f32; outw];
                kernels::column_sums(&gz, &mut gb);
                (gz, gb)
            })
        })??;
        let gz = new_f32(gz, (rows, outw))?;
        let gx = if x.track_op() {
            Some(gz.matmul(&w.detach())?)
        } else {
            None
        };
        // Parameters held constant (detached) get no gradient.
        let gw = if w.track_op() {
            Some(gz.t()?.matmul(&x.detach())?)
        } else {
            None
        };
        let gb = if b.track_op() {
            Some(new_f32(gb, outw)?)
        } else {
            None
        };
        Ok((gx, gw, gb))
    }
}

/// Differentiable dense layer `act(x W^T + b)` with `x: [B, in]`, `w: [out, in]`
/// (PyTorch layout), `b: [out]`; returns `[B, out]`.
pub fn linear(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    act: Option<Activation>,
) -> candle_core::Result<Tensor> {
    if !fused_on(x.device()) {
        return composed::linear(x, w, b, act);
    }
    x.apply_op3(w, b, LinearAct { act })
}

// ---------------------------------------------------------------- categorical

/// Log-softmax of one row into `out`; returns the row's log-sum-exp.
#[inline]
pub(crate) fn log_softmax_row(logits: &[f32], out: &mut [f32]) {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let s: f32 = logits.iter().map(|&l| (l - m).exp()).sum();
    let lse = m + s.ln();
    for (o, &l) in out.iter_mut().zip(logits) {
        *o = l - lse;
    }
}

/// `logprob[b] = log_softmax(logits[b])[actions[b]]`.
struct CategoricalLogProb {
    actions: Arc<[u32]>,
}

impl CustomOp1 for CategoricalLogProb {
    fn name(&self) -> &'static str {
        "relay-categorical-logprob"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, n) = l.shape().dims2()?;
        let logits = cpu_f32(s, l, "categorical logprob")?;
        if self.actions.len() != rows {
            bail!(
                "categorical logprob: {} actions for {rows} rows",
                self.actions.len()
            )
        }
        if let Some(a) = self.actions.iter().find(|&&a| a as usize >= n) {
            bail!("categorical logprob: action {a} out of range 0..{n}")
        }
        let mut lsm = vec![0f32; n];
        let out = logits
            .chunks_exact(n)
            .zip(self.actions.iter())
            .map(|(row, &a)| {
                log_softmax_row(row, &mut lsm);
                lsm[a as usize]
            })
            .collect();
        Ok((CpuStorage::F32(out), Shape::from(rows)))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        // d logp_a / d l_j = 1[j = a] - p_j
        let (rows, n) = logits.dims2()?;
        let grad = with_f32(logits, "categorical logprob bwd", |logits| {
            with_f32(g, "categorical logprob bwd", |g| {
                let mut out = vec![0f32; rows * n];
                for (((orow, row), &a), &gb) in out
                    .chunks_exact_mut(n)
                    .zip(logits.chunks_exact(n))
                    .zip(self.actions.iter())
                    .zip(g)
                {
                    log_softmax_row(row, orow);
                    for o in orow.iter_mut() {
                        *o = -gb * o.exp();
                    }
                    orow[a as usize] += gb;
                }
                out
            })
        })??;
        Ok(Some(new_f32(grad, (rows, n))?))
    }
}

/// `entropy[b] = -sum_j p_j log p_j` of the categorical over `logits[b]`.
struct CategoricalEntropy;

impl CustomOp1 for CategoricalEntropy {
    fn name(&self) -> &'static str {
        "relay-categorical-entropy"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, n) = l.shape().dims2()?;
        let logits = cpu_f32(s, l, "categorical entropy")?;
        let mut lsm = vec![0f32; n];
        let out = logits
            .chunks_exact(n)
            .map(|row| {
                log_softmax_row(row, &mut lsm);
                -lsm.iter().map(|&lp| lp.exp() * lp).sum::<f32>()
            })
            .collect();
        Ok((CpuStorage::F32(out), Shape::from(rows)))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        // dH / d l_j = -p_j (log p_j + H)
        let (rows, n) = logits.dims2()?;
        let grad = with_f32(logits, "categorical entropy bwd", |logits| {
            with_f32(g, "categorical entropy bwd", |g| {
                let mut out = vec![0f32; rows * n];
                for ((orow, row), &gb) in out.chunks_exact_mut(n).zip(logits.chunks_exact(n)).zip(g)
                {
                    log_softmax_row(row, orow);
                    let h: f32 = -orow.iter().map(|&lp| lp.exp() * lp).sum::<f32>();
                    for o in orow.iter_mut() {
                        let lp = *o;
                        *o = -gb * lp.exp() * (lp + h);
                    }
                }
                out
            })
        })??;
        Ok(Some(new_f32(grad, (rows, n))?))
    }
}

/// Log-probability of `actions` (one index per row, validated by the caller
/// to lie in `0..n`) under the categorical with `logits: [B, n]`; `[B]`.
pub fn categorical_logprob(logits: &Tensor, actions: Arc<[u32]>) -> candle_core::Result<Tensor> {
    if !fused_on(logits.device()) {
        return composed::categorical_logprob(logits, &actions);
    }
    logits.apply_op1(CategoricalLogProb { actions })
}

/// Entropy of the categorical with `logits: [B, n]`; `[B]`.
pub fn categorical_entropy(logits: &Tensor) -> candle_core::Result<Tensor> {
    if !fused_on(logits.device()) {
        return composed::categorical_entropy(logits);
    }
    logits.apply_op1(CategoricalEntropy)
}

// ---------------------------------------------------------------- gaussian

/// `logprob[b] = sum_d -0.5 z^2 - log_std[d] - 0.5 ln 2π`, `z = (a - mean) / exp(log_std)`.
struct GaussianLogProb {
    actions: Arc<[f32]>,
}

impl CustomOp2 for GaussianLogProb {
    fn name(&self) -> &'static str {
        "relay-gaussian-logprob"
    }

    fn cpu_fwd(
        &self,
        ms: &CpuStorage,
        ml: &Layout,
        ls: &CpuStorage,
        ll: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, d) = ml.shape().dims2()?;
        let mean = cpu_f32(ms, ml, "gaussian logprob")?;
        let log_std = cpu_f32(ls, ll, "gaussian logprob")?;
        if log_std.len() != d || self.actions.len() != rows * d {
            bail!(
                "gaussian logprob: mean {:?}, log_std {:?}, {} action values",
                ml.dims(),
                ll.dims(),
                self.actions.len()
            )
        }
        let inv_std: Vec<f32> = log_std.iter().map(|&s| (-s).exp()).collect();
        let norm: f32 = log_std.iter().sum::<f32>() + HALF_LN_2PI * d as f32;
        let out = mean
            .chunks_exact(d)
            .zip(self.actions.chunks_exact(d))
            .map(|(m, a)| {
                let mut q = 0f32;
                for ((&m, &a), &is) in m.iter().zip(a).zip(&inv_std) {
                    let z = (a - m) * is;
                    q += z * z;
                }
                -0.5 * q - norm
            })
            .collect();
        Ok((CpuStorage::F32(out), Shape::from(rows)))
    }

    fn bwd(
        &self,
        mean: &Tensor,
        log_std: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        // d/d mean = z / std, d/d log_std = z^2 - 1
        let (rows, d) = mean.dims2()?;
        let (gm, gs) = with_f32(mean, "gaussian logprob bwd", |mean| {
            with_f32(log_std, "gaussian logprob bwd", |log_std| {
                with_f32(g, "gaussian logprob bwd", |g| {
                    let inv_std: Vec<f32> = log_std.iter().map(|&s| (-s).exp()).collect();
                    let mut gm = vec![0f32; rows * d];
                    let mut gs = vec![0f32; d];
                    for (((gm_row, m), a), &gb) in gm
                        .chunks_exact_mut(d)
                        .zip(mean.chunks_exact(d))
                        .zip(self.actions.chunks_exact(d))
                        .zip(g)
                    {
                        for k in 0..d {
                            let z = (a[k] - m[k]) * inv_std[k];
                            gm_row[k] = gb * z * inv_std[k];
                            gs[k] += gb * (z * z - 1.0);
                        }
                    }
                    (gm, gs)
                })
            })
        })???;
        let gm = if mean.track_op() {
            Some(new_f32(gm, (rows, d))?)
        } else {
            None
        };
        let gs = if log_std.track_op() {
            Some(new_f32(gs, d)?)
        } else {
            None
        };
        Ok((gm, gs))
    }
}

/// `entropy[b] = sum_d 0.5 + 0.5 ln 2π + log_std[d]`, the same for every row.
struct GaussianEntropy {
    rows: usize,
}

impl CustomOp1 for GaussianEntropy {
    fn name(&self) -> &'static str {
        "relay-gaussian-entropy"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let log_std = cpu_f32(s, l, "gaussian entropy")?;
        let h: f32 = log_std.iter().map(|&ls| 0.5 + HALF_LN_2PI + ls).sum();
        Ok((CpuStorage::F32(vec![h; self.rows]), Shape::from(self.rows)))
    }

    fn bwd(
        &self,
        log_std: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let d = log_std.elem_count();
        let total: f32 = with_f32(g, "gaussian entropy bwd", |g| g.iter().sum())?;
        Ok(Some(new_f32(vec![total; d], log_std.shape().clone())?))
    }
}

/// Log-probability of `actions` (`[B * D]` row-major, unclipped) under the
/// diagonal Gaussian `N(mean, exp(log_std)^2)`, `mean: [B, D]`, `log_std: [D]`; `[B]`.
pub fn gaussian_logprob(
    mean: &Tensor,
    log_std: &Tensor,
    actions: Arc<[f32]>,
) -> candle_core::Result<Tensor> {
    if !fused_on(mean.device()) {
        return composed::gaussian_logprob(mean, log_std, &actions);
    }
    mean.apply_op2(log_std, GaussianLogProb { actions })
}

/// Entropy of the diagonal Gaussian with `log_std: [D]`, repeated for `rows` rows; `[rows]`.
pub fn gaussian_entropy(log_std: &Tensor, rows: usize) -> candle_core::Result<Tensor> {
    if !fused_on(log_std.device()) {
        return composed::gaussian_entropy(log_std, rows);
    }
    log_std.apply_op1(GaussianEntropy { rows })
}

// ---------------------------------------------------------------- squashed gaussian

/// `softplus(x) = ln(1 + e^x)`, without overflow for large `|x|`.
#[inline]
pub(crate) fn softplus(x: f32) -> f32 {
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

/// `ln(1 - tanh(u)^2)` in the stable form `2 (ln 2 - u - softplus(-2u))`
/// (exact identity; finite for every finite `u`, unlike the direct form).
#[inline]
pub(crate) fn log_one_minus_tanh_sq(u: f32) -> f32 {
    2.0 * (std::f32::consts::LN_2 - u - softplus(-2.0 * u))
}

/// One row of a tanh-squashed Gaussian sample: writes `tanh(u)` for each
/// dimension into `y` and returns `log π(y)`, with `u = mean + exp(log_std) eps`.
#[inline]
pub(crate) fn squashed_gaussian_row(
    mean: &[f32],
    log_std: &[f32],
    eps: &[f32],
    y: &mut [f32],
) -> f32 {
    let mut logp = 0f32;
    for j in 0..mean.len() {
        let u = mean[j] + log_std[j].exp() * eps[j];
        y[j] = u.tanh();
        logp += -0.5 * eps[j] * eps[j] - log_std[j] - HALF_LN_2PI - log_one_minus_tanh_sq(u);
    }
    logp
}

/// Reparameterised sample of a tanh-squashed diagonal Gaussian (SAC's
/// actor): inputs `mean, log_std: [B, A]`, noise `eps` fixed; output
/// `[B, A + 1]`: `tanh(mean + exp(log_std) eps)` then `log π` of that
/// squashed action,
/// `Σ_j log N(u_j; mean_j, std_j) - Σ_j log(1 - tanh(u_j)^2)`.
struct SquashedGaussian {
    eps: Arc<[f32]>,
}

impl CustomOp2 for SquashedGaussian {
    fn name(&self) -> &'static str {
        "relay-squashed-gaussian"
    }

    fn cpu_fwd(
        &self,
        ms: &CpuStorage,
        ml: &Layout,
        ss: &CpuStorage,
        sl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, a) = ml.shape().dims2()?;
        if sl.shape().dims2()? != (rows, a) || self.eps.len() != rows * a {
            bail!(
                "squashed gaussian: mean {:?}, log_std {:?}, {} noise values",
                ml.dims(),
                sl.dims(),
                self.eps.len()
            )
        }
        let mean = cpu_f32(ms, ml, "squashed gaussian")?;
        let log_std = cpu_f32(ss, sl, "squashed gaussian")?;
        let mut out = vec![0f32; rows * (a + 1)];
        for (r, orow) in out.chunks_exact_mut(a + 1).enumerate() {
            let k = r * a..(r + 1) * a;
            let (y, lp) = orow.split_at_mut(a);
            lp[0] = squashed_gaussian_row(&mean[k.clone()], &log_std[k.clone()], &self.eps[k], y);
        }
        Ok((CpuStorage::F32(out), Shape::from((rows, a + 1))))
    }

    fn bwd(
        &self,
        mean: &Tensor,
        log_std: &Tensor,
        res: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        // u = m + σ ε, y = tanh(u), d log π / d u = 2 y (the Gaussian term
        // depends on ε only), d log π / d s = -1 + 2 y σ ε, d y / d u = 1 - y^2.
        let (rows, a) = mean.dims2()?;
        let (gm, gs) = with_f32(log_std, "squashed gaussian bwd", |log_std| {
            with_f32(res, "squashed gaussian bwd", |res| {
                with_f32(g, "squashed gaussian bwd", |g| {
                    let mut gm = vec![0f32; rows * a];
                    let mut gs = vec![0f32; rows * a];
                    for r in 0..rows {
                        let g_lp = g[r * (a + 1) + a];
                        for j in 0..a {
                            let i = r * a + j;
                            let y = res[r * (a + 1) + j];
                            let g_y = g[r * (a + 1) + j];
                            let noise = log_std[i].exp() * self.eps[i];
                            let dy = g_y * (1.0 - y * y);
                            gm[i] = dy + g_lp * 2.0 * y;
                            gs[i] = dy * noise + g_lp * (2.0 * y * noise - 1.0);
                        }
                    }
                    (gm, gs)
                })
            })
        })???;
        let gm = mean
            .track_op()
            .then(|| new_f32(gm, (rows, a)))
            .transpose()?;
        let gs = log_std
            .track_op()
            .then(|| new_f32(gs, (rows, a)))
            .transpose()?;
        Ok((gm, gs))
    }
}

/// Reparameterised tanh-squashed Gaussian sample, differentiable in `mean`
/// and `log_std` (`[B, A]` each) for fixed standard-normal `eps` (`B * A`
/// values): returns `[B, A + 1]`, the squashed action in `(-1, 1)` then its
/// log-probability (see [`crate::sac`]).
pub fn squashed_gaussian(
    mean: &Tensor,
    log_std: &Tensor,
    eps: Arc<[f32]>,
) -> candle_core::Result<Tensor> {
    if !fused_on(mean.device()) {
        return composed::squashed_gaussian(mean, log_std, &eps);
    }
    mean.apply_op2(log_std, SquashedGaussian { eps })
}

// ---------------------------------------------------------------- losses

/// Attaches precomputed `d loss / d input` to the graph: forward returns the
/// loss value, backward scales the stored gradients by the incoming one.
struct PrecomputedLoss {
    loss: f32,
    grads: Arc<[Vec<f32>; 3]>,
}

impl CustomOp3 for PrecomputedLoss {
    fn name(&self) -> &'static str {
        "relay-precomputed-loss3"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((CpuStorage::F32(vec![self.loss]), Shape::from(())))
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let g: f32 = g.to_dtype(candle_core::DType::F32)?.to_scalar()?;
        let grad = |t: &Tensor, d: &[f32]| -> candle_core::Result<Option<Tensor>> {
            if !t.track_op() {
                return Ok(None);
            }
            let v: Vec<f32> = d.iter().map(|x| x * g).collect();
            Ok(Some(Tensor::from_vec(v, t.shape(), t.device())?))
        };
        Ok((
            grad(a, &self.grads[0])?,
            grad(b, &self.grads[1])?,
            grad(c, &self.grads[2])?,
        ))
    }
}

/// A scalar loss whose value and gradients with respect to `inputs` were
/// computed together in one pass on the host (the losses of [`crate::ppo`],
/// [`crate::a2c`], ...); `backward()` carries `grads[i]` (scaled by the
/// incoming gradient) into `inputs[i]`. Each `grads[i]` has one value per
/// element of `inputs[i]`.
pub(crate) fn precomputed_loss3(
    inputs: [&Tensor; 3],
    loss: f32,
    grads: [Vec<f32>; 3],
) -> candle_core::Result<Tensor> {
    for (t, g) in inputs.iter().zip(&grads) {
        if t.elem_count() != g.len() {
            bail!("precomputed loss: {} gradients for {:?}", g.len(), t.dims())
        }
    }
    if !fused_on(inputs[0].device()) {
        return composed::precomputed_loss(&inputs, loss, &grads);
    }
    inputs[0].apply_op3(
        inputs[1],
        inputs[2],
        PrecomputedLoss {
            loss,
            grads: Arc::new(grads),
        },
    )
}

/// [`precomputed_loss3`] for a single input.
struct PrecomputedLoss1 {
    loss: f32,
    grad: Arc<Vec<f32>>,
}

impl CustomOp1 for PrecomputedLoss1 {
    fn name(&self) -> &'static str {
        "relay-precomputed-loss1"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((CpuStorage::F32(vec![self.loss]), Shape::from(())))
    }

    fn bwd(&self, a: &Tensor, _res: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let g: f32 = g.to_dtype(DType::F32)?.to_scalar()?;
        let v: Vec<f32> = self.grad.iter().map(|x| x * g).collect();
        Ok(Some(Tensor::from_vec(v, a.shape(), a.device())?))
    }
}

/// [`precomputed_loss3`] for a single input.
pub(crate) fn precomputed_loss(
    input: &Tensor,
    loss: f32,
    grad: Vec<f32>,
) -> candle_core::Result<Tensor> {
    if input.elem_count() != grad.len() {
        bail!(
            "precomputed loss: {} gradients for {:?}",
            grad.len(),
            input.dims()
        )
    }
    if !fused_on(input.device()) {
        return composed::precomputed_loss(&[input], loss, &[grad]);
    }
    input.apply_op1(PrecomputedLoss1 {
        loss,
        grad: Arc::new(grad),
    })
}

#[cfg(test)]
mod tests;
