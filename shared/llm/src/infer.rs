//! [`CausalLm::forward_batch`](crate::CausalLm::forward_batch): the inference forward over a ragged batch
//! of sequences, each with its own [`KvCache`] and adapter.
//!
//! Tokens of all sequences are packed into one `(tokens, hidden)` matrix
//! for every projection and MLP (the expensive part); attention runs per
//! sequence against its cache. Everything between the matmuls (RMSNorm,
//! RoPE, attention with its causal mask, SiLU, residuals) is plain Rust on
//! row-major `Vec<f32>`s, and attention runs in parallel over (sequence,
//! head) pairs: as candle ops, each of these was a dozen small tensor ops
//! per sequence and layer whose fixed costs (and candle's spinning thread
//! barrier between them) dominated a batched step.
//!
//! A dense base multiplies through [`PackedWeights`] (packed on first use,
//! q/k/v and gate/up fused into one product each; see [`crate::packed`]);
//! a GGUF-quantized base through candle as before. LoRA deltas are added
//! per adapter on its rows.

use std::sync::Arc;

use candle_core::{Device, Tensor};
use rayon::prelude::*;

use crate::cache::KvCache;
use crate::lora::LoraAdapter;
use crate::model::{route, BaseWeight, BatchItem, CausalLm, LogitsWanted, Projection, Routing};
use crate::model_error::{ModelError, Result};
use crate::packed::{InferenceWeights, PackedLayer, PackedWeights};

fn to_vec(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.flatten_all()?.to_vec1::<f32>()?)
}

/// Packs projections that read the same input, if all are dense.
fn pack(projections: &[&Projection]) -> Result<Option<PackedWeights>> {
    let mut mats = Vec::with_capacity(projections.len());
    let mut in_features = 0;
    for p in projections {
        let BaseWeight::Dense(w) = &p.weight else {
            return Ok(None);
        };
        let (out, inp) = w.dims2()?;
        in_features = inp;
        mats.push((to_vec(w)?, out));
    }
    let parts: Vec<(&[f32], usize)> = mats.iter().map(|(w, o)| (w.as_slice(), *o)).collect();
    Ok(Some(PackedWeights::new(&parts, in_features)))
}

impl InferenceWeights {
    fn new(model: &CausalLm) -> Result<Self> {
        let mut layers = Some(Vec::with_capacity(model.blocks.len()));
        for b in &model.blocks {
            match (pack_block(b)?, layers.as_mut()) {
                (Some(layer), Some(l)) => l.push(layer),
                _ => layers = None,
            }
        }
        let lm_head = match layers {
            Some(_) => pack(&[&model.lm_head])?,
            None => None,
        };
        Self::around(model, layers, lm_head)
    }

    /// The packed `layers` and `lm_head` with plain copies of the rest.
    fn around(
        model: &CausalLm,
        layers: Option<Vec<PackedLayer>>,
        lm_head: Option<PackedWeights>,
    ) -> Result<Self> {
        Ok(Self {
            input_norms: model
                .blocks
                .iter()
                .map(|b| to_vec(&b.input_norm))
                .collect::<Result<_>>()?,
            post_attention_norms: model
                .blocks
                .iter()
                .map(|b| to_vec(&b.post_attention_norm))
                .collect::<Result<_>>()?,
            qk_norms: model
                .blocks
                .iter()
                .map(|b| {
                    b.qk_norm
                        .as_ref()
                        .map(|n| Ok((to_vec(&n.q)?, to_vec(&n.k)?)))
                        .transpose()
                })
                .collect::<Result<_>>()?,
            final_norm: to_vec(&model.final_norm)?,
            rope_cos: to_vec(&model.rope_cos)?,
            rope_sin: to_vec(&model.rope_sin)?,
            layers,
            lm_head,
        })
    }
}

