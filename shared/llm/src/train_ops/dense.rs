//! Row-wise fused ops: linear layers (plain, scaled, with a LoRA
//! update), the residual add, RMSNorm and SwiGLU.

use super::*;

/// `y = scale · x Wᵀ`.
pub(crate) struct Linear {
    pub(crate) scale: f32,
}

/// `y = x Wᵀ + b`.
pub(crate) struct LinearBias;

pub(crate) fn linear_fwd(
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
pub(crate) fn linear_bwd(
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
pub(crate) struct LoraLinear {
    pub(crate) weight: Tensor,
    pub(crate) bias: Option<Tensor>,
    pub(crate) scale: f32,
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
pub(crate) struct Residual;

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
pub(crate) struct RmsNorm {
    pub(crate) eps: f32,
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
pub(crate) struct SwiGlu;

pub(crate) fn sigmoid(x: f32) -> f32 {
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
