//! Fused causal attention with RoPE and grouped queries; its backward
//! recomputes each head's probabilities instead of storing them.

use super::*;

/// Causal grouped-query self-attention with RoPE over right-padded
/// sequences that start at position 0.
#[derive(Debug, Clone)]
pub(crate) struct CausalAttention {
    pub(crate) batch: usize,
    pub(crate) time: usize,
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    /// `(time, head_dim / 2)` rotary tables.
    pub(crate) cos: Arc<Vec<f32>>,
    pub(crate) sin: Arc<Vec<f32>>,
}

/// Per-thread buffers of one attention task.
pub(crate) struct Scratch {
    /// Rotated keys of the task's key/value head, `(time, head_dim)`.
    pub(crate) keys: Vec<f32>,
    /// Rotated queries of one head, `(time, head_dim)`.
    pub(crate) queries: Vec<f32>,
    /// Probabilities `(time, time)`.
    pub(crate) probs: Vec<f32>,
    /// Gradient of the scores `(time, time)` (backward only).
    pub(crate) d_scores: Vec<f32>,
    /// Gradient of one head's rotated queries `(time, head_dim)`.
    pub(crate) d_queries: Vec<f32>,
}

impl Scratch {
    pub(crate) fn new(time: usize, head_dim: usize) -> Self {
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
pub(crate) struct TaskGrads {
    /// `(rep, time, head_dim)`.
    pub(crate) queries: Vec<f32>,
    /// `(time, head_dim)` each.
    pub(crate) keys: Vec<f32>,
    pub(crate) values: Vec<f32>,
}

impl CausalAttention {
    /// Rotates `time` rows of one head (`src[offset + t · stride ..][..head_dim]`)
    /// into `dst` `(time, head_dim)` ("rotate half" layout).
    pub(crate) fn rope(&self, src: &[f32], offset: usize, stride: usize, dst: &mut [f32]) {
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
    pub(crate) fn unrope(&self, src: &[f32], dst: &mut [f32]) {
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
    pub(crate) fn probabilities(&self, scratch: &mut Scratch) {
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

    pub(crate) fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }

    pub(crate) fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Outputs `(rep, time, head_dim)` of the query heads of one task.
    pub(crate) fn forward_task(
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
    pub(crate) fn backward_task(
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
    pub(crate) fn scatter(
        &self,
        dst: &mut [f32],
        block: &[f32],
        task: usize,
        head: usize,
        width: usize,
    ) {
        let (t, d) = (self.time, self.head_dim);
        let b = task / self.kv_heads;
        for (i, row) in block.chunks_exact(d).enumerate() {
            dst[(b * t + i) * width + head * d..][..d].copy_from_slice(row);
        }
    }

    pub(crate) fn check(&self, what: &str, layout: &Layout, width: usize) -> Result<()> {
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