/// One block's projections packed, if all are dense.
fn pack_block(b: &crate::model::Block) -> Result<Option<PackedLayer>> {
    Ok(
        match (
            pack(&[&b.q_proj, &b.k_proj, &b.v_proj])?,
            pack(&[&b.o_proj])?,
            pack(&[&b.gate_proj, &b.up_proj])?,
            pack(&[&b.down_proj])?,
        ) {
            (Some(qkv), Some(o), Some(gate_up), Some(down)) => Some(PackedLayer {
                qkv,
                o,
                gate_up,
                down,
            }),
            _ => None,
        },
    )
}

/// Marks a block's projections as held in the packed copy only.
fn release_block(b: &mut crate::model::Block) {
    for p in [
        &mut b.q_proj,
        &mut b.k_proj,
        &mut b.v_proj,
        &mut b.o_proj,
        &mut b.gate_proj,
        &mut b.up_proj,
        &mut b.down_proj,
    ] {
        p.weight = BaseWeight::PackedOnly;
    }
}

/// Returns freed heap pages to the system: the released matrices were
/// large, and glibc keeps what it freed in its arenas otherwise.
fn return_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks glibc's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// RMSNorm of each `width`-wide row, as candle's fused kernel computes it.
fn rms_norm_rows(x: &[f32], width: usize, weight: &[f32], eps: f32) -> Vec<f32> {
    let mut out = x.to_vec();
    rms_norm_in_place(&mut out, width, weight, eps);
    out
}

/// [`rms_norm_rows`] in place (Qwen3's per-head norm of queries and keys).
fn rms_norm_in_place(x: &mut [f32], width: usize, weight: &[f32], eps: f32) {
    for row in x.chunks_exact_mut(width) {
        let sum2: f32 = row.iter().map(|v| v * v).sum();
        let m = (sum2 / width as f32 + eps).sqrt();
        for (v, a) in row.iter_mut().zip(weight) {
            *v = *v / m * *a;
        }
    }
}

/// Rotates each `head_dim` chunk of `x` in place ("rotate half" layout,
/// as [`candle_nn::rotary_emb::rope`]).
fn rope_in_place(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = head_dim / 2;
    for head in x.chunks_exact_mut(head_dim) {
        let (x1, x2) = head.split_at_mut(half);
        for i in 0..half {
            let (a, b) = (x1[i], x2[i]);
            x1[i] = a * cos[i] - b * sin[i];
            x2[i] = b * cos[i] + a * sin[i];
        }
    }
}

/// Dot product with eight independent accumulators, so it vectorizes.
#[inline(always)]
fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            lanes[i] += x[i] * y[i];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// `out += w * v`.
#[inline(always)]
fn axpy_portable(out: &mut [f32], w: f32, v: &[f32]) {
    for (o, &x) in out.iter_mut().zip(v) {
        *o += w * x;
    }
}

/// [`attend_head_portable`] compiled for AVX2 + FMA (the crate's baseline
/// target has neither, and attention is a fifth of a prefill).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_head_avx2(
    cache: &KvCache,
    layer: usize,
    q: &[f32],
    offset: usize,
    t: usize,
    head: usize,
    shape: Heads,
) -> Vec<f32> {
    attend_head_portable(cache, layer, q, offset, t, head, shape)
}

