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
//! # Invalid-action masks
//!
//! A mask is `n` bytes per row, row-major `[B, n]`: 1 for a legal action, 0
//! for an illegal one (Huang & Ontañón, "A Closer Look at Invalid Action
//! Masking in Policy Gradient Algorithms", as CleanRL's masked PPO). The
//! illegal logits are *replaced* by [`MASKED_LOGIT`], a large finite
//! negative, and the categorical ops then run on the masked logits: `exp`
//! of an illegal logit minus the row's maximum underflows to exactly 0, so
//! the masked softmax puts no mass there and its log-softmax equals the
//! log-softmax over the legal actions alone, while `p log p = 0 * (-1e8)`
//! stays 0 in the entropy (with `-inf` it would be `0 * -inf = NaN`).
//! Replacing rather than adding keeps the value independent of the raw
//! logit and makes its gradient exactly 0.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Device, Layout, Shape, Storage,
    Tensor,
};

use crate::error::{NnError, Result};
use crate::kernels;
use crate::spec::Activation;

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

// ---------------------------------------------------------------- masks

/// What an illegal action's logit is replaced by (see the module docs): a
/// large finite negative, so its probability underflows to exactly 0 while
/// `0 * log p` stays 0 (no NaN, unlike `-inf`).
pub const MASKED_LOGIT: f32 = -1e8;

/// Checks one mask row (`r` its index in the batch, for the error): values
/// 0 or 1, at least one legal action.
pub(crate) fn check_mask_row(row: &[u8], r: usize) -> Result<()> {
    if let Some(j) = row.iter().position(|&m| m > 1) {
        return Err(NnError::bad_input(
            "masks",
            "0 (illegal) or 1 (legal) per action",
            format!("{} at row {r}, action {j}", row[j]),
        ));
    }
    if !row.contains(&1) {
        return Err(NnError::bad_input(
            "masks",
            "at least one legal action (a 1) in every row",
            format!("row {r} with no legal action"),
        ));
    }
    Ok(())
}

/// Checks host action masks for `rows` rows of `n` actions: `rows * n`
/// bytes, each 0 (illegal) or 1 (legal), and at least one legal action per
/// row. The error names the first bad row.
pub fn check_masks(masks: &[u8], rows: usize, n: usize) -> Result<()> {
    if masks.len() != rows * n {
        return Err(NnError::bad_input(
            "masks",
            format!("{rows} x {n} = {} values", rows * n),
            format!("{} values", masks.len()),
        ));
    }
    if n == 0 {
        return match rows {
            0 => Ok(()),
            _ => check_mask_row(&[], 0),
        };
    }
    for (r, row) in masks.chunks_exact(n).enumerate() {
        check_mask_row(row, r)?;
    }
    Ok(())
}

/// The bytes of a `[rows, n]` u8 mask tensor (read back from a device),
/// after checking its shape and dtype against the logits'.
pub(crate) fn masks_host(masks: &Tensor, rows: usize, n: usize) -> Result<Vec<u8>> {
    if masks.dims() != [rows, n] || masks.dtype() != DType::U8 {
        return Err(NnError::bad_input(
            "masks",
            format!("u8 [{rows}, {n}] (as the logits)"),
            format!("{:?} [{:?}]", masks.dtype(), masks.dims()),
        ));
    }
    Ok(masks.flatten_all()?.to_vec1()?)
}

/// [`mask_logits`] without the checks: `masks` (u8, the shape of `logits`)
/// already validated.
pub(crate) fn apply_masks(logits: &Tensor, masks: &Tensor) -> Result<Tensor> {
    let masks = masks.to_device(logits.device())?;
    let fill =
        Tensor::full(MASKED_LOGIT, logits.shape(), logits.device())?.to_dtype(logits.dtype())?;
    Ok(masks.where_cond(logits, &fill)?)
}

