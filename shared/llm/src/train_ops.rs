//! Fused candle ops for the training forward, each with its own backward
//! ([`candle_core::CustomOp2`]/[`candle_core::CustomOp3`]/
//! [`candle_core::CustomOp1`]), CPU and f32 only.
//!
//! Why: composed of candle's basic ops, the training forward spent most
//! of its backward on bookkeeping rather than arithmetic. Each basic op
//! allocates its output and, in the backward, a zero tensor plus a sum
//! for every gradient; candle computes the gradient of every operand,
//! including frozen base weights and the constant causal mask; the
//! attention softmax was five ops over `(batch, heads, time, time)`
//! tensors. Here every op computes only the gradients of operands that
//! track one ([`Tensor::track_op`]) and keeps its intermediates per
//! attention head, in cache, instead of in graph tensors.
//!
//! This module owns:
//! - [`linear`]: `y = s · x Wᵀ (+ b)`; no gradient is computed for a
//!   frozen `W` or `b`;
//! - [`rms_norm`]: RMSNorm with gradients for the input and the weight;
//! - [`swiglu`]: `silu(gate) ⊙ up`;
//! - [`causal_attention`]: RoPE on queries and keys, grouped-query causal
//!   attention, for right-padded blocks from position 0; takes and gives
//!   `(batch · time, heads · head_dim)` rows, as the projections do; its
//!   backward recomputes each head's probabilities (flash-attention
//!   style) instead of storing them;
//! - [`target_log_probs`] and [`entropy`] of logit rows: log-softmax,
//!   gather and `−Σ p log p` without materialising the log-softmax.
//!
//! Every op is checked against its composition of candle ops (values and
//! gradients) in this module's tests.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Device, Layout, Result, Shape,
    Storage, Tensor,
};
use gemm::Parallelism;
use rayon::prelude::*;

/// A strided f32 matrix inside a slice.
#[derive(Clone, Copy)]
struct Mat<'a> {
    data: &'a [f32],
    offset: usize,
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

impl<'a> Mat<'a> {
    fn new(
        data: &'a [f32],
        offset: usize,
        (rows, cols): (usize, usize),
        (row_stride, col_stride): (usize, usize),
    ) -> Self {
        if rows > 0 && cols > 0 {
            // Every element gemm may read lies inside `data`.
            assert!(offset + (rows - 1) * row_stride + (cols - 1) * col_stride < data.len());
        }
        Self {
            data,
            offset,
            rows,
            cols,
            row_stride,
            col_stride,
        }
    }

    fn dense(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Self::new(data, 0, (rows, cols), (cols, 1))
    }

    /// A 2-D tensor layout over its storage.
    fn of_layout(data: &'a [f32], layout: &Layout) -> Result<Self> {
        let (rows, cols) = layout.shape().dims2()?;
        let stride = layout.stride();
        Ok(Self::new(
            data,
            layout.start_offset(),
            (rows, cols),
            (stride[0], stride[1]),
        ))
    }

    fn t(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
            ..self
        }
    }
}

/// Threads for one product: small products run on the calling thread.
fn parallelism(m: usize, n: usize, k: usize) -> Parallelism {
    let threads = rayon::current_num_threads();
    if threads > 1 && m * n * k >= 1 << 20 {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    }
}

/// `dst = [dst +] scale · a · b`, `dst` dense `(a.rows, b.cols)`.
fn matmul_into(
    dst: &mut [f32],
    a: Mat<'_>,
    b: Mat<'_>,
    scale: f32,
    accumulate: bool,
    parallelism: Parallelism,
) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(b.rows, k, "inner dimensions");
    assert_eq!(dst.len(), m * n, "destination size");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst.fill(0.0);
        }
        return;
    }
    // SAFETY: `Mat::new` checked that every strided element of `a` and `b`
    // is in bounds, and `dst` holds exactly `m · n` dense elements.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.data[a.offset..].as_ptr(),
            a.col_stride as isize,
            a.row_stride as isize,
            b.data[b.offset..].as_ptr(),
            b.col_stride as isize,
            b.row_stride as isize,
            1.0,
            scale,
            false,
            false,
            false,
            parallelism,
        )
    }
}

/// `scale · a · b` as a new dense vector.
fn matmul(a: Mat<'_>, b: Mat<'_>, scale: f32) -> Vec<f32> {
    let mut out = vec![0f32; a.rows * b.cols];
    let par = parallelism(a.rows, b.cols, a.cols);
    matmul_into(&mut out, a, b, scale, false, par);
    out
}

/// The f32 data of a CPU storage.
fn cpu_f32(storage: &CpuStorage) -> Result<&[f32]> {
    match storage {
        CpuStorage::F32(data) => Ok(data),
        other => bail!("training ops take f32 tensors, got {:?}", other.dtype()),
    }
}

/// The contiguous f32 elements of a layout over a storage.
fn contiguous<'a>(storage: &'a CpuStorage, layout: &Layout, op: &str) -> Result<&'a [f32]> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&cpu_f32(storage)?[start..end]),
        None => bail!("{op}: input must be contiguous"),
    }
}

/// Runs `f` on a 2-D tensor as a strided matrix (no copy).
fn with_mat<R>(t: &Tensor, f: impl FnOnce(Mat<'_>) -> R) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        bail!("training ops run on the CPU")
    };
    Ok(f(Mat::of_layout(cpu_f32(cpu)?, layout)?))
}

/// Runs `f` on a tensor's elements in row-major order (copies only a
/// non-contiguous tensor).
fn with_slice<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let t = t.detach().contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        bail!("training ops run on the CPU")
    };
    let data = contiguous(cpu, layout, "training op")?;
    Ok(f(data))
}

/// `scale · op(a) · op(b)` of 2-D tensors, `op` transposing when asked.
fn product(a: &Tensor, a_t: bool, b: &Tensor, b_t: bool, scale: f32) -> Result<Tensor> {
    let (data, rows, cols) = with_mat(a, |a| {
        let a = if a_t { a.t() } else { a };
        with_mat(b, |b| {
            let b = if b_t { b.t() } else { b };
            (matmul(a, b, scale), a.rows, b.cols)
        })
    })??;
    Tensor::from_vec(data, (rows, cols), &Device::Cpu)
}

/// Rows per parallel chunk so that a chunk holds about 16 K elements.
fn rows_per_chunk(width: usize) -> usize {
    (16 * 1024 / width.max(1)).max(1)
}