/// The shapes attention needs.
#[derive(Clone, Copy)]
struct Heads {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl Heads {
    fn rep(&self) -> usize {
        self.heads / self.kv_heads
    }
}

/// One query head of one sequence's `t` new tokens (at positions
/// `offset..offset + t`) attending causally over its cache, which already
/// holds those tokens' keys and values. `q`: the sequence's roped queries,
/// `t` rows of `heads * head_dim`. Returns `t` rows of `head_dim`.
#[inline(always)]
fn attend_head_portable(
    cache: &KvCache,
    layer: usize,
    q: &[f32],
    offset: usize,
    t: usize,
    head: usize,
    shape: Heads,
) -> Vec<f32> {
    let hd = shape.head_dim;
    let q_width = shape.heads * hd;
    let group = head / shape.rep();
    let row = cache.row();
    let (keys, values) = cache.layer(layer);
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0f32; t * hd];
    let mut scores = vec![0f32; offset + t];
    for i in 0..t {
        let qh = &q[i * q_width + head * hd..i * q_width + (head + 1) * hd];
        let visible = offset + i + 1;
        let scores = &mut scores[..visible];
        let mut max = f32::NEG_INFINITY;
        for (p, score) in scores.iter_mut().enumerate() {
            let start = p * row + group * hd;
            *score = dot_portable(qh, &keys[start..start + hd]) * scale;
            max = max.max(*score);
        }
        let mut sum = 0f32;
        for score in scores.iter_mut() {
            *score = (*score - max).exp();
            sum += *score;
        }
        let oh = &mut out[i * hd..(i + 1) * hd];
        for (p, &w) in scores.iter().enumerate() {
            let start = p * row + group * hd;
            axpy_portable(oh, w / sum, &values[start..start + hd]);
        }
    }
    out
}

/// [`attend_head_portable`] with the widest vector instructions present.
fn attend_head(
    cache: &KvCache,
    layer: usize,
    q: &[f32],
    offset: usize,
    t: usize,
    head: usize,
    shape: Heads,
) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    if crate::packed::has_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked at run time).
        return unsafe { attend_head_avx2(cache, layer, q, offset, t, head, shape) };
    }
    attend_head_portable(cache, layer, q, offset, t, head, shape)
}

/// `y[rows, offset..offset + out] += delta` for a `(rows, out)` delta.
fn add_columns(
    y: &mut [f32],
    width: usize,
    offset: usize,
    delta: &[f32],
    out: usize,
    rows: &[usize],
) {
    for (r, d) in rows.iter().zip(delta.chunks_exact(out)) {
        for (a, b) in y[r * width + offset..r * width + offset + out]
            .iter_mut()
            .zip(d)
        {
            *a += b;
        }
    }
}

impl CausalLm {
    /// The inference-side copies, built on first use.
    fn inference_weights(&self) -> Result<Arc<InferenceWeights>> {
        if let Some(w) = self.inference.get() {
            return Ok(w.clone());
        }
        let built = Arc::new(InferenceWeights::new(self)?);
        Ok(self.inference.get_or_init(|| built).clone())
    }

    /// Packs the weights for [`CausalLm::forward_batch`] now rather than
    /// in the first call (a server calls this once after loading). A dense
    /// base then holds a second, packed copy of every projection (the
    /// model's size again, plus the output head if tied to the embedding).
    pub fn prepare_inference(&self) -> Result<()> {
        if matches!(self.backend, crate::backend::Backend::Candle { .. }) {
            // The candle backend multiplies the placed weights as they are.
            return Ok(());
        }
        self.inference_weights().map(|_| ())
    }

    /// Packs the weights (as [`CausalLm::prepare_inference`]) and releases
    /// the f32 matrices packing copied, so a dense base is held once, not
    /// twice: a server that only runs [`CausalLm::forward_batch`] on the
    /// engine needs nothing else of them. Embeddings, norms and biases
    /// stay. Afterwards the candle paths (training, `to_backend`) refuse
    /// the model by name. Nothing changes on the candle backend or for a
    /// quantized base, which are not packed.
    pub fn keep_packed_only(&mut self) -> Result<()> {
        if matches!(self.backend, crate::backend::Backend::Candle { .. }) {
            return Ok(());
        }
        if self.inference.get().is_some() || self.is_quantized() || self.is_packed_only() {
            // Already packed (both copies were made), or nothing to pack.
            let weights = self.inference_weights()?;
            if weights.layers.is_some() {
                self.blocks.iter_mut().for_each(release_block);
                if weights.lm_head.is_some() {
                    self.lm_head.weight = BaseWeight::PackedOnly;
                }
            }
        } else {
            // Layer by layer, each f32 copy released once packed: at most
            // one layer is held twice.
            let mut layers = Vec::with_capacity(self.blocks.len());
            for b in &mut self.blocks {
                layers.push(pack_block(b)?.expect("a dense base packs"));
                release_block(b);
            }
            let lm_head = pack(&[&self.lm_head])?;
            self.lm_head.weight = BaseWeight::PackedOnly;
            let weights = InferenceWeights::around(self, Some(layers), lm_head)?;
            self.inference = std::sync::OnceLock::from(Arc::new(weights));
        }
        return_freed_memory();
        Ok(())
    }