/// Invalid-action masking of `logits: [B, n]` with `masks: [B, n]` u8 (1
/// legal, 0 illegal): the illegal logits are replaced (not shifted) by
/// [`MASKED_LOGIT`], so [`categorical_logprob`] / [`categorical_entropy`]
/// of the result are those of the categorical over the legal actions.
/// Differentiable: the gradient reaching a replaced logit is exactly 0, a
/// legal one gets the masked distribution's. The masks are checked as
/// [`check_masks`] (read back to the host); a row with no legal action is
/// an error naming the row.
pub fn mask_logits(logits: &Tensor, masks: &Tensor) -> Result<Tensor> {
    let (rows, n) = logits
        .dims2()
        .map_err(|_| NnError::bad_input("logits", "[B, n]", format!("{:?}", logits.dims())))?;
    check_masks(&masks_host(masks, rows, n)?, rows, n)?;
    apply_masks(logits, masks)
}

/// The log-softmax of the categorical over the legal actions of one row
/// (`mask`: 1 legal, 0 illegal; `None`: all legal, [`log_softmax_row`])
/// into `out`, the illegal entries `-inf` (the host acting path only reads
/// the legal ones, so no `0 * -inf` arises). Wherever a legal logit is well
/// above [`MASKED_LOGIT`] this is bit for bit the log-softmax of the
/// [`mask_logits`] row that training scores (the replaced logits add
/// exactly 0 to the sum and do not change the maximum).
#[inline]
pub(crate) fn masked_log_softmax_row(logits: &[f32], mask: Option<&[u8]>, out: &mut [f32]) {
    let Some(mask) = mask else {
        return log_softmax_row(logits, out);
    };
    let legal = || {
        logits
            .iter()
            .zip(mask)
            .filter(|&(_, &ok)| ok != 0)
            .map(|(&l, _)| l)
    };
    let m = legal().fold(f32::NEG_INFINITY, f32::max);
    let s: f32 = legal().map(|l| (l - m).exp()).sum();
    let lse = m + s.ln();
    for ((o, &l), &ok) in out.iter_mut().zip(logits).zip(mask) {
        *o = if ok != 0 { l - lse } else { f32::NEG_INFINITY };
    }
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

/// The same functions composed from candle's basic ops, each with candle's
/// own backward and a kernel on every device: what [`linear`],
/// [`categorical_logprob`], [`categorical_entropy`], [`gaussian_logprob`]
/// and [`gaussian_entropy`] run for tensors off the CPU, where the fused
/// ops (CPU code) cannot. The tests check each against its fused op.
pub(crate) mod composed {
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
    pub(crate) fn categorical_logprob(
        logits: &Tensor,
        actions: &[u32],
    ) -> candle_core::Result<Tensor> {
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
        let h =
            (log_std.to_dtype(DType::F32)?.sum_all()? + (d as f64) * (0.5 + HALF_LN_2PI as f64))?;
        h.broadcast_as(rows)?.contiguous()
    }
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
mod tests {
    //! Each fused op against the same function composed from basic candle
    //! ops ([`composed`], what runs off the CPU): values and gradients.
    use super::*;
    use candle_core::Var;

    fn close(a: &Tensor, b: &Tensor, tol: f32) {
        let a: Vec<f32> = a.flatten_all().unwrap().to_vec1().unwrap();
        let b: Vec<f32> = b.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(
                (x - y).abs() <= tol * (1.0 + y.abs()),
                "index {i}: {x} vs {y}"
            );
        }
    }

    fn var(shape: &[usize], seed: usize) -> Var {
        let n: usize = shape.iter().product();
        let data: Vec<f32> = (0..n)
            .map(|i| (((i + seed) * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.9)
            .collect();
        Var::from_vec(data, shape, &Device::Cpu).unwrap()
    }

    fn weights(seed: usize) -> Tensor {
        var(&[5, 3], seed).as_detached_tensor()
    }

    #[test]
    fn linear_matches_composition() {
        for act in [None, Some(Activation::Tanh), Some(Activation::Relu)] {
            let x = var(&[5, 4], 1);
            let w = var(&[3, 4], 2);
            let b = var(&[3], 3);
            let y = linear(&x, &w, &b, act).unwrap();
            let r = composed::linear(&x, &w, &b, act).unwrap();
            close(&y, &r, 1e-6);
            let c = weights(4);
            let g1 = (&y * &c).unwrap().sum_all().unwrap().backward().unwrap();
            let g2 = (&r * &c).unwrap().sum_all().unwrap().backward().unwrap();
            for v in [&x, &w, &b] {
                close(g1.get(v).unwrap(), g2.get(v).unwrap(), 1e-5);
            }
        }
    }

    #[test]
    fn categorical_matches_composition() {
        let logits = var(&[5, 3], 5);
        let actions: Arc<[u32]> = vec![0, 2, 1, 1, 0].into();
        let lp = categorical_logprob(&logits, actions.clone()).unwrap();
        let ent = categorical_entropy(&logits).unwrap();
        let lp_ref = composed::categorical_logprob(&logits, &actions).unwrap();
        let ent_ref = composed::categorical_entropy(&logits).unwrap();
        close(&lp, &lp_ref, 1e-6);
        close(&ent, &ent_ref, 1e-6);
        let c1 = Tensor::new(&[1.0f32, -2.0, 0.5, 3.0, 1.5], &Device::Cpu).unwrap();
        let c2 = Tensor::new(&[0.3f32, 0.7, -1.0, 2.0, 0.1], &Device::Cpu).unwrap();
        let f = |lp: &Tensor, e: &Tensor| {
            ((lp * &c1).unwrap() + (e * &c2).unwrap())
                .unwrap()
                .sum_all()
                .unwrap()
        };
        let g1 = f(&lp, &ent).backward().unwrap();
        let g2 = f(&lp_ref, &ent_ref).backward().unwrap();
        close(g1.get(&logits).unwrap(), g2.get(&logits).unwrap(), 1e-5);
    }

    #[test]
    fn gaussian_matches_composition() {
        let mean = var(&[4, 2], 6);
        let log_std = var(&[2], 7);
        let actions: Arc<[f32]> = vec![0.3, -1.2, 2.0, 0.0, -0.5, 0.5, 1.0, 1.0].into();
        let lp = gaussian_logprob(&mean, &log_std, actions.clone()).unwrap();
        let ent = gaussian_entropy(&log_std, 4).unwrap();
        let lp_ref = composed::gaussian_logprob(&mean, &log_std, &actions).unwrap();
        let ent_ref = composed::gaussian_entropy(&log_std, 4).unwrap();
        close(&lp, &lp_ref, 1e-6);
        close(&ent, &ent_ref, 1e-6);
        let c1 = Tensor::new(&[1.0f32, -2.0, 0.5, 3.0], &Device::Cpu).unwrap();
        let c2 = Tensor::new(&[0.3f32, 0.7, -1.0, 2.0], &Device::Cpu).unwrap();
        let f = |lp: &Tensor, e: &Tensor| {
            ((lp * &c1).unwrap() + (e * &c2).unwrap())
                .unwrap()
                .sum_all()
                .unwrap()
        };
        let g1 = f(&lp, &ent).backward().unwrap();
        let g2 = f(&lp_ref, &ent_ref).backward().unwrap();
        close(g1.get(&mean).unwrap(), g2.get(&mean).unwrap(), 1e-5);
        close(g1.get(&log_std).unwrap(), g2.get(&log_std).unwrap(), 1e-5);
    }

    #[test]
    fn squashed_gaussian_matches_composition() {
        let mean = var(&[3, 2], 8);
        let log_std = var(&[3, 2], 9);
        let eps: Arc<[f32]> = vec![0.3, -1.2, 2.0, 0.0, -0.5, 3.5].into();
        let y = squashed_gaussian(&mean, &log_std, eps.clone()).unwrap();
        let r = composed::squashed_gaussian(&mean, &log_std, &eps).unwrap();
        close(&y, &r, 1e-5);
        let c = var(&[3, 3], 10).as_detached_tensor();
        let g1 = (&y * &c).unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = (&r * &c).unwrap().sum_all().unwrap().backward().unwrap();
        close(g1.get(&mean).unwrap(), g2.get(&mean).unwrap(), 1e-5);
        close(g1.get(&log_std).unwrap(), g2.get(&log_std).unwrap(), 1e-5);
    }

    #[test]
    fn precomputed_losses_match_composition() {
        let (a, b, c) = (var(&[4], 11), var(&[4], 12), var(&[2, 2], 13));
        let grads = [
            vec![1.0, -2.0, 0.5, 0.25],
            vec![0.0, 3.0, -1.0, 2.0],
            vec![0.5, 0.5, -0.5, 7.0],
        ];
        let fused = precomputed_loss3([&a, &b, &c], 1.25, grads.clone()).unwrap();
        let composed = composed_on_cpu(|| precomputed_loss3([&a, &b, &c], 1.25, grads.clone()));
        let composed = composed.unwrap();
        assert_eq!(fused.to_scalar::<f32>().unwrap(), 1.25);
        assert_eq!(composed.to_scalar::<f32>().unwrap(), 1.25);
        // Scaled by an outer factor, as a weighted sum of losses is.
        let g1 = (fused * 3.0).unwrap().backward().unwrap();
        let g2 = (composed * 3.0).unwrap().backward().unwrap();
        for v in [&a, &b, &c] {
            close(g1.get(v).unwrap(), g2.get(v).unwrap(), 1e-6);
        }
        let single = composed_on_cpu(|| precomputed_loss(&a, -0.5, grads[0].clone())).unwrap();
        assert_eq!(single.to_scalar::<f32>().unwrap(), -0.5);
        let g = single.backward().unwrap();
        close(
            g.get(&a).unwrap(),
            &Tensor::new(&grads[0][..], &Device::Cpu).unwrap(),
            0.0,
        );
    }
    /// Rows of `[1, 2, 3]` logits under masks `[1, 0, 1]` (actions 0 and 2)
    /// and `[0, 1, 0]` (action 1, the only legal one).
    fn masked_example() -> (Var, Tensor, Arc<[u32]>) {
        let logits = Var::from_vec(
            vec![1f32, 2.0, 3.0, 1.0, 2.0, 3.0, 1.0, 2.0, 3.0],
            (3, 3),
            &Device::Cpu,
        )
        .unwrap();
        let masks =
            Tensor::from_vec(vec![1u8, 0, 1, 1, 0, 1, 0, 1, 0], (3, 3), &Device::Cpu).unwrap();
        (logits, masks, vec![0u32, 2, 1].into())
    }

    fn assert_values(t: &Tensor, expected: &[f32], tol: f32) {
        let got: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(got.len(), expected.len());
        for (i, (g, e)) in got.iter().zip(expected).enumerate() {
            assert!((g - e).abs() <= tol, "index {i}: {got:?} vs {expected:?}");
        }
    }

    #[test]
    fn masked_categorical_hand_computed_on_both_paths() {
        // Mask [1, 0, 1] over logits [1, 2, 3]: the categorical over {0, 2},
        //   p0 = e^1 / (e^1 + e^3) = 1 / (1 + e^2) = 0.119_202_92
        //   p2 = e^3 / (e^1 + e^3) = 1 / (1 + e^-2) = 0.880_797_08
        //   log p0 = -ln(1 + e^2) = -2.126_928_0, log p2 = 2 - ln(1 + e^2) = -0.126_928_0
        //   H = -(p0 log p0 + p2 log p2) = 0.253_536 + 0.111_797 = 0.365_333_86
        // Mask [0, 1, 0]: p1 = 1, log p1 = 0, H = 0 (0 * log 0 must not be NaN).
        // d log p_a / d l_j = 1[j = a] - p_j on legal j, exactly 0 on illegal j:
        //   row 0 (a = 0): [1 - p0, 0, -p2] = [0.880_797_08, 0, -0.880_797_08]
        //   row 1 (a = 2): [-p0, 0, 1 - p2] = [-0.119_202_92, 0, 0.119_202_92]
        //   row 2 (a = 1): [0, 1 - 1, 0] = [0, 0, 0]
        // dH / d l_j = -p_j (log p_j + H) on legal j, 0 on illegal:
        //   -p0 (log p0 + H) = 0.119_202_92 * 1.761_594_2 = 0.209_987_17, and
        //   -p2 (log p2 + H) = -0.880_797_08 * 0.238_405_84 = -0.209_987_17.
        let lp_expected = [-2.126_928, -0.126_928, 0.0];
        let h_expected = [0.365_333_86, 0.365_333_86, 0.0];
        let g_lp = [
            0.880_797_1,
            0.0,
            -0.880_797_1,
            -0.119_202_92,
            0.0,
            0.119_202_92,
            0.0,
            0.0,
            0.0,
        ];
        let g_h = [
            0.209_987_17,
            0.0,
            -0.209_987_17,
            0.209_987_17,
            0.0,
            -0.209_987_17,
            0.0,
            0.0,
            0.0,
        ];
        let (logits, masks, actions) = masked_example();
        let run = || {
            let masked = mask_logits(&logits, &masks).unwrap();
            let lp = categorical_logprob(&masked, actions.clone()).unwrap();
            let h = categorical_entropy(&masked).unwrap();
            let g_lp = lp.sum_all().unwrap().backward().unwrap();
            let g_h = h.sum_all().unwrap().backward().unwrap();
            let grad = |g: &candle_core::backprop::GradStore| -> Vec<f32> {
                g.get(&logits)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap()
            };
            (masked, lp, h, grad(&g_lp), grad(&g_h))
        };
        let fused = run();
        let composed = composed_on_cpu(run);
        for (masked, lp, h, glp, gh) in [&fused, &composed] {
            // Replaced, not shifted: the illegal logits are exactly MASKED_LOGIT.
            assert_values(
                masked,
                &[
                    1.0,
                    MASKED_LOGIT,
                    3.0,
                    1.0,
                    MASKED_LOGIT,
                    3.0,
                    MASKED_LOGIT,
                    2.0,
                    MASKED_LOGIT,
                ],
                0.0,
            );
            assert_values(lp, &lp_expected, 1e-6);
            assert_values(h, &h_expected, 1e-6);
            let h: Vec<f32> = h.to_vec1().unwrap();
            assert_eq!(h[2], 0.0, "a single legal action has entropy exactly 0");
            let t = |v: &[f32]| Tensor::new(v, &Device::Cpu).unwrap();
            assert_values(&t(glp), &g_lp, 1e-6);
            assert_values(&t(gh), &g_h, 1e-6);
            // No gradient at all reaches an illegal logit.
            for i in [1, 4, 6, 8] {
                assert_eq!(glp[i], 0.0, "logprob gradient at illegal index {i}");
                assert_eq!(gh[i], 0.0, "entropy gradient at illegal index {i}");
            }
            assert!(glp.iter().chain(gh).all(|g| g.is_finite()));
        }
        close(&fused.1, &composed.1, 1e-6);
        close(&fused.2, &composed.2, 1e-6);
    }

    #[test]
    fn masked_categorical_matches_composition() {
        let logits = var(&[6, 4], 14);
        let mask: Vec<u8> = vec![
            1, 0, 1, 1, 0, 0, 1, 0, 1, 1, 1, 1, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1,
        ];
        let masks = Tensor::from_vec(mask, (6, 4), &Device::Cpu).unwrap();
        let actions: Arc<[u32]> = vec![2, 2, 1, 3, 0, 3].into();
        let c1 = Tensor::new(&[1.0f32, -2.0, 0.5, 3.0, 1.5, -0.5], &Device::Cpu).unwrap();
        let c2 = Tensor::new(&[0.3f32, 0.7, -1.0, 2.0, 0.1, 1.0], &Device::Cpu).unwrap();
        let run = || {
            let masked = mask_logits(&logits, &masks).unwrap();
            let lp = categorical_logprob(&masked, actions.clone()).unwrap();
            let h = categorical_entropy(&masked).unwrap();
            let loss = ((&lp * &c1).unwrap() + (&h * &c2).unwrap())
                .unwrap()
                .sum_all()
                .unwrap();
            let g = loss.backward().unwrap().get(&logits).unwrap().clone();
            (lp, h, g)
        };
        let (lp, h, g) = run();
        let (lp_ref, h_ref, g_ref) = composed_on_cpu(run);
        close(&lp, &lp_ref, 1e-6);
        close(&h, &h_ref, 1e-6);
        close(&g, &g_ref, 1e-5);
        let h: Vec<f32> = h.to_vec1().unwrap();
        assert_eq!(h[5], 0.0);
    }

    #[test]
    fn bad_masks_are_errors_naming_the_row() {
        let logits = var(&[3, 2], 15).as_detached_tensor();
        let masks = |v: Vec<u8>| Tensor::from_vec(v, (3, 2), &Device::Cpu).unwrap();
        let err = mask_logits(&logits, &masks(vec![1, 0, 0, 0, 0, 1])).unwrap_err();
        assert!(err.to_string().contains("row 1"), "{err}");
        let err = mask_logits(&logits, &masks(vec![1, 0, 0, 1, 2, 1])).unwrap_err();
        assert!(err.to_string().contains("row 2"), "{err}");
        // Wrong shape and wrong dtype.
        let short = Tensor::from_vec(vec![1u8; 4], (2, 2), &Device::Cpu).unwrap();
        assert!(mask_logits(&logits, &short).is_err());
        let wide = Tensor::from_vec(vec![1u32; 6], (3, 2), &Device::Cpu).unwrap();
        assert!(mask_logits(&logits, &wide).is_err());
        // The host check: length, values, a legal action in every row.
        check_masks(&[1, 0, 0, 1], 2, 2).unwrap();
        check_masks(&[], 0, 3).unwrap();
        assert!(check_masks(&[1, 0, 0], 2, 2).is_err());
        let err = check_masks(&[1, 1, 0, 1, 0, 0, 0, 0], 4, 2).unwrap_err();
        assert!(err.to_string().contains("row 2"), "{err}");
        assert!(check_masks(&[], 1, 0).is_err());
    }

    #[test]
    fn masked_host_log_softmax_is_the_legal_one() {
        // [1, 2, 3] under [1, 0, 1]: as the hand-computed test above.
        let mut out = [0f32; 3];
        masked_log_softmax_row(&[1.0, 2.0, 3.0], Some(&[1, 0, 1]), &mut out);
        assert!((out[0] + 2.126_928).abs() < 1e-6 && (out[2] + 0.126_928).abs() < 1e-6);
        assert_eq!(out[1], f32::NEG_INFINITY);
        // Legal logits as low as MASKED_LOGIT: still only the legal entries count.
        masked_log_softmax_row(&[MASKED_LOGIT; 3], Some(&[0, 1, 1]), &mut out);
        assert_eq!(out[0], f32::NEG_INFINITY);
        assert!(out[1..].iter().all(|lp| lp.is_finite() && *lp <= 0.0));
        // All legal is the plain log-softmax, bit for bit.
        let (mut a, mut b) = ([0f32; 3], [0f32; 3]);
        masked_log_softmax_row(&[0.3, -1.0, 2.0], Some(&[1, 1, 1]), &mut a);
        log_softmax_row(&[0.3, -1.0, 2.0], &mut b);
        assert_eq!(a, b);
    }
}