/// Column sums of a `(rows, cols)` row-major slice.
fn column_sums(data: &[f32], cols: usize) -> Vec<f32> {
    data.par_chunks(cols * rows_per_chunk(cols))
        .map(|chunk| {
            let mut sums = vec![0f32; cols];
            for row in chunk.chunks_exact(cols) {
                for (s, v) in sums.iter_mut().zip(row) {
                    *s += v;
                }
            }
            sums
        })
        .reduce(
            || vec![0f32; cols],
            |mut a, b| {
                for (x, y) in a.iter_mut().zip(&b) {
                    *x += y;
                }
                a
            },
        )
}

/// `y = scale · x Wᵀ`.
struct Linear {
    scale: f32,
}

/// `y = x Wᵀ + b`.
struct LinearBias;

fn linear_fwd(
    x: Mat<'_>,
    w: Mat<'_>,
    bias: Option<&[f32]>,
    scale: f32,
) -> Result<(CpuStorage, Shape)> {
    let (rows, fan_in, fan_out) = (x.rows, x.cols, w.rows);
    if w.cols != fan_in {
        bail!(
            "linear: input has {fan_in} features, the weight takes {}",
            w.cols
        );
    }
    let mut y = vec![0f32; rows * fan_out];
    let accumulate = match bias {
        Some(b) => {
            if b.len() != fan_out {
                bail!("linear: bias has {} entries for {fan_out} outputs", b.len());
            }
            for row in y.chunks_exact_mut(fan_out) {
                row.copy_from_slice(b);
            }
            true
        }
        None => false,
    };
    matmul_into(
        &mut y,
        x,
        w.t(),
        scale,
        accumulate,
        parallelism(rows, fan_out, fan_in),
    );
    Ok((CpuStorage::F32(y), (rows, fan_out).into()))
}

/// Gradients of `y = scale · x Wᵀ` for the operands that track one.
fn linear_bwd(
    x: &Tensor,
    w: &Tensor,
    grad: &Tensor,
    scale: f32,
) -> Result<(Option<Tensor>, Option<Tensor>)> {
    let dx = if x.track_op() {
        Some(product(grad, false, w, false, scale)?)
    } else {
        None
    };
    let dw = if w.track_op() {
        Some(product(grad, true, x, false, scale)?)
    } else {
        None
    };
    Ok((dx, dw))
}

impl CustomOp2 for Linear {
    fn name(&self) -> &'static str {
        "train-linear"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = Mat::of_layout(cpu_f32(xs)?, xl)?;
        let w = Mat::of_layout(cpu_f32(ws)?, wl)?;
        linear_fwd(x, w, None, self.scale)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        linear_bwd(x, w, grad, self.scale)
    }
}

impl CustomOp3 for LinearBias {
    fn name(&self) -> &'static str {
        "train-linear-bias"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = Mat::of_layout(cpu_f32(xs)?, xl)?;
        let w = Mat::of_layout(cpu_f32(ws)?, wl)?;
        let b = contiguous(bs, bl, "linear bias")?;
        linear_fwd(x, w, Some(b), 1.0)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = linear_bwd(x, w, grad, 1.0)?;
        let db = if b.track_op() {
            let cols = grad.dim(1)?;
            let sums = with_slice(grad, |g| column_sums(g, cols))?;
            Some(Tensor::from_vec(sums, cols, &Device::Cpu)?)
        } else {
            None
        };
        Ok((dx, dw, db))
    }
}

/// `x Wᵀ + b` for `x` `(rows, in)`, `W` `(out, in)`, `b` `(out,)`.
/// Gradients reach `x`, and `W` and `b` only when they track one (a
/// frozen base weight costs no weight gradient).
pub(crate) fn linear(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    match bias {
        Some(b) => x.apply_op3(w, b, LinearBias),
        None => x.apply_op2(w, Linear { scale: 1.0 }),
    }
}

/// `scale · x Wᵀ` (a LoRA factor with its scaling folded in).
pub(crate) fn scaled_linear(x: &Tensor, w: &Tensor, scale: f64) -> Result<Tensor> {
    x.apply_op2(
        w,
        Linear {
            scale: scale as f32,
        },
    )
}

/// `y = x Wᵀ + b + scale · (x Aᵀ) Bᵀ`: a frozen projection (`W`, `b`
/// held by the op, never given a gradient) with its LoRA update, in one
/// op, so the adapted projection is one node of the graph with one
/// gradient for `x` instead of three summed ones.
struct LoraLinear {
    weight: Tensor,
    bias: Option<Tensor>,
    scale: f32,
}

impl CustomOp3 for LoraLinear {
    fn name(&self) -> &'static str {
        "train-lora-linear"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        as_: &CpuStorage,
        al: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = Mat::of_layout(cpu_f32(xs)?, xl)?;
        let a = Mat::of_layout(cpu_f32(as_)?, al)?;
        let b = Mat::of_layout(cpu_f32(bs)?, bl)?;
        if a.cols != x.cols || b.cols != a.rows {
            bail!(
                "lora: x ({}, {}), A ({}, {}), B ({}, {})",
                x.rows,
                x.cols,
                a.rows,
                a.cols,
                b.rows,
                b.cols
            );
        }
        let (storage, shape) = match &self.bias {
            Some(bias) => with_mat(&self.weight, |w| {
                with_slice(bias, |bias| linear_fwd(x, w, Some(bias), 1.0))
            })???,
            None => with_mat(&self.weight, |w| linear_fwd(x, w, None, 1.0))??,
        };
        let CpuStorage::F32(mut y) = storage else {
            bail!("lora: f32 output expected")
        };
        if shape.dims2()?.1 != b.rows {
            bail!("lora: B has {} rows for {:?} outputs", b.rows, shape);
        }
        let low = matmul(x, a.t(), 1.0);
        let low = Mat::dense(&low, x.rows, a.rows);
        let par = parallelism(x.rows, b.rows, a.rows);
        matmul_into(&mut y, low, b.t(), self.scale, true, par);
        Ok((CpuStorage::F32(y), shape))
    }

    fn bwd(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let scale = self.scale;
        let (rows, rank) = (x.dim(0)?, a.dim(0)?);
        let (dx, da, db) = with_mat(x, |xm| {
            with_mat(a, |am| {
                with_mat(b, |bm| {
                    with_mat(grad, |g| {
                        with_mat(&self.weight, |w| {
                            // low = x Aᵀ, d_low = scale · g B.
                            let low = matmul(xm, am.t(), 1.0);
                            let d_low = matmul(g, bm, scale);
                            let low = Mat::dense(&low, rows, rank);
                            let d_low_m = Mat::dense(&d_low, rows, rank);
                            let db = b.track_op().then(|| matmul(g.t(), low, scale));
                            let da = a.track_op().then(|| matmul(d_low_m.t(), xm, 1.0));
                            let dx = x.track_op().then(|| {
                                let mut dx = matmul(g, w, 1.0);
                                let par = parallelism(rows, xm.cols, rank);
                                matmul_into(&mut dx, d_low_m, am, 1.0, true, par);
                                dx
                            });
                            (dx, da, db)
                        })
                    })
                })
            })
        })?????;
        let wrap = |data: Option<Vec<f32>>, like: &Tensor| -> Result<Option<Tensor>> {
            data.map(|d| Tensor::from_vec(d, like.shape(), &Device::Cpu))
                .transpose()
        };
        Ok((wrap(dx, x)?, wrap(da, a)?, wrap(db, b)?))
    }
}

