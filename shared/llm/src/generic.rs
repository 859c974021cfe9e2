//! The candle backend's inference forward ([`crate::Backend::Candle`]):
//! [`CausalLm::forward_batch`] built from candle tensor ops only, so it
//! runs on any device candle supports (CPU, CUDA) in f32, bf16 or f16.
//!
//! Same contract as the CPU engine's forward ([`crate::infer`]): any
//! number of sequences, each with its own cache, adapter and number of new
//! tokens, packed into one `(tokens, hidden)` matrix for every projection
//! and MLP (one matmul each for the whole batch, adapters applied to their
//! rows). Keys and values live in the model's paged pool
//! ([`crate::KvPool`]): each step writes every new row's with one scatter
//! per layer, attends for all one-token decodes in one batched product
//! over slots gathered from the pool, and for each prefill on its own
//! (`AttentionPlan`). On error no cache is advanced.
//!
//! Precision: weights and matmuls in the backend's dtype; the residual
//! stream, RMSNorm, RoPE, the attention softmax and the logits in f32 (so
//! bf16 loses only what its matmuls lose).
//!
//! Why not `candle-transformers`' Qwen2/Llama modules: they keep one KV
//! cache per model (a whole batch shares one length, padded), apply no
//! per-row LoRA, and cannot mix prefills and decodes of different lengths
//! in one step, which continuous batching needs. The ops used here (matmul,
//! `index_select`/`index_add`, `scatter_set`, `slice_set`, fused RMSNorm,
//! RoPE and softmax, elementwise ops) all have CUDA kernels in candle; the
//! fused ones stand in for the composed ops of the training forward (which
//! needs their backward, which candle's fused kernels lack), one launch
//! each instead of several, and the unit tests below hold them to the
//! composed ones. A fused
//! paged-attention kernel (vLLM's) would read the blocks in place instead
//! of gathering them; candle has none, and the gather costs one copy of
//! the keys and values read per layer, not a kernel per sequence.

use candle_core::{DType, Device, Tensor};

use crate::backend::Backend;
use crate::lora::LoraAdapter;
use crate::model::{
    causal_mask, route, BaseWeight, BatchItem, CausalLm, Embedding, LogitsWanted, Projection,
    Routing,
};
use crate::model_error::{ModelError, Result};

/// Grouped-query attention of one sequence, softmax in f32. `q`:
/// `(kv_heads, rep * t, head_dim)`, `k`, `v`: `(kv_heads, len, head_dim)`,
/// causal `mask`: `(t, len)` f32.
fn attend(q: &Tensor, k: &Tensor, v: &Tensor, rep: usize, mask: &Tensor) -> Result<Tensor> {
    let (groups, rows, head_dim) = q.dims3()?;
    let len = k.dim(1)?;
    let scores = q
        .matmul(&k.t()?)?
        .to_dtype(DType::F32)?
        .affine(1.0 / (head_dim as f64).sqrt(), 0.0)?;
    let scores = scores
        .reshape((groups, rep, rows / rep, len))?
        .broadcast_add(mask)?
        .reshape((groups, rows, len))?;
    let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(v.dtype())?;
    Ok(probs.matmul(&v.contiguous()?)?)
}

/// How one step's attention reads the pool: every one-token decode of the
/// step in one batched product (its queries against every decoding
/// sequence's keys, gathered with one `index_select` and padded to the
/// longest with the pool's zero block, masked), and each longer item (a
/// prefill) on its own with a causal mask. A decode step of B sequences is
/// thus about fifteen kernels per layer, whatever B. Built once per step:
/// every layer reads the same slots.
struct AttentionPlan {
    decode: Option<DecodeGroup>,
    prefills: Vec<PrefillItem>,
    /// Row of the concatenated outputs (decodes, then prefills) for each
    /// row of the batch, unless that is already the batch's order.
    order: Option<Tensor>,
    kv_heads: usize,
    rep: usize,
    head_dim: usize,
}