    /// `x` `(rows, in)` through the projections `parts` (which read the
    /// same input): `(rows, width)` with part `i` at column `offsets[i]`,
    /// biases and LoRA deltas added.
    fn project(
        &self,
        parts: &[&Projection],
        packed: Option<&PackedWeights>,
        x: &[f32],
        rows: usize,
        layer: usize,
        routing: &Routing<'_>,
    ) -> Result<(Vec<f32>, usize, Vec<usize>)> {
        let device = Device::Cpu;
        let in_features = x.len() / rows.max(1);
        let mut x_tensor = None;
        let mut tensor = |x: &[f32]| -> Result<Tensor> {
            if x_tensor.is_none() {
                x_tensor = Some(Tensor::from_slice(x, (rows, in_features), &device)?);
            }
            Ok(x_tensor.clone().expect("set"))
        };
        let (mut y, width, offsets, outs) = match packed {
            Some(p) => {
                let offsets: Vec<usize> = (0..parts.len()).map(|i| p.offset(i)).collect();
                let outs: Vec<usize> = (0..parts.len()).map(|i| p.out(i)).collect();
                (p.matmul(x, rows), p.width(), offsets, outs)
            }
            None => {
                let mut blocks = Vec::with_capacity(parts.len());
                for part in parts {
                    blocks.push(to_vec(&part.forward_base_no_bias(&tensor(x)?)?)?);
                }
                let outs: Vec<usize> = blocks.iter().map(|b| b.len() / rows.max(1)).collect();
                let width: usize = outs.iter().sum();
                let offsets: Vec<usize> = outs
                    .iter()
                    .scan(0, |acc, &o| {
                        let at = *acc;
                        *acc += o;
                        Some(at)
                    })
                    .collect();
                let mut y = vec![0f32; rows * width];
                for ((b, &o), &off) in blocks.iter().zip(&outs).zip(&offsets) {
                    for r in 0..rows {
                        y[r * width + off..r * width + off + o]
                            .copy_from_slice(&b[r * o..(r + 1) * o]);
                    }
                }
                (y, width, offsets, outs)
            }
        };
        let all_rows: Vec<usize> = (0..rows).collect();
        for ((part, &off), &out) in parts.iter().zip(&offsets).zip(&outs) {
            if let Some(b) = &part.bias {
                let b = to_vec(b)?;
                add_columns(&mut y, width, off, &b.repeat(rows), out, &all_rows);
            }
            match routing {
                Routing::Base => {}
                Routing::All(adapter) => {
                    if let Some(delta) = adapter.delta(layer, part.target, &tensor(x)?)? {
                        add_columns(&mut y, width, off, &to_vec(&delta)?, out, &all_rows);
                    }
                }
                Routing::Groups(groups) => {
                    for (adapter, selected) in groups {
                        if adapter.weights(layer, part.target).is_none() {
                            continue;
                        }
                        let xs = tensor(x)?.index_select(selected, 0)?;
                        if let Some(delta) = adapter.delta(layer, part.target, &xs)? {
                            let rows: Vec<usize> = selected
                                .to_vec1::<u32>()?
                                .into_iter()
                                .map(|r| r as usize)
                                .collect();
                            add_columns(&mut y, width, off, &to_vec(&delta)?, out, &rows);
                        }
                    }
                }
            }
        }
        Ok((y, width, offsets))
    }