/// `x Wᵀ + b + scale · (x Aᵀ) Bᵀ` for a frozen `W` `(out, in)` and `b`
/// `(out,)`, and LoRA factors `A` `(rank, in)`, `B` `(out, rank)`:
/// gradients reach `x`, `A` and `B`, never `W` or `b` (use [`linear`]
/// twice when the weight trains too).
pub(crate) fn lora_linear(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    (a, b): (&Tensor, &Tensor),
    scale: f64,
) -> Result<Tensor> {
    x.apply_op3(
        a,
        b,
        LoraLinear {
            weight: weight.detach(),
            bias: bias.map(Tensor::detach),
            scale: scale as f32,
        },
    )
}

/// `a + b` for the residual stream: the sum on rayon (not candle's
/// spinning elementwise pool), the gradient passed to both unchanged.
struct Residual;

impl CustomOp2 for Residual {
    fn name(&self) -> &'static str {
        "train-residual"
    }

    fn cpu_fwd(
        &self,
        as_: &CpuStorage,
        al: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if al.shape() != bl.shape() {
            bail!("residual: {:?} + {:?}", al.shape(), bl.shape());
        }
        let a = contiguous(as_, al, "residual")?;
        let b = contiguous(bs, bl, "residual")?;
        let mut y = vec![0f32; a.len()];
        let chunk = 16 * 1024;
        y.par_chunks_mut(chunk)
            .zip(a.par_chunks(chunk).zip(b.par_chunks(chunk)))
            .for_each(|(y, (a, b))| {
                for ((y, a), b) in y.iter_mut().zip(a).zip(b) {
                    *y = a + b;
                }
            });
        Ok((CpuStorage::F32(y), al.shape().clone()))
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((
            a.track_op().then(|| grad.clone()),
            b.track_op().then(|| grad.clone()),
        ))
    }
}

/// `a + b` of two tensors of one shape (the residual stream).
pub(crate) fn residual(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    a.contiguous()?.apply_op2(&b.contiguous()?, Residual)
}

/// RMSNorm over the last dimension: `x / sqrt(mean(x²) + eps) ⊙ w`.
struct RmsNorm {
    eps: f32,
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "train-rms-norm"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = contiguous(xs, xl, "rms_norm")?;
        let w = contiguous(ws, wl, "rms_norm weight")?;
        let n = xl.dims().last().copied().unwrap_or(0);
        if w.len() != n || n == 0 {
            bail!("rms_norm: weight has {} entries for rows of {n}", w.len());
        }
        let mut y = vec![0f32; x.len()];
        let chunk = n * rows_per_chunk(n);
        y.par_chunks_mut(chunk)
            .zip(x.par_chunks(chunk))
            .for_each(|(ys, xs)| {
                for (y, x) in ys.chunks_exact_mut(n).zip(xs.chunks_exact(n)) {
                    let sum2: f32 = x.iter().map(|v| v * v).sum();
                    let rms = (sum2 / n as f32 + self.eps).sqrt();
                    for ((y, x), w) in y.iter_mut().zip(x).zip(w) {
                        *y = x / rms * w;
                    }
                }
            });
        Ok((CpuStorage::F32(y), xl.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let n = w.elem_count();
        let want_dw = w.track_op();
        let eps = self.eps;
        let (dx, dw) = with_slice(x, |x| {
            with_slice(w, |w| {
                with_slice(grad, |g| {
                    let mut dx = vec![0f32; x.len()];
                    let chunk = n * rows_per_chunk(n);
                    let dw = dx
                        .par_chunks_mut(chunk)
                        .zip(x.par_chunks(chunk))
                        .zip(g.par_chunks(chunk))
                        .map(|((dxs, xs), gs)| {
                            let mut dw = if want_dw { vec![0f32; n] } else { Vec::new() };
                            for ((dx, x), g) in dxs
                                .chunks_exact_mut(n)
                                .zip(xs.chunks_exact(n))
                                .zip(gs.chunks_exact(n))
                            {
                                let sum2: f32 = x.iter().map(|v| v * v).sum();
                                let inv = 1.0 / (sum2 / n as f32 + eps).sqrt();
                                let dot: f32 =
                                    g.iter().zip(w).zip(x).map(|((g, w), x)| g * w * x).sum();
                                let c = inv * inv * inv * dot / n as f32;
                                for i in 0..n {
                                    dx[i] = inv * g[i] * w[i] - c * x[i];
                                }
                                if want_dw {
                                    for i in 0..n {
                                        dw[i] += g[i] * x[i] * inv;
                                    }
                                }
                            }
                            dw
                        })
                        .reduce(Vec::new, |mut a, b| {
                            if a.is_empty() {
                                return b;
                            }
                            for (x, y) in a.iter_mut().zip(&b) {
                                *x += y;
                            }
                            a
                        });
                    (dx, dw)
                })
            })
        })???;
        let dx = if x.track_op() {
            Some(Tensor::from_vec(dx, x.shape(), &Device::Cpu)?)
        } else {
            None
        };
        let dw = if want_dw {
            Some(Tensor::from_vec(dw, n, &Device::Cpu)?)
        } else {
            None
        };
        Ok((dx, dw))
    }
}

/// RMSNorm of the rows of `x` (any rank; the last dimension is normalised)
/// with weight `w`; gradients reach `x` and a trainable `w`.
pub(crate) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?
        .apply_op2(&w.contiguous()?, RmsNorm { eps: eps as f32 })
}