/// The step's one-token decodes.
struct DecodeGroup {
    /// Their rows in the batch (`None`: all rows, in order).
    rows: Option<Tensor>,
    count: usize,
    /// Longest sequence, new token included.
    longest: usize,
    /// `(count * longest)` pool slots, each sequence's then padding.
    gather: Tensor,
    /// `(1, count, 1, longest)`: 0 for a sequence's positions, -inf for
    /// its padding.
    mask: Tensor,
}

/// One item of several new tokens.
struct PrefillItem {
    start: usize,
    len: usize,
    /// Pool slots of all its positions, new ones included.
    gather: Tensor,
    /// Causal, `(len, positions)`.
    mask: Tensor,
}

impl AttentionPlan {
    fn new(
        items: &[BatchItem<'_>],
        spans: &[(usize, usize)],
        cfg: &crate::config::ModelConfig,
        device: &Device,
    ) -> Result<Self> {
        let mut decodes = Vec::new();
        let mut prefills = Vec::new();
        for (item, &(start, len)) in items.iter().zip(spans) {
            let positions = item.cache.len() + len;
            if len == 1 {
                decodes.push((start, positions, item));
            } else {
                let slots: Vec<u32> = item.cache.slots(positions).collect();
                prefills.push(PrefillItem {
                    start,
                    len,
                    gather: Tensor::from_vec(slots, positions, device)?,
                    mask: causal_mask(len, item.cache.len(), device)?,
                });
            }
        }
        let decode = if decodes.is_empty() {
            None
        } else {
            let count = decodes.len();
            let longest = decodes.iter().map(|d| d.1).max().expect("non-empty");
            let mut gather = Vec::with_capacity(count * longest);
            let mut mask = Vec::with_capacity(count * longest);
            for &(_, positions, item) in &decodes {
                gather.extend(item.cache.slots(positions));
                // Slot 0: the pool's zero block.
                gather.extend(std::iter::repeat_n(0, longest - positions));
                mask.extend(std::iter::repeat_n(0f32, positions));
                mask.extend(std::iter::repeat_n(f32::NEG_INFINITY, longest - positions));
            }
            let in_order = decodes.iter().enumerate().all(|(i, d)| d.0 == i)
                && count == spans.iter().map(|s| s.1).sum::<usize>();
            let rows = (!in_order)
                .then(|| {
                    let rows: Vec<u32> = decodes.iter().map(|d| d.0 as u32).collect();
                    Tensor::from_vec(rows, count, device)
                })
                .transpose()?;
            Some(DecodeGroup {
                rows,
                count,
                longest,
                gather: Tensor::from_vec(gather, count * longest, device)?,
                mask: Tensor::from_vec(mask, (1, count, 1, longest), device)?,
            })
        };
        // Outputs come decodes first, then prefills; put them back.
        let mut grouped: Vec<u32> = decodes.iter().map(|d| d.0 as u32).collect();
        for p in &prefills {
            grouped.extend((p.start..p.start + p.len).map(|r| r as u32));
        }
        let order = if grouped.iter().enumerate().all(|(i, &r)| r as usize == i) {
            None
        } else {
            let mut order = vec![0u32; grouped.len()];
            for (at, &row) in grouped.iter().enumerate() {
                order[row as usize] = at as u32;
            }
            let n = order.len();
            Some(Tensor::from_vec(order, n, device)?)
        };
        Ok(Self {
            decode,
            prefills,
            order,
            kv_heads: cfg.num_key_value_heads,
            rep: cfg.kv_group_size(),
            head_dim: cfg.head_dim,
        })
    }

    /// The attention output `(rows, heads * head_dim)` of queries `q`
    /// `(rows, heads, head_dim)` against the pool's `keys` and `values`
    /// of one layer (`(kv_heads, slots, head_dim)`, this step's rows
    /// already written).
    fn attend(&self, q: &Tensor, keys: &Tensor, values: &Tensor) -> Result<Tensor> {
        let (kv, rep, hd) = (self.kv_heads, self.rep, self.head_dim);
        let heads = kv * rep;
        let mut outs = Vec::with_capacity(1 + self.prefills.len());
        if let Some(d) = &self.decode {
            let (n, longest) = (d.count, d.longest);
            let q = match &d.rows {
                Some(rows) => q.index_select(rows, 0)?,
                None => q.clone(),
            };
            // Each key/value head with its `rep` query heads: (kv, n, rep, hd).
            let q = q.reshape((n, kv, rep, hd))?.transpose(0, 1)?.contiguous()?;
            let k = keys
                .index_select(&d.gather, 1)?
                .reshape((kv, n, longest, hd))?;
            let v = values
                .index_select(&d.gather, 1)?
                .reshape((kv, n, longest, hd))?;
            let scores = q
                .matmul(&k.t()?)?
                .to_dtype(DType::F32)?
                .affine(1.0 / (hd as f64).sqrt(), 0.0)?
                .broadcast_add(&d.mask)?;
            let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(v.dtype())?;
            outs.push(
                probs
                    .matmul(&v)?
                    .transpose(0, 1)?
                    .reshape((n, heads * hd))?,
            );
        }
        for p in &self.prefills {
            // (kv, rep * t, hd): head g * rep + r reads key/value head g.
            let q = q
                .narrow(0, p.start, p.len)?
                .transpose(0, 1)?
                .contiguous()?
                .reshape((kv, rep * p.len, hd))?;
            let k = keys.index_select(&p.gather, 1)?;
            let v = values.index_select(&p.gather, 1)?;
            let out = attend(&q, &k, &v, rep, &p.mask)?;
            outs.push(
                out.reshape((heads, p.len, hd))?
                    .transpose(0, 1)?
                    .reshape((p.len, heads * hd))?,
            );
        }
        let out = if outs.len() == 1 {
            outs.pop().expect("one")
        } else {
            Tensor::cat(&outs, 0)?
        };
        Ok(match &self.order {
            Some(order) => out.index_select(order, 0)?,
            None => out,
        })
    }
}

/// RoPE of packed rows `x` `(rows, heads, head_dim)`, row `r` turned by
/// row `r` of `cos` and `sin` `(rows, head_dim / 2)` ("rotate half"
/// layout): candle's fused kernel (`rope_thd`, one launch), where
/// [`crate::model::rope`] composes about ten elementwise ops and copies.
fn rope_rows(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let turned = candle_nn::rotary_emb::rope_thd(&x.unsqueeze(0)?.contiguous()?, cos, sin)?;
    Ok(turned.squeeze(0)?)
}

/// RMSNorm of f32 rows with an f32 weight (candle's fused kernel).
fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    Ok(candle_nn::ops::rms_norm(
        &x.contiguous()?,
        weight,
        eps as f32,
    )?)
}

