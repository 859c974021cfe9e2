//! Fused causal attention with RoPE and grouped queries over rows laid out
//! by an [`AttentionLayout`]; its backward recomputes each head's
//! probabilities instead of storing them.
//!
//! Rows come as the projections give them, `(rows, heads · head_dim)`. A
//! right-padded `(batch, time)` block is `batch` segments of `time` rows
//! and no prefix. A micro-batch whose sequences open with the same tokens
//! (the system prompt, chat header and rules every move of a text game
//! repeats) holds those tokens once, as a shared prefix: each segment sees
//! the whole prefix, then its own rows causally, at the positions after
//! it. The prefix's keys and values gather the gradients of every
//! segment's queries, so everything outside attention (projections, norms,
//! MLP, their backwards) runs once for the prefix: the same sums as running
//! it in every sequence, with none of the repeated work.

use super::*;

/// Which rows attend to which, in row order: the shared prefix, then the
/// segments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AttentionLayout {
    /// Rows `0..prefix` at positions `0..prefix`, causal among themselves.
    pub(crate) prefix: usize,
    /// Row counts of the segments after the prefix: each sees every prefix
    /// row, then its own rows causally, at positions `prefix..`.
    pub(crate) segments: Vec<usize>,
}

impl AttentionLayout {
    /// A right-padded `(batch, time)` block: `batch` segments of `time`
    /// rows from position 0.
    pub(crate) fn padded(batch: usize, time: usize) -> Self {
        Self {
            prefix: 0,
            segments: vec![time; batch],
        }
    }

    pub(crate) fn rows(&self) -> usize {
        self.prefix + self.segments.iter().sum::<usize>()
    }

    /// Positions the rotary tables must cover.
    pub(crate) fn positions(&self) -> usize {
        self.prefix + self.segments.iter().copied().max().unwrap_or(0)
    }

    /// The units whose queries attend: the prefix (when there is one),
    /// then each segment.
    fn units(&self) -> Vec<Unit> {
        let mut units = Vec::with_capacity(self.segments.len() + 1);
        if self.prefix > 0 {
            units.push(Unit {
                start: 0,
                len: self.prefix,
                context: 0,
            });
        }
        let mut start = self.prefix;
        for &len in &self.segments {
            units.push(Unit {
                start,
                len,
                context: self.prefix,
            });
            start += len;
        }
        units
    }
}

/// Rows whose queries attend together. Their keys, in order, are the
/// prefix rows `0..context` then their own rows, so key `j` sits at
/// position `j`, and own row `i` (query `i`) at position `context + i`:
/// query `i` sees keys `0..=context + i`.
#[derive(Debug, Clone, Copy)]
struct Unit {
    /// First of the unit's own rows.
    start: usize,
    /// Own rows.
    len: usize,
    /// Prefix rows seen before the own rows.
    context: usize,
}

impl Unit {
    /// Keys (and values) the unit's queries see.
    fn keys(&self) -> usize {
        self.context + self.len
    }

    /// The row of key `j`.
    fn key_row(&self, j: usize) -> usize {
        if j < self.context {
            j
        } else {
            self.start + j - self.context
        }
    }
}

/// Causal grouped-query self-attention with RoPE over an
/// [`AttentionLayout`].
#[derive(Debug, Clone)]
pub(crate) struct CausalAttention {
    pub(crate) layout: AttentionLayout,
    units: Vec<Unit>,
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    /// `(positions, head_dim / 2)` rotary tables.
    pub(crate) cos: Arc<Vec<f32>>,
    pub(crate) sin: Arc<Vec<f32>>,
}

/// Per-thread buffers of one attention task, sized for its unit.
#[derive(Default)]
pub(crate) struct Scratch {
    /// Rotated keys of the task's key/value head, `(keys, head_dim)`.
    keys: Vec<f32>,
    /// Its values, `(keys, head_dim)`.
    values: Vec<f32>,
    /// Rotated queries of one head, `(len, head_dim)`.
    queries: Vec<f32>,
    /// Probabilities `(len, keys)`.
    probs: Vec<f32>,
    /// Gradient of the scores `(len, keys)` (backward only).
    d_scores: Vec<f32>,
    /// Gradient of one head's rotated queries `(len, head_dim)`.
    d_queries: Vec<f32>,
}