/// `silu(gate) ⊙ up`.
struct SwiGlu;

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "train-swiglu"
    }

    fn cpu_fwd(
        &self,
        gs: &CpuStorage,
        gl: &Layout,
        us: &CpuStorage,
        ul: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let gate = contiguous(gs, gl, "swiglu gate")?;
        let up = contiguous(us, ul, "swiglu up")?;
        if gl.shape() != ul.shape() {
            bail!("swiglu: gate {:?} and up {:?}", gl.shape(), ul.shape());
        }
        let mut y = vec![0f32; gate.len()];
        let chunk = 16 * 1024;
        y.par_chunks_mut(chunk)
            .zip(gate.par_chunks(chunk).zip(up.par_chunks(chunk)))
            .for_each(|(ys, (gs, us))| {
                for ((y, g), u) in ys.iter_mut().zip(gs).zip(us) {
                    // candle's silu: x / (1 + exp(-x)).
                    *y = g / (1.0 + (-g).exp()) * u;
                }
            });
        Ok((CpuStorage::F32(y), gl.shape().clone()))
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (d_gate, d_up) = with_slice(gate, |gate| {
            with_slice(up, |up| {
                with_slice(grad, |grad| {
                    let mut d_gate = vec![0f32; gate.len()];
                    let mut d_up = vec![0f32; gate.len()];
                    let chunk = 16 * 1024;
                    d_gate
                        .par_chunks_mut(chunk)
                        .zip(d_up.par_chunks_mut(chunk))
                        .zip(gate.par_chunks(chunk).zip(up.par_chunks(chunk)))
                        .zip(grad.par_chunks(chunk))
                        .for_each(|(((dgs, dus), (gs, us)), ys)| {
                            for i in 0..gs.len() {
                                let (g, u, dy) = (gs[i], us[i], ys[i]);
                                let s = sigmoid(g);
                                dus[i] = dy * g * s;
                                dgs[i] = dy * u * s * (1.0 + g * (1.0 - s));
                            }
                        });
                    (d_gate, d_up)
                })
            })
        })???;
        let shape = gate.shape();
        Ok((
            Some(Tensor::from_vec(d_gate, shape, &Device::Cpu)?).filter(|_| gate.track_op()),
            Some(Tensor::from_vec(d_up, shape, &Device::Cpu)?).filter(|_| up.track_op()),
        ))
    }
}

/// `silu(gate) ⊙ up` (the gated MLP's inner activation).
pub(crate) fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gate.contiguous()?.apply_op2(&up.contiguous()?, SwiGlu)
}

/// Causal grouped-query self-attention with RoPE over right-padded
/// sequences that start at position 0.
#[derive(Debug, Clone)]
pub(crate) struct CausalAttention {
    batch: usize,
    time: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// `(time, head_dim / 2)` rotary tables.
    cos: Arc<Vec<f32>>,
    sin: Arc<Vec<f32>>,
}

/// Per-thread buffers of one attention task.
struct Scratch {
    /// Rotated keys of the task's key/value head, `(time, head_dim)`.
    keys: Vec<f32>,
    /// Rotated queries of one head, `(time, head_dim)`.
    queries: Vec<f32>,
    /// Probabilities `(time, time)`.
    probs: Vec<f32>,
    /// Gradient of the scores `(time, time)` (backward only).
    d_scores: Vec<f32>,
    /// Gradient of one head's rotated queries `(time, head_dim)`.
    d_queries: Vec<f32>,
}

impl Scratch {
    fn new(time: usize, head_dim: usize) -> Self {
        Self {
            keys: vec![0.0; time * head_dim],
            queries: vec![0.0; time * head_dim],
            probs: vec![0.0; time * time],
            d_scores: Vec::new(),
            d_queries: Vec::new(),
        }
    }
}

/// Gradients of one `(sequence, key/value head)` task.
struct TaskGrads {
    /// `(rep, time, head_dim)`.
    queries: Vec<f32>,
    /// `(time, head_dim)` each.
    keys: Vec<f32>,
    values: Vec<f32>,
}

impl CausalAttention {
    /// Rotates `time` rows of one head (`src[offset + t · stride ..][..head_dim]`)
    /// into `dst` `(time, head_dim)` ("rotate half" layout).
    fn rope(&self, src: &[f32], offset: usize, stride: usize, dst: &mut [f32]) {
        let (d, half) = (self.head_dim, self.head_dim / 2);
        for t in 0..self.time {
            let x = &src[offset + t * stride..][..d];
            let (cos, sin) = (&self.cos[t * half..][..half], &self.sin[t * half..][..half]);
            let (lo, hi) = dst[t * d..(t + 1) * d].split_at_mut(half);
            for i in 0..half {
                lo[i] = x[i] * cos[i] - x[i + half] * sin[i];
                hi[i] = x[i + half] * cos[i] + x[i] * sin[i];
            }
        }
    }

    /// The transpose of [`CausalAttention::rope`] (the rotation by minus
    /// the angle), from `src` `(time, head_dim)` into `dst` `(time, head_dim)`.
    fn unrope(&self, src: &[f32], dst: &mut [f32]) {
        let (d, half) = (self.head_dim, self.head_dim / 2);
        for t in 0..self.time {
            let (cos, sin) = (&self.cos[t * half..][..half], &self.sin[t * half..][..half]);
            let (lo, hi) = src[t * d..(t + 1) * d].split_at(half);
            let (dlo, dhi) = dst[t * d..(t + 1) * d].split_at_mut(half);
            for i in 0..half {
                dlo[i] = lo[i] * cos[i] + hi[i] * sin[i];
                dhi[i] = hi[i] * cos[i] - lo[i] * sin[i];
            }
        }
    }

    /// Scores of rotated queries against rotated keys, then the causal
    /// softmax of each row, into `scratch.probs`.
    fn probabilities(&self, scratch: &mut Scratch) {
        let (t, d) = (self.time, self.head_dim);
        let scale = 1.0 / (d as f32).sqrt();
        matmul_into(
            &mut scratch.probs,
            Mat::dense(&scratch.queries, t, d),
            Mat::dense(&scratch.keys, t, d).t(),
            scale,
            false,
            Parallelism::None,
        );
        for (i, row) in scratch.probs.chunks_exact_mut(t).enumerate() {
            let (seen, future) = row.split_at_mut(i + 1);
            let max = seen.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for p in seen.iter_mut() {
                *p = (*p - max).exp();
                sum += *p;
            }
            for p in seen.iter_mut() {
                *p /= sum;
            }
            future.fill(0.0);
        }
    }

    fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }

    fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Outputs `(rep, time, head_dim)` of the query heads of one task.
    fn forward_task(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        task: usize,
        s: &mut Scratch,
    ) -> Vec<f32> {
        let (t, d) = (self.time, self.head_dim);
        let rep = self.heads / self.kv_heads;
        let (b, g) = (task / self.kv_heads, task % self.kv_heads);
        let (qw, kw) = (self.q_width(), self.kv_width());
        self.rope(k, b * t * kw + g * d, kw, &mut s.keys);
        let values = Mat::new(v, b * t * kw + g * d, (t, d), (kw, 1));
        let mut out = vec![0f32; rep * t * d];
        for (r, out) in out.chunks_exact_mut(t * d).enumerate() {
            let head = g * rep + r;
            self.rope(q, b * t * qw + head * d, qw, &mut s.queries);
            self.probabilities(s);
            matmul_into(
                out,
                Mat::dense(&s.probs, t, t),
                values,
                1.0,
                false,
                Parallelism::None,
            );
        }
        out
    }

    /// Gradients of one task's queries, keys and values.
    #[allow(clippy::too_many_arguments)]
    fn backward_task(
        &self,
        (q, k, v): (&[f32], &[f32], &[f32]),
        out: &[f32],
        d_out: &[f32],
        task: usize,
        s: &mut Scratch,
    ) -> TaskGrads {
        let (t, d) = (self.time, self.head_dim);
        let rep = self.heads / self.kv_heads;
        let (b, g) = (task / self.kv_heads, task % self.kv_heads);
        let (qw, kw) = (self.q_width(), self.kv_width());
        let scale = 1.0 / (d as f32).sqrt();
        s.d_scores.resize(t * t, 0.0);
        s.d_queries.resize(t * d, 0.0);
        self.rope(k, b * t * kw + g * d, kw, &mut s.keys);
        let values = Mat::new(v, b * t * kw + g * d, (t, d), (kw, 1));
        let mut grads = TaskGrads {
            queries: vec![0f32; rep * t * d],
            keys: vec![0f32; t * d],
            values: vec![0f32; t * d],
        };
        let mut d_keys = vec![0f32; t * d];
        for r in 0..rep {
            let head = g * rep + r;
            let offset = b * t * qw + head * d;
            self.rope(q, offset, qw, &mut s.queries);
            self.probabilities(s);
            let d_o = Mat::new(d_out, offset, (t, d), (qw, 1));
            // dV += Pᵀ dO
            matmul_into(
                &mut grads.values,
                Mat::dense(&s.probs, t, t).t(),
                d_o,
                1.0,
                true,
                Parallelism::None,
            );
            // dP = dO Vᵀ, then dS = P ⊙ (dP − rowsum(dO ⊙ O)).
            matmul_into(
                &mut s.d_scores,
                d_o,
                values.t(),
                1.0,
                false,
                Parallelism::None,
            );
            for i in 0..t {
                let row_out = &out[offset + i * qw..][..d];
                let row_d_out = &d_out[offset + i * qw..][..d];
                let dot: f32 = row_out.iter().zip(row_d_out).map(|(a, b)| a * b).sum();
                let ds = &mut s.d_scores[i * t..(i + 1) * t];
                let p = &s.probs[i * t..(i + 1) * t];
                for j in 0..=i {
                    ds[j] = p[j] * (ds[j] - dot);
                }
                ds[i + 1..].fill(0.0);
            }
            // dQ = scale · dS K, dK += scale · dSᵀ Q (rotated frames).
            matmul_into(
                &mut s.d_queries,
                Mat::dense(&s.d_scores, t, t),
                Mat::dense(&s.keys, t, d),
                scale,
                false,
                Parallelism::None,
            );
            matmul_into(
                &mut d_keys,
                Mat::dense(&s.d_scores, t, t).t(),
                Mat::dense(&s.queries, t, d),
                scale,
                true,
                Parallelism::None,
            );
            self.unrope(&s.d_queries, &mut grads.queries[r * t * d..(r + 1) * t * d]);
        }
        self.unrope(&d_keys, &mut grads.keys);
        grads
    }

    /// Copies `(time, head_dim)` blocks of task `task`'s head `head` into
    /// rows of width `width`.
    fn scatter(&self, dst: &mut [f32], block: &[f32], task: usize, head: usize, width: usize) {
        let (t, d) = (self.time, self.head_dim);
        let b = task / self.kv_heads;
        for (i, row) in block.chunks_exact(d).enumerate() {
            dst[(b * t + i) * width + head * d..][..d].copy_from_slice(row);
        }
    }

    fn check(&self, what: &str, layout: &Layout, width: usize) -> Result<()> {
        let want = (self.batch * self.time, width);
        if layout.shape().dims2()? != want {
            bail!(
                "attention: {what} is {:?}, expected {want:?}",
                layout.shape()
            );
        }
        Ok(())
    }
}