impl CausalLm {
    /// [`CausalLm::forward_batch`] on the candle backend (see the module docs).
    pub(crate) fn forward_batch_candle(
        &self,
        items: &mut [BatchItem<'_>],
        wanted: LogitsWanted,
    ) -> Result<Tensor> {
        let Backend::Candle { device, dtype } = &self.backend else {
            unreachable!("called for the candle backend only");
        };
        let dtype = *dtype;
        let cfg = &self.config;
        let pool = self
            .kv_pool
            .as_ref()
            .expect("a model on the candle backend has a pool");
        let mut spans = Vec::with_capacity(items.len());
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        for item in items.iter() {
            if item.tokens.is_empty() {
                return Err(ModelError::BadInput("a batch item has no tokens".into()));
            }
            self.check_tokens(item.tokens)?;
            item.cache.check_shape(cfg, Some(pool))?;
            let (offset, t) = (item.cache.len(), item.tokens.len());
            if offset + t > cfg.max_position_embeddings {
                return Err(ModelError::ContextOverflow {
                    position: offset + t - 1,
                    limit: cfg.max_position_embeddings,
                });
            }
            spans.push((ids.len(), t));
            ids.extend_from_slice(item.tokens);
            positions.extend((offset..offset + t).map(|p| p as u32));
        }
        let adapters: Vec<Option<&LoraAdapter>> = items.iter().map(|i| i.adapter).collect();
        for adapter in &adapters {
            self.check_adapter(*adapter)?;
        }
        let routing = route(&adapters, &spans, device)?;
        let total = ids.len();
        let ids = Tensor::from_vec(ids, total, device)?;
        let positions = Tensor::from_vec(positions, total, device)?;
        // Each row's rotary angles, `(total, head_dim / 2)`.
        let cos = self.rope_cos.index_select(&positions, 0)?;
        let sin = self.rope_sin.index_select(&positions, 0)?;
        let (heads, kv_heads, hd) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let eps = cfg.rms_norm_eps;
        let mut state = pool.lock();
        // Room for the new positions in every cache (shared blocks copied
        // first), then where each new row's keys and values go.
        let mut copies = (Vec::new(), Vec::new());
        let mut write_slots = Vec::with_capacity(total);
        for item in items.iter_mut() {
            write_slots.extend(item.cache.reserve_slots(
                &mut state,
                item.tokens.len(),
                &mut copies,
            )?);
        }
        pool.copy_on_write(&state, &copies)?;
        let write_index = pool.scatter_index(write_slots)?;
        let plan = AttentionPlan::new(items, &spans, cfg, device)?;

        let mut x = self.embed.lookup(&ids)?.to_dtype(DType::F32)?;
        for (layer, block) in self.blocks.iter().enumerate() {
            let h = rms_norm(&x, &block.input_norm, eps)?.to_dtype(dtype)?;
            // (Qwen3: each head's RMSNorm, then) RoPE, in f32.
            let turn = |t: Tensor, n: usize, norm: Option<&Tensor>| -> Result<Tensor> {
                let t = t.to_dtype(DType::F32)?.reshape((total, n, hd))?;
                let t = match norm {
                    Some(weight) => rms_norm(&t, weight, eps)?,
                    None => t,
                };
                Ok(rope_rows(&t, &cos, &sin)?.to_dtype(dtype)?)
            };
            let qk_norm = block.qk_norm.as_ref();
            let q = turn(
                block.q_proj.forward(&h, layer, &routing)?,
                heads,
                qk_norm.map(|n| &n.q),
            )?;
            let k = turn(
                block.k_proj.forward(&h, layer, &routing)?,
                kv_heads,
                qk_norm.map(|n| &n.k),
            )?;
            let v = block
                .v_proj
                .forward(&h, layer, &routing)?
                .reshape((total, kv_heads, hd))?;
            let (pool_keys, pool_values) = state.layer(layer);
            // Every new row's keys and values into its slot: (kv_heads, total, hd).
            pool_keys.scatter_set(&write_index, &k.transpose(0, 1)?.contiguous()?, 1)?;
            pool_values.scatter_set(&write_index, &v.transpose(0, 1)?.contiguous()?, 1)?;
            let attn = plan.attend(&q, pool_keys, pool_values)?;
            x = (x + block
                .o_proj
                .forward(&attn, layer, &routing)?
                .to_dtype(DType::F32)?)?;
            let h = rms_norm(&x, &block.post_attention_norm, eps)?.to_dtype(dtype)?;
            x = (x + self.mlp(block, &h, layer, &routing)?.to_dtype(DType::F32)?)?;
        }
        drop(state);
        for (item, &(_, t)) in items.iter_mut().zip(&spans) {
            item.cache.advance(t);
        }
        let x = match wanted {
            LogitsWanted::All => x,
            LogitsWanted::Last => {
                let last: Vec<u32> = spans.iter().map(|&(s, t)| (s + t - 1) as u32).collect();
                let n = last.len();
                x.index_select(&Tensor::from_vec(last, n, device)?, 0)?
            }
        };
        let x = rms_norm(&x, &self.final_norm, eps)?.to_dtype(dtype)?;
        Ok(self
            .lm_head
            .forward(&x, 0, &Routing::Base)?
            .to_dtype(DType::F32)?)
    }
}

impl CausalLm {
    /// The backend computing [`CausalLm::forward_batch`].
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// The device the model's weights are on (inputs of the training
    /// forward may come from anywhere; logits come back on it).
    pub fn device(&self) -> &Device {
        self.rope_cos.device()
    }