/// Gradients of one `(unit, key/value head)` task.
pub(crate) struct TaskGrads {
    /// `(rep, len, head_dim)`.
    queries: Vec<f32>,
    /// `(keys, head_dim)` each, in the unit's key order.
    keys: Vec<f32>,
    values: Vec<f32>,
}

impl CausalAttention {
    fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }

    fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    fn rep(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// Rotates one head's row `x` (`head_dim`) to `position` into `dst`
    /// ("rotate half" layout).
    fn rope(&self, x: &[f32], position: usize, dst: &mut [f32]) {
        let half = self.head_dim / 2;
        let (cos, sin) = (
            &self.cos[position * half..][..half],
            &self.sin[position * half..][..half],
        );
        let (lo, hi) = dst.split_at_mut(half);
        for i in 0..half {
            lo[i] = x[i] * cos[i] - x[i + half] * sin[i];
            hi[i] = x[i + half] * cos[i] + x[i] * sin[i];
        }
    }

    /// The transpose of [`CausalAttention::rope`] (the rotation by minus
    /// the angle).
    fn unrope(&self, x: &[f32], position: usize, dst: &mut [f32]) {
        let half = self.head_dim / 2;
        let (cos, sin) = (
            &self.cos[position * half..][..half],
            &self.sin[position * half..][..half],
        );
        let (lo, hi) = x.split_at(half);
        let (dlo, dhi) = dst.split_at_mut(half);
        for i in 0..half {
            dlo[i] = lo[i] * cos[i] + hi[i] * sin[i];
            dhi[i] = hi[i] * cos[i] - lo[i] * sin[i];
        }
    }

    /// The unit's rotated keys and its values of key/value head `g` into
    /// the scratch.
    fn gather_keys(&self, (k, v): (&[f32], &[f32]), unit: Unit, g: usize, s: &mut Scratch) {
        let (d, kw) = (self.head_dim, self.kv_width());
        let n = unit.keys();
        s.keys.resize(n * d, 0.0);
        s.values.resize(n * d, 0.0);
        for j in 0..n {
            let at = unit.key_row(j) * kw + g * d;
            self.rope(&k[at..][..d], j, &mut s.keys[j * d..][..d]);
            s.values[j * d..][..d].copy_from_slice(&v[at..][..d]);
        }
    }

    /// The unit's rotated queries of head `head` into the scratch.
    fn gather_queries(&self, q: &[f32], unit: Unit, head: usize, s: &mut Scratch) {
        let (d, qw) = (self.head_dim, self.q_width());
        s.queries.resize(unit.len * d, 0.0);
        for i in 0..unit.len {
            let at = (unit.start + i) * qw + head * d;
            self.rope(
                &q[at..][..d],
                unit.context + i,
                &mut s.queries[i * d..][..d],
            );
        }
    }

    /// Scores of the rotated queries against the rotated keys, then the
    /// causal softmax of each row, into `s.probs`.
    fn probabilities(&self, unit: Unit, s: &mut Scratch) {
        let (len, n, d) = (unit.len, unit.keys(), self.head_dim);
        let scale = 1.0 / (d as f32).sqrt();
        s.probs.resize(len * n, 0.0);
        matmul_into(
            &mut s.probs,
            Mat::dense(&s.queries, len, d),
            Mat::dense(&s.keys, n, d).t(),
            scale,
            false,
            Parallelism::None,
        );
        for (i, row) in s.probs.chunks_exact_mut(n).enumerate() {
            let (seen, future) = row.split_at_mut(unit.context + i + 1);
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

    /// The unit and key/value head of a task.
    fn task(&self, task: usize) -> (Unit, usize) {
        (self.units[task / self.kv_heads], task % self.kv_heads)
    }

    /// Outputs `(rep, len, head_dim)` of the query heads of one task.
    fn forward_task(
        &self,
        (q, k, v): (&[f32], &[f32], &[f32]),
        task: usize,
        s: &mut Scratch,
    ) -> Vec<f32> {
        let (unit, g) = self.task(task);
        let (len, n, d) = (unit.len, unit.keys(), self.head_dim);
        self.gather_keys((k, v), unit, g, s);
        let mut out = vec![0f32; self.rep() * len * d];
        for (r, out) in out.chunks_exact_mut(len * d).enumerate() {
            self.gather_queries(q, unit, g * self.rep() + r, s);
            self.probabilities(unit, s);
            matmul_into(
                out,
                Mat::dense(&s.probs, len, n),
                Mat::dense(&s.values, n, d),
                1.0,
                false,
                Parallelism::None,
            );
        }
        out
    }

    /// Gradients of one task's queries, keys and values.
    fn backward_task(
        &self,
        (q, k, v): (&[f32], &[f32], &[f32]),
        (out, d_out): (&[f32], &[f32]),
        task: usize,
        s: &mut Scratch,
    ) -> TaskGrads {
        let (unit, g) = self.task(task);
        let (len, n, d) = (unit.len, unit.keys(), self.head_dim);
        let qw = self.q_width();
        let scale = 1.0 / (d as f32).sqrt();
        self.gather_keys((k, v), unit, g, s);
        s.d_scores.resize(len * n, 0.0);
        s.d_queries.resize(len * d, 0.0);
        let mut grads = TaskGrads {
            queries: vec![0f32; self.rep() * len * d],
            keys: vec![0f32; n * d],
            values: vec![0f32; n * d],
        };
        let mut d_keys = vec![0f32; n * d];
        for r in 0..self.rep() {
            let head = g * self.rep() + r;
            let offset = unit.start * qw + head * d;
            self.gather_queries(q, unit, head, s);
            self.probabilities(unit, s);
            let d_o = Mat::new(d_out, offset, (len, d), (qw, 1));
            // dV += Pᵀ dO
            matmul_into(
                &mut grads.values,
                Mat::dense(&s.probs, len, n).t(),
                d_o,
                1.0,
                true,
                Parallelism::None,
            );
            // dP = dO Vᵀ, then dS = P ⊙ (dP − rowsum(dO ⊙ O)).
            matmul_into(
                &mut s.d_scores,
                d_o,
                Mat::dense(&s.values, n, d).t(),
                1.0,
                false,
                Parallelism::None,
            );
            for i in 0..len {
                let row_out = &out[offset + i * qw..][..d];
                let row_d_out = &d_out[offset + i * qw..][..d];
                let dot: f32 = row_out.iter().zip(row_d_out).map(|(a, b)| a * b).sum();
                let seen = unit.context + i + 1;
                let ds = &mut s.d_scores[i * n..(i + 1) * n];
                let p = &s.probs[i * n..(i + 1) * n];
                for j in 0..seen {
                    ds[j] = p[j] * (ds[j] - dot);
                }
                ds[seen..].fill(0.0);
            }
            // dQ = scale · dS K, dK += scale · dSᵀ Q (rotated frames).
            matmul_into(
                &mut s.d_queries,
                Mat::dense(&s.d_scores, len, n),
                Mat::dense(&s.keys, n, d),
                scale,
                false,
                Parallelism::None,
            );
            matmul_into(
                &mut d_keys,
                Mat::dense(&s.d_scores, len, n).t(),
                Mat::dense(&s.queries, len, d),
                scale,
                true,
                Parallelism::None,
            );
            let dq = &mut grads.queries[r * len * d..(r + 1) * len * d];
            for i in 0..len {
                self.unrope(
                    &s.d_queries[i * d..][..d],
                    unit.context + i,
                    &mut dq[i * d..][..d],
                );
            }
        }
        for j in 0..n {
            self.unrope(&d_keys[j * d..][..d], j, &mut grads.keys[j * d..][..d]);
        }
        grads
    }

    fn check(&self, what: &str, layout: &Layout, width: usize) -> Result<()> {
        let want = (self.layout.rows(), width);
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
        let blocks: Vec<Vec<f32>> = (0..self.units.len() * self.kv_heads)
            .into_par_iter()
            .map_init(Scratch::default, |s, task| {
                self.forward_task((q, k, v), task, s)
            })
            .collect();
        let (d, qw, rep) = (self.head_dim, self.q_width(), self.rep());
        let rows = self.layout.rows();
        let mut y = vec![0f32; rows * qw];
        for (task, heads) in blocks.iter().enumerate() {
            let (unit, g) = self.task(task);
            for (r, out) in heads.chunks_exact(unit.len * d).enumerate() {
                let head = g * rep + r;
                for (i, row) in out.chunks_exact(d).enumerate() {
                    y[(unit.start + i) * qw + head * d..][..d].copy_from_slice(row);
                }
            }
        }
        Ok((CpuStorage::F32(y), (rows, qw).into()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (d, qw, kw, rep) = (self.head_dim, self.q_width(), self.kv_width(), self.rep());
        let rows = self.layout.rows();
        let (dq, dk, dv) = with_slice(q, |qd| {
            with_slice(k, |kd| {
                with_slice(v, |vd| {
                    with_slice(res, |out| {
                        with_slice(grad, |d_out| {
                            let tasks: Vec<TaskGrads> = (0..self.units.len() * self.kv_heads)
                                .into_par_iter()
                                .map_init(Scratch::default, |s, task| {
                                    self.backward_task((qd, kd, vd), (out, d_out), task, s)
                                })
                                .collect();
                            let mut dq = vec![0f32; rows * qw];
                            let mut dk = vec![0f32; rows * kw];
                            let mut dv = vec![0f32; rows * kw];
                            for (task, grads) in tasks.iter().enumerate() {
                                let (unit, g) = self.task(task);
                                for (r, dqh) in grads.queries.chunks_exact(unit.len * d).enumerate()
                                {
                                    let head = g * rep + r;
                                    for (i, row) in dqh.chunks_exact(d).enumerate() {
                                        dq[(unit.start + i) * qw + head * d..][..d]
                                            .copy_from_slice(row);
                                    }
                                }
                                // A prefix row's key and value serve every
                                // unit: their gradients add up.
                                for j in 0..unit.keys() {
                                    let at = unit.key_row(j) * kw + g * d;
                                    let add = |dst: &mut [f32], src: &[f32]| {
                                        for (a, b) in dst.iter_mut().zip(src) {
                                            *a += b;
                                        }
                                    };
                                    add(&mut dk[at..][..d], &grads.keys[j * d..][..d]);
                                    add(&mut dv[at..][..d], &grads.values[j * d..][..d]);
                                }
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

/// Causal self-attention of rows laid out by `layout`, with RoPE applied to
/// queries and keys inside.
///
/// `q` `(rows, heads · head_dim)`, `k` and `v` `(rows, kv_heads ·
/// head_dim)`: the projections' rows. `cos`/`sin`: `(≥ positions,
/// head_dim / 2)` rotary tables. Returns `(rows, heads · head_dim)`, ready
/// for `o_proj`.
pub(crate) fn causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    layout: &AttentionLayout,
    (heads, kv_heads, head_dim): (usize, usize, usize),
    (cos, sin): (&Tensor, &Tensor),
) -> Result<Tensor> {
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) || head_dim % 2 != 0 {
        bail!("attention: {heads} heads, {kv_heads} key/value heads, head_dim {head_dim}");
    }
    if layout.segments.contains(&0) {
        bail!("attention: an empty segment in {layout:?}");
    }
    let positions = layout.positions();
    let table = |t: &Tensor| -> Result<Arc<Vec<f32>>> {
        Ok(Arc::new(
            t.narrow(0, 0, positions)?.flatten_all()?.to_vec1::<f32>()?,
        ))
    };
    let op = CausalAttention {
        units: layout.units(),
        layout: layout.clone(),
        heads,
        kv_heads,
        head_dim,
        cos: table(cos)?,
        sin: table(sin)?,
    };
    q.contiguous()?
        .apply_op3(&k.contiguous()?, &v.contiguous()?, op)
}