impl CustomOp3 for CausalAttention {
    fn name(&self) -> &'static str {
        "train-causal-attention"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
        vs: &CpuStorage,
        vl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.check("q", ql, self.q_width())?;
        self.check("k", kl, self.kv_width())?;
        self.check("v", vl, self.kv_width())?;
        let q = contiguous(qs, ql, "attention q")?;
        let k = contiguous(ks, kl, "attention k")?;
        let v = contiguous(vs, vl, "attention v")?;
        let tasks = self.batch * self.kv_heads;
        let blocks: Vec<Vec<f32>> = (0..tasks)
            .into_par_iter()
            .map_init(
                || Scratch::new(self.time, self.head_dim),
                |s, task| self.forward_task(q, k, v, task, s),
            )
            .collect();
        let rep = self.heads / self.kv_heads;
        let block = self.time * self.head_dim;
        let mut y = vec![0f32; self.batch * self.time * self.q_width()];
        for (task, heads) in blocks.iter().enumerate() {
            let g = task % self.kv_heads;
            for (r, out) in heads.chunks_exact(block).enumerate() {
                self.scatter(&mut y, out, task, g * rep + r, self.q_width());
            }
        }
        Ok((
            CpuStorage::F32(y),
            (self.batch * self.time, self.q_width()).into(),
        ))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let rep = self.heads / self.kv_heads;
        let block = self.time * self.head_dim;
        let rows = self.batch * self.time;
        let (dq, dk, dv) = with_slice(q, |qd| {
            with_slice(k, |kd| {
                with_slice(v, |vd| {
                    with_slice(res, |out| {
                        with_slice(grad, |d_out| {
                            let tasks: Vec<TaskGrads> = (0..self.batch * self.kv_heads)
                                .into_par_iter()
                                .map_init(
                                    || Scratch::new(self.time, self.head_dim),
                                    |s, task| self.backward_task((qd, kd, vd), out, d_out, task, s),
                                )
                                .collect();
                            let mut dq = vec![0f32; rows * self.q_width()];
                            let mut dk = vec![0f32; rows * self.kv_width()];
                            let mut dv = vec![0f32; rows * self.kv_width()];
                            for (task, grads) in tasks.iter().enumerate() {
                                let g = task % self.kv_heads;
                                for (r, dqh) in grads.queries.chunks_exact(block).enumerate() {
                                    self.scatter(&mut dq, dqh, task, g * rep + r, self.q_width());
                                }
                                self.scatter(&mut dk, &grads.keys, task, g, self.kv_width());
                                self.scatter(&mut dv, &grads.values, task, g, self.kv_width());
                            }
                            (dq, dk, dv)
                        })
                    })
                })
            })
        })?????;
        let wrap = |data: Vec<f32>, arg: &Tensor| -> Result<Option<Tensor>> {
            if arg.track_op() {
                Ok(Some(Tensor::from_vec(data, arg.shape(), &Device::Cpu)?))
            } else {
                Ok(None)
            }
        };
        Ok((wrap(dq, q)?, wrap(dk, k)?, wrap(dv, v)?))
    }
}

/// Causal self-attention of right-padded sequences from position 0, with
/// RoPE applied to queries and keys inside.
///
/// `q` `(batch · time, heads · head_dim)`, `k` and `v`
/// `(batch · time, kv_heads · head_dim)`: the projections' rows, sequence
/// by sequence. `cos`/`sin`: `(≥ time, head_dim / 2)` rotary tables.
/// Returns `(batch · time, heads · head_dim)`, ready for `o_proj`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    (batch, time): (usize, usize),
    (heads, kv_heads, head_dim): (usize, usize, usize),
    cos: &Tensor,
    sin: &Tensor,
) -> Result<Tensor> {
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) || head_dim % 2 != 0 {
        bail!("attention: {heads} heads, {kv_heads} key/value heads, head_dim {head_dim}");
    }
    let table = |t: &Tensor| -> Result<Arc<Vec<f32>>> {
        Ok(Arc::new(
            t.narrow(0, 0, time)?.flatten_all()?.to_vec1::<f32>()?,
        ))
    };
    let op = CausalAttention {
        batch,
        time,
        heads,
        kv_heads,
        head_dim,
        cos: table(cos)?,
        sin: table(sin)?,
    };
    q.contiguous()?
        .apply_op3(&k.contiguous()?, &v.contiguous()?, op)
}

/// Per row of logits: `(max, log Σ exp(z − max))`.
fn log_sum_exp(row: &[f32]) -> f32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = row.iter().map(|z| (z - max).exp()).sum();
    max + sum.ln()
}

/// `log softmax(z)[target]` per row.
struct TargetLogProb {
    targets: Arc<Vec<u32>>,
}

impl CustomOp1 for TargetLogProb {
    fn name(&self) -> &'static str {
        "train-target-log-prob"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let z = contiguous(s, l, "target_log_probs")?;
        let (rows, vocab) = l.shape().dims2()?;
        if self.targets.len() != rows {
            bail!("{} targets for {rows} logit rows", self.targets.len());
        }
        if let Some(bad) = self.targets.iter().find(|&&t| t as usize >= vocab) {
            bail!("target {bad} outside a vocabulary of {vocab}");
        }
        let out: Vec<f32> = z
            .par_chunks(vocab)
            .zip(self.targets.par_iter())
            .map(|(row, &t)| row[t as usize] - log_sum_exp(row))
            .collect();
        Ok((CpuStorage::F32(out), rows.into()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let (rows, vocab) = arg.dims2()?;
        let dz = with_slice(arg, |z| {
            with_slice(grad, |g| {
                let mut dz = vec![0f32; rows * vocab];
                dz.par_chunks_mut(vocab)
                    .zip(z.par_chunks(vocab))
                    .zip(g.par_iter().zip(self.targets.par_iter()))
                    .for_each(|((dz, z), (&g, &t))| {
                        let lse = log_sum_exp(z);
                        for (d, z) in dz.iter_mut().zip(z) {
                            *d = -g * (z - lse).exp();
                        }
                        dz[t as usize] += g;
                    });
                dz
            })
        })??;
        Ok(Some(Tensor::from_vec(dz, (rows, vocab), &Device::Cpu)?))
    }
}

/// `log softmax(logits)[i, targets[i]]` for logits `(rows, vocab)` and
/// `targets` `(rows,)`: `(rows,)`, differentiable in the logits.
pub(crate) fn target_log_probs(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    if !fused_here(logits) {
        // Elsewhere (a GPU, another dtype): log-softmax and gather composed.
        let log_probs = candle_nn::ops::log_softmax(&logits.to_dtype(DType::F32)?, 1)?;
        let targets = targets.to_dtype(DType::U32)?.unsqueeze(1)?.contiguous()?;
        return log_probs.gather(&targets, 1)?.squeeze(1);
    }
    let targets = targets
        .to_dtype(candle_core::DType::U32)?
        .to_vec1::<u32>()?;
    logits.contiguous()?.apply_op1(TargetLogProb {
        targets: Arc::new(targets),
    })
}

/// `−Σ_v p_v log p_v` per row.
struct Entropy;

impl CustomOp1 for Entropy {
    fn name(&self) -> &'static str {
        "train-entropy"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let z = contiguous(s, l, "entropy")?;
        let (rows, vocab) = l.shape().dims2()?;
        let out: Vec<f32> = z
            .par_chunks(vocab)
            .map(|row| {
                let lse = log_sum_exp(row);
                -row.iter()
                    .map(|z| {
                        let log_p = z - lse;
                        log_p.exp() * log_p
                    })
                    .sum::<f32>()
            })
            .collect();
        Ok((CpuStorage::F32(out), rows.into()))
    }