    /// This model on `backend`: for [`Backend::Candle`] every weight is
    /// copied to the device in the dtype (GGUF-quantized weights are
    /// dequantized first; norms and rotary tables stay f32, as the forward
    /// computes them in f32; a head tied to the embedding stays one
    /// tensor). Inference and training then both run on the device.
    pub fn to_backend(mut self, backend: Backend) -> Result<Self> {
        if let Backend::Candle { device, dtype } = &backend {
            let place = |t: &candle_core::Tensor| -> Result<candle_core::Tensor> {
                Ok(t.to_device(device)?.to_dtype(*dtype)?)
            };
            let place_f32 = |t: &candle_core::Tensor| -> Result<candle_core::Tensor> {
                Ok(t.to_device(device)?.to_dtype(DType::F32)?)
            };
            let project = |p: &Projection| -> Result<Projection> {
                let dense = match &p.weight {
                    BaseWeight::Dense(w) => w.clone(),
                    BaseWeight::Quantized(q) => q.dequantize(&Device::Cpu)?,
                    BaseWeight::QMatMul(_) => {
                        return Err(ModelError::BadInput(
                            "llm.backend: candle takes a dense or dequantized base \
                             (llm.gguf_base: dequantized or quantized, not qmatmul)"
                                .into(),
                        ))
                    }
                    BaseWeight::PackedOnly => {
                        return Err(crate::model::packed_only_error("the candle backend"))
                    }
                };
                Ok(Projection {
                    weight: BaseWeight::Dense(place(&dense)?),
                    bias: p.bias.as_ref().map(place).transpose()?,
                    target: p.target,
                })
            };
            let embed = place(&match &self.embed {
                Embedding::Dense(w) => w.clone(),
                Embedding::Quantized(q) => q.dequantize(&Device::Cpu)?,
            })?;
            self.lm_head = if self.config.tie_word_embeddings {
                Projection {
                    weight: BaseWeight::Dense(embed.clone()),
                    bias: None,
                    target: self.lm_head.target,
                }
            } else {
                project(&self.lm_head)?
            };
            self.embed = Embedding::Dense(embed);
            for block in &mut self.blocks {
                block.input_norm = place_f32(&block.input_norm)?;
                block.post_attention_norm = place_f32(&block.post_attention_norm)?;
                if let Some(norm) = &mut block.qk_norm {
                    norm.q = place_f32(&norm.q)?;
                    norm.k = place_f32(&norm.k)?;
                }
                for p in [
                    &mut block.q_proj,
                    &mut block.k_proj,
                    &mut block.v_proj,
                    &mut block.o_proj,
                    &mut block.gate_proj,
                    &mut block.up_proj,
                    &mut block.down_proj,
                ] {
                    *p = project(p)?;
                }
            }
            self.final_norm = place_f32(&self.final_norm)?;
            self.rope_cos = place_f32(&self.rope_cos)?;
            self.rope_sin = place_f32(&self.rope_sin)?;
            self.inference = Default::default();
        }
        self.set_backend(backend);
        Ok(self)
    }