    /// Advances every sequence of `items` by its tokens, appending to its
    /// cache, and returns logits (see [`LogitsWanted`]).
    ///
    /// Sequences may have any cache lengths and token counts and any mix
    /// of adapters: a sequence joins a running batch just by being listed
    /// (its prompt is prefilled in the same call) and leaves by not being
    /// listed. On error no cache is advanced.
    pub fn forward_batch(
        &self,
        items: &mut [BatchItem<'_>],
        wanted: LogitsWanted,
    ) -> Result<Tensor> {
        if items.is_empty() {
            return Err(ModelError::BadInput("empty batch".into()));
        }
        if matches!(self.backend, crate::backend::Backend::Candle { .. }) {
            return self.forward_batch_candle(items, wanted);
        }
        let device = self.rope_cos.device().clone();
        let mut spans = Vec::with_capacity(items.len());
        let mut ids = Vec::new();
        for item in items.iter() {
            if item.tokens.is_empty() {
                return Err(ModelError::BadInput("a batch item has no tokens".into()));
            }
            self.check_tokens(item.tokens)?;
            item.cache.check_shape(&self.config, None)?;
            let end = item.cache.len() + item.tokens.len();
            if end > self.config.max_position_embeddings {
                return Err(ModelError::ContextOverflow {
                    position: end - 1,
                    limit: self.config.max_position_embeddings,
                });
            }
            spans.push((ids.len(), item.tokens.len()));
            ids.extend_from_slice(item.tokens);
        }
        let adapters: Vec<Option<&LoraAdapter>> = items.iter().map(|i| i.adapter).collect();
        for adapter in &adapters {
            self.check_adapter(*adapter)?;
        }
        let weights = self.inference_weights()?;
        let routing = route(&adapters, &spans, &device)?;
        let total = ids.len();
        let ids = Tensor::from_vec(ids, total, &device)?;
        let mut x = to_vec(&self.embed.lookup(&ids)?)?;

        let cfg = &self.config;
        let shape = Heads {
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
        };
        let (hidden, hd) = (cfg.hidden_size, cfg.head_dim);
        let half = hd / 2;
        let (q_width, kv_width) = (shape.heads * hd, shape.kv_heads * hd);
        let inter = cfg.intermediate_size;
        let eps = cfg.rms_norm_eps as f32;
        let offsets: Vec<usize> = items.iter().map(|i| i.cache.len()).collect();
        // (sequence, query head) pairs, the unit of parallel attention.
        let pairs: Vec<(usize, usize)> = (0..items.len())
            .flat_map(|s| (0..shape.heads).map(move |h| (s, h)))
            .collect();
        for (layer, block) in self.blocks.iter().enumerate() {
            let packed = weights.layers.as_ref().map(|l| &l[layer]);
            let h = rms_norm_rows(&x, hidden, &weights.input_norms[layer], eps);
            let (qkv, width, at) = self.project(
                &[&block.q_proj, &block.k_proj, &block.v_proj],
                packed.map(|p| &p.qkv),
                &h,
                total,
                layer,
                &routing,
            )?;
            // RoPE on each sequence's new queries and keys, keys and values
            // into its cache.
            let queries: Vec<Vec<f32>> = items
                .par_iter_mut()
                .zip(spans.par_iter())
                .zip(offsets.par_iter())
                .map(|((item, &(start, t)), &offset)| {
                    let mut q = Vec::with_capacity(t * q_width);
                    let mut k = Vec::with_capacity(t * kv_width);
                    let mut v = Vec::with_capacity(t * kv_width);
                    for i in 0..t {
                        let r = &qkv[(start + i) * width..(start + i + 1) * width];
                        let p = offset + i;
                        let (cos, sin) = (
                            &weights.rope_cos[p * half..(p + 1) * half],
                            &weights.rope_sin[p * half..(p + 1) * half],
                        );
                        let (q0, k0) = (q.len(), k.len());
                        q.extend_from_slice(&r[at[0]..at[0] + q_width]);
                        k.extend_from_slice(&r[at[1]..at[1] + kv_width]);
                        v.extend_from_slice(&r[at[2]..at[2] + kv_width]);
                        if let Some((q_norm, k_norm)) = &weights.qk_norms[layer] {
                            rms_norm_in_place(&mut q[q0..], hd, q_norm, eps);
                            rms_norm_in_place(&mut k[k0..], hd, k_norm, eps);
                        }
                        rope_in_place(&mut q[q0..], hd, cos, sin);
                        rope_in_place(&mut k[k0..], hd, cos, sin);
                    }
                    item.cache.append_rows(layer, &k, &v);
                    q
                })
                .collect();
            let shared: &[BatchItem<'_>] = items;
            let heads_out: Vec<Vec<f32>> = pairs
                .par_iter()
                .map(|&(s, head)| {
                    attend_head(
                        shared[s].cache,
                        layer,
                        &queries[s],
                        offsets[s],
                        spans[s].1,
                        head,
                        shape,
                    )
                })
                .collect();
            let mut attn = vec![0f32; total * q_width];
            for (&(s, head), out) in pairs.iter().zip(&heads_out) {
                let (start, t) = spans[s];
                for i in 0..t {
                    attn[(start + i) * q_width + head * hd
                        ..(start + i) * q_width + (head + 1) * hd]
                        .copy_from_slice(&out[i * hd..(i + 1) * hd]);
                }
            }
            let (o, width, _) = self.project(
                &[&block.o_proj],
                packed.map(|p| &p.o),
                &attn,
                total,
                layer,
                &routing,
            )?;
            for (xr, or) in x.chunks_exact_mut(hidden).zip(o.chunks_exact(width)) {
                for (a, b) in xr.iter_mut().zip(or) {
                    *a += b;
                }
            }
            let h = rms_norm_rows(&x, hidden, &weights.post_attention_norms[layer], eps);
            let (gu, width, at) = self.project(
                &[&block.gate_proj, &block.up_proj],
                packed.map(|p| &p.gate_up),
                &h,
                total,
                layer,
                &routing,
            )?;
            let mut act = vec![0f32; total * inter];
            for (ar, r) in act.chunks_exact_mut(inter).zip(gu.chunks_exact(width)) {
                let (g, u) = (&r[at[0]..at[0] + inter], &r[at[1]..at[1] + inter]);
                for ((a, &g), &u) in ar.iter_mut().zip(g).zip(u) {
                    *a = g / (1.0 + (-g).exp()) * u;
                }
            }
            let (d, width, _) = self.project(
                &[&block.down_proj],
                packed.map(|p| &p.down),
                &act,
                total,
                layer,
                &routing,
            )?;
            for (xr, dr) in x.chunks_exact_mut(hidden).zip(d.chunks_exact(width)) {
                for (a, b) in xr.iter_mut().zip(dr) {
                    *a += b;
                }
            }
        }
        for (item, &(_, t)) in items.iter_mut().zip(&spans) {
            item.cache.advance(t);
        }
        let x = match wanted {
            LogitsWanted::All => x,
            LogitsWanted::Last => spans
                .iter()
                .flat_map(|&(s, t)| x[(s + t - 1) * hidden..(s + t) * hidden].iter().copied())
                .collect(),
        };
        let rows = x.len() / hidden;
        let x = rms_norm_rows(&x, hidden, &weights.final_norm, eps);
        let (logits, width, _) = self.project(
            &[&self.lm_head],
            weights.lm_head.as_ref(),
            &x,
            rows,
            0,
            &Routing::Base,
        )?;
        let vocab = cfg.vocab_size;
        let logits = if width == vocab {
            logits
        } else {
            logits
                .chunks_exact(width)
                .flat_map(|r| r[..vocab].iter().copied())
                .collect()
        };
        Ok(Tensor::from_vec(logits, (rows, vocab), &device)?)
    }
}