    fn bwd(&self, arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let (rows, vocab) = arg.dims2()?;
        // dH/dz_j = −p_j (log p_j + H).
        let dz = with_slice(arg, |z| {
            with_slice(res, |h| {
                with_slice(grad, |g| {
                    let mut dz = vec![0f32; rows * vocab];
                    dz.par_chunks_mut(vocab)
                        .zip(z.par_chunks(vocab))
                        .zip(g.par_iter().zip(h.par_iter()))
                        .for_each(|((dz, z), (&g, &h))| {
                            let lse = log_sum_exp(z);
                            for (d, z) in dz.iter_mut().zip(z) {
                                let log_p = z - lse;
                                *d = -g * log_p.exp() * (log_p + h);
                            }
                        });
                    dz
                })
            })
        })???;
        Ok(Some(Tensor::from_vec(dz, (rows, vocab), &Device::Cpu)?))
    }
}

/// Entropy of the softmax of each row of `logits` `(rows, vocab)`:
/// `(rows,)`, differentiable.
pub(crate) fn entropy(logits: &Tensor) -> Result<Tensor> {
    if !fused_here(logits) {
        let log_probs = candle_nn::ops::log_softmax(&logits.to_dtype(DType::F32)?, 1)?;
        return (log_probs.exp()? * &log_probs)?.sum(1)?.neg();
    }
    logits.contiguous()?.apply_op1(Entropy)
}