    /// Makes `backend` compute this model's forward, its weights already
    /// where the backend wants them; the candle backend gets a fresh KV
    /// pool.
    pub(crate) fn set_backend(&mut self, backend: Backend) {
        self.kv_pool = match &backend {
            Backend::Engine => None,
            Backend::Candle { device, dtype } => Some(std::sync::Arc::new(
                crate::cache::KvPool::new(&self.config, *dtype, device),
            )),
        };
        self.backend = backend;
    }

    /// `adapter` placed where this model computes ([`Backend::place_adapter`]).
    pub fn place_adapter(&self, adapter: &LoraAdapter) -> Result<LoraAdapter> {
        self.backend.place_adapter(adapter)
    }

    /// `adapter` placed to be served, its factors in the compute dtype
    /// ([`Backend::place_frozen_adapter`]).
    pub fn place_frozen_adapter(&self, adapter: &LoraAdapter) -> Result<LoraAdapter> {
        self.backend.place_frozen_adapter(adapter)
    }
}

#[cfg(test)]
mod tests {
    //! candle's fused kernels against the composed ops they replace, on
    //! the CPU. Both sides compute in f32 with the same formula; they may
    //! differ only in the order of a row's sum (softmax's denominator,
    //! RMSNorm's mean square), whose rounding error is at most about
    //! `n * f32::EPSILON` relative for `n` terms: the bounds below are
    //! that, `n` being the row's length, times the outputs' magnitude.
    use candle_core::{DType, Device, Tensor, D};
    use rand::{Rng, SeedableRng};