/// Whether the fused CPU ops take `t` (f32 on the CPU); the candle
/// backend's tensors elsewhere get the compositions of candle ops.
fn fused_here(t: &Tensor) -> bool {
    t.device().is_cpu() && t.dtype() == DType::F32
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Var, D};

    use super::*;

    fn randn(shape: &[usize], seed: u64) -> Tensor {
        use rand::SeedableRng;
        use rand_distr::{Distribution, Normal};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let n: usize = shape.iter().product();
        let normal = Normal::new(0f32, 1.0).unwrap();
        let data: Vec<f32> = (0..n).map(|_| normal.sample(&mut rng)).collect();
        Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
    }

    fn var(shape: &[usize], seed: u64) -> Var {
        Var::from_tensor(&randn(shape, seed)).unwrap()
    }

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
        assert_eq!(a.dims(), b.dims());
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    fn max_abs(a: &Tensor) -> f32 {
        a.abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    /// `Σ out ⊙ r` with a fixed random `r`: a loss whose gradient w.r.t.
    /// `out` is `r`, so every output element matters.
    fn probe_loss(out: &Tensor, seed: u64) -> Tensor {
        let r = randn(out.dims(), seed);
        (out * r).unwrap().sum_all().unwrap()
    }

    /// Checks values and the gradients of `vars` of a fused function
    /// against a composed one.
    fn check(
        vars: &[&Var],
        fused: impl Fn() -> Tensor,
        composed: impl Fn() -> Tensor,
        tolerance: f32,
    ) {
        let (a, b) = (fused(), composed());
        let scale = max_abs(&b).max(1.0);
        let diff = max_abs_diff(&a, &b);
        assert!(diff <= tolerance * scale, "values differ by {diff}");
        let ga = probe_loss(&a, 99).backward().unwrap();
        let gb = probe_loss(&b, 99).backward().unwrap();
        for (i, v) in vars.iter().enumerate() {
            let ga = ga.get(v.as_tensor()).expect("fused gradient");
            let gb = gb.get(v.as_tensor()).expect("composed gradient");
            let scale = max_abs(gb).max(1e-3);
            let diff = max_abs_diff(ga, gb);
            assert!(
                diff <= tolerance * scale,
                "gradient of operand {i} differs by {diff} (scale {scale})"
            );
        }
    }

    #[test]
    fn linear_matches_matmul_with_and_without_bias() {
        let x = var(&[7, 5], 1);
        let w = var(&[3, 5], 2);
        let b = var(&[3], 3);
        check(
            &[&x, &w, &b],
            || linear(&x, &w, Some(&b)).unwrap(),
            || {
                x.matmul(&w.t().unwrap())
                    .unwrap()
                    .broadcast_add(&b)
                    .unwrap()
            },
            1e-5,
        );
        check(
            &[&x, &w],
            || scaled_linear(&x, &w, 0.5).unwrap(),
            || (x.matmul(&w.t().unwrap()).unwrap() * 0.5).unwrap(),
            1e-5,
        );
        // A transposed (strided) input works without a copy.
        let xt = var(&[5, 7], 4);
        check(
            &[&xt, &w],
            || linear(&xt.t().unwrap(), &w, None).unwrap(),
            || xt.t().unwrap().matmul(&w.t().unwrap()).unwrap(),
            1e-5,
        );
    }

    #[test]
    fn a_frozen_weight_gets_no_gradient() {
        let x = var(&[4, 6], 5);
        let w = randn(&[2, 6], 6);
        let b = randn(&[2], 7);
        let grads = probe_loss(&linear(&x, &w, Some(&b)).unwrap(), 1)
            .backward()
            .unwrap();
        assert!(grads.get(&w).is_none());
        assert!(grads.get(&b).is_none());
        let want = randn(&[4, 2], 1).matmul(&w).unwrap();
        assert!(max_abs_diff(grads.get(x.as_tensor()).unwrap(), &want) < 1e-5);
    }

    #[test]
    fn lora_linear_matches_its_composition() {
        let x = var(&[9, 6], 21);
        let w = randn(&[5, 6], 22);
        let bias = randn(&[5], 23);
        let a = var(&[3, 6], 24);
        let b = var(&[5, 3], 25);
        check(
            &[&x, &a, &b],
            || lora_linear(&x, &w, Some(&bias), (&a, &b), 0.7).unwrap(),
            || {
                let base = x
                    .matmul(&w.t().unwrap())
                    .unwrap()
                    .broadcast_add(&bias)
                    .unwrap();
                let low = x.matmul(&a.t().unwrap()).unwrap();
                (base + (low.matmul(&b.t().unwrap()).unwrap() * 0.7).unwrap()).unwrap()
            },
            1e-5,
        );
        let grads = probe_loss(&lora_linear(&x, &w, None, (&a, &b), 0.7).unwrap(), 2)
            .backward()
            .unwrap();
        assert!(grads.get(&w).is_none());
    }

    #[test]
    fn residual_matches_add() {
        let a = var(&[3, 40_000], 26);
        let b = var(&[3, 40_000], 27);
        check(
            &[&a, &b],
            || residual(&a, &b).unwrap(),
            || (a.as_tensor() + b.as_tensor()).unwrap(),
            1e-6,
        );
    }

    #[test]
    fn rms_norm_matches_its_composition() {
        let x = var(&[2, 9, 16], 8);
        let w = var(&[16], 9);
        let eps = 1e-6;
        check(
            &[&x, &w],
            || rms_norm(&x, &w, eps).unwrap(),
            || {
                let ms = x.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
                let inv = (ms + eps).unwrap().sqrt().unwrap().recip().unwrap();
                x.broadcast_mul(&inv).unwrap().broadcast_mul(&w).unwrap()
            },
            1e-5,
        );
    }

    #[test]
    fn swiglu_matches_silu_times_up() {
        let g = var(&[6, 10], 10);
        let u = var(&[6, 10], 11);
        check(
            &[&g, &u],
            || swiglu(&g, &u).unwrap(),
            || (g.silu().unwrap() * u.as_tensor()).unwrap(),
            1e-5,
        );
    }

    /// Causal attention from candle ops: RoPE, repeated key/value heads,
    /// masked softmax (the composition the model used before).
    #[allow(clippy::too_many_arguments)]
    fn composed_attention(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        (b, t): (usize, usize),
        (h, kvh, d): (usize, usize, usize),
        cos: &Tensor,
        sin: &Tensor,
    ) -> Tensor {
        let rope = |x: &Tensor| {
            let half = d / 2;
            let cos = Tensor::cat(&[cos, cos], D::Minus1).unwrap();
            let sin = Tensor::cat(&[sin, sin], D::Minus1).unwrap();
            let x1 = x.narrow(D::Minus1, 0, half).unwrap();
            let x2 = x.narrow(D::Minus1, half, half).unwrap();
            let rotated = Tensor::cat(&[&x2.neg().unwrap(), &x1], D::Minus1).unwrap();
            (x.broadcast_mul(&cos).unwrap() + rotated.broadcast_mul(&sin).unwrap()).unwrap()
        };
        let split = |m: &Tensor, n: usize| {
            m.reshape((b, t, n, d))
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .contiguous()
                .unwrap()
        };
        let rep = h / kvh;
        let repeat = |m: Tensor| {
            // (b, kvh, t, d) -> (b, h, t, d), head i uses group i / rep.
            let parts: Vec<Tensor> = (0..h).map(|i| m.narrow(1, i / rep, 1).unwrap()).collect();
            Tensor::cat(&parts, 1).unwrap()
        };
        let q = rope(&split(q, h));
        let k = repeat(rope(&split(k, kvh)));
        let v = repeat(split(v, kvh));
        let mask: Vec<f32> = (0..t)
            .flat_map(|i| (0..t).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY }))
            .collect();
        let mask = Tensor::from_vec(mask, (t, t), &Device::Cpu).unwrap();
        let scores = (q.matmul(&k.t().unwrap()).unwrap() * (1.0 / (d as f64).sqrt()))
            .unwrap()
            .broadcast_add(&mask)
            .unwrap();
        let probs = candle_nn::ops::softmax(&scores, D::Minus1).unwrap();
        probs
            .matmul(&v)
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .reshape((b * t, h * d))
            .unwrap()
    }

    #[test]
    fn causal_attention_matches_its_composition() {
        let (b, t, h, kvh, d) = (2, 11, 4, 2, 8);
        let q = var(&[b * t, h * d], 12);
        let k = var(&[b * t, kvh * d], 13);
        let v = var(&[b * t, kvh * d], 14);
        let angles = randn(&[t + 3, d / 2], 15);
        let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
        let (cos_t, sin_t) = (cos.narrow(0, 0, t).unwrap(), sin.narrow(0, 0, t).unwrap());
        check(
            &[&q, &k, &v],
            || causal_attention(&q, &k, &v, (b, t), (h, kvh, d), &cos, &sin).unwrap(),
            || composed_attention(&q, &k, &v, (b, t), (h, kvh, d), &cos_t, &sin_t),
            1e-4,
        );
    }

    #[test]
    fn causal_attention_never_looks_ahead() {
        // Changing the last position of a sequence changes no earlier output.
        let (b, t, h, kvh, d) = (1, 6, 2, 1, 4);
        let q = randn(&[b * t, h * d], 16);
        let k = randn(&[b * t, kvh * d], 17);
        let v = randn(&[b * t, kvh * d], 18);
        let angles = randn(&[t, d / 2], 19);
        let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
        let run = |k: &Tensor, v: &Tensor| {
            causal_attention(&q, k, v, (b, t), (h, kvh, d), &cos, &sin)
                .unwrap()
                .narrow(0, 0, t - 1)
                .unwrap()
        };
        let bump = |m: &Tensor| {
            let last = (m.narrow(0, t - 1, 1).unwrap() + 5.0).unwrap();
            Tensor::cat(&[&m.narrow(0, 0, t - 1).unwrap(), &last], 0).unwrap()
        };
        assert_eq!(max_abs_diff(&run(&k, &v), &run(&bump(&k), &bump(&v))), 0.0);
    }

    #[test]
    fn target_log_probs_and_entropy_match_log_softmax() {
        let z = var(&[5, 13], 20);
        let targets = Tensor::new(&[0u32, 12, 3, 3, 7], &Device::Cpu).unwrap();
        check(
            &[&z],
            || target_log_probs(&z, &targets).unwrap(),
            || {
                candle_nn::ops::log_softmax(&z, D::Minus1)
                    .unwrap()
                    .gather(&targets.unsqueeze(1).unwrap(), 1)
                    .unwrap()
                    .squeeze(1)
                    .unwrap()
            },
            1e-5,
        );
        check(
            &[&z],
            || entropy(&z).unwrap(),
            || {
                let log_p = candle_nn::ops::log_softmax(&z, D::Minus1).unwrap();
                (log_p.exp().unwrap() * &log_p)
                    .unwrap()
                    .sum(1)
                    .unwrap()
                    .neg()
                    .unwrap()
            },
            1e-5,
        );
        let bad = Tensor::new(&[0u32, 13, 0, 0, 0], &Device::Cpu).unwrap();
        assert!(target_log_probs(&z.to_dtype(DType::F32).unwrap(), &bad).is_err());
    }
}