    fn random(shape: &[usize], seed: u64) -> Tensor {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let n = shape.iter().product();
        let values: Vec<f32> = (0..n).map(|_| r.random_range(-3.0..3.0)).collect();
        Tensor::from_vec(values, shape, &Device::Cpu).unwrap()
    }

    fn largest_gap(a: &Tensor, b: &Tensor) -> f32 {
        assert_eq!(a.dims(), b.dims());
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar()
            .unwrap()
    }

    fn largest_abs(a: &Tensor) -> f32 {
        a.abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar()
            .unwrap()
    }

    /// Packed rows, each turned by its own angles, as the composed RoPE
    /// turns them.
    #[test]
    fn fused_rope_matches_the_composed_one() {
        let (rows, heads, head_dim) = (7, 4, 24);
        let x = random(&[rows, heads, head_dim], 1);
        // Each row's own angles, as rows of sequences at different
        // positions carry them.
        let angles = random(&[rows, head_dim / 2], 5);
        let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
        let fused = super::rope_rows(&x, &cos, &sin).unwrap();
        let composed =
            crate::model::rope(&x, &cos.unsqueeze(1).unwrap(), &sin.unsqueeze(1).unwrap()).unwrap();
        // Two products and a sum per element on both sides: a few ulps.
        let bound = 4.0 * f32::EPSILON * largest_abs(&composed);
        let gap = largest_gap(&fused, &composed);
        assert!(gap <= bound, "fused RoPE differs by {gap} (bound {bound})");
        // The angles turn something: not the identity.
        assert!(largest_gap(&fused, &x) > 0.1);
    }

    /// Attention scores with masked (-inf) positions, as a decode batch
    /// pads them.
    #[test]
    fn fused_softmax_matches_the_composed_one() {
        let len = 48;
        let mut scores: Vec<f32> = random(&[3, 5, len], 2)
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        for row in scores.chunks_mut(len).step_by(2) {
            row[len - 10..].fill(f32::NEG_INFINITY);
        }
        let scores = Tensor::from_vec(scores, (3, 5, len), &Device::Cpu).unwrap();
        let fused = candle_nn::ops::softmax_last_dim(&scores).unwrap();
        let max = scores.max_keepdim(D::Minus1).unwrap();
        let exp = scores.broadcast_sub(&max).unwrap().exp().unwrap();
        let composed = exp
            .broadcast_div(&exp.sum_keepdim(D::Minus1).unwrap())
            .unwrap();
        let bound = len as f32 * f32::EPSILON;
        let gap = largest_gap(&fused, &composed);
        assert!(
            gap <= bound,
            "fused softmax differs by {gap} (bound {bound})"
        );
        let rows: Vec<Vec<f32>> = fused.reshape((15, len)).unwrap().to_vec2().unwrap();
        for row in rows.iter().step_by(2) {
            assert!(row[len - 10..].iter().all(|&p| p == 0.0));
        }
    }

    /// Rows of the residual stream `(rows, hidden)` and Qwen3's per-head
    /// norm of `(rows, heads, head_dim)`, with a weight away from 1.
    #[test]
    fn fused_rms_norm_matches_the_composed_one() {
        let eps = 1e-6;
        for (shape, seed) in [(vec![6, 64], 3), (vec![6, 4, 24], 4)] {
            let x = random(&shape, seed);
            let width = *shape.last().unwrap();
            let weight = (random(&[width], seed + 10).affine(0.2, 1.0).unwrap())
                .to_dtype(DType::F32)
                .unwrap();
            let fused = super::rms_norm(&x, &weight, eps).unwrap();
            let composed = crate::model::rms_norm(&x, &weight, eps).unwrap();
            let bound = width as f32 * f32::EPSILON * largest_abs(&composed);
            let gap = largest_gap(&fused, &composed);
            assert!(
                gap <= bound,
                "fused RMSNorm of {shape:?} differs by {gap} (bound {bound})"
            );
        }
    }
}
