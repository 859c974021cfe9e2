//! The candle backend's inference forward ([`crate::Backend::Candle`]):
//! [`CausalLm::forward_batch`] built from candle tensor ops only, so it
//! runs on any device candle supports (CPU, CUDA) in f32, bf16 or f16.
//!
//! Same contract as the CPU engine's forward ([`crate::infer`]): any
//! number of sequences, each with its own cache, adapter and number of new
//! tokens, packed into one `(tokens, hidden)` matrix for every projection
//! and MLP (one matmul each for the whole batch, adapters applied to their
//! rows); attention per sequence against its
//! own cache ([`crate::KvCache`] device storage, written in place). On error no
//! cache is advanced.
//!
//! Precision: weights and matmuls in the backend's dtype; the residual
//! stream, RMSNorm, RoPE, the attention softmax and the logits in f32 (so
//! bf16 loses only what its matmuls lose).
//!
//! Why not `candle-transformers`' Qwen2/Llama modules: they keep one KV
//! cache per model (a whole batch shares one length, padded), apply no
//! per-row LoRA, and cannot mix prefills and decodes of different lengths
//! in one step, which continuous batching needs. The ops used here (matmul,
//! `index_select`/`index_add`, `slice_set`, fused RMSNorm and softmax,
//! elementwise ops) all have CUDA kernels in candle.

use candle_core::{DType, Device, Tensor};

use crate::backend::Backend;
use crate::lora::LoraAdapter;
use crate::model::{
    causal_mask, rope, route, BaseWeight, BatchItem, CausalLm, Embedding, LogitsWanted, Projection,
    Routing,
};
use crate::model_error::{ModelError, Result};

/// Grouped-query attention of one sequence, softmax in f32. `q`:
/// `(kv_heads, rep * t, head_dim)`, `k`, `v`: `(kv_heads, len, head_dim)`,
/// `mask`: `(t, len)` f32 or none (one new token sees every position).
fn attend(q: &Tensor, k: &Tensor, v: &Tensor, rep: usize, mask: Option<&Tensor>) -> Result<Tensor> {
    let (groups, rows, head_dim) = q.dims3()?;
    let len = k.dim(1)?;
    let scores = q
        .matmul(&k.t()?)?
        .to_dtype(DType::F32)?
        .affine(1.0 / (head_dim as f64).sqrt(), 0.0)?;
    let scores = match mask {
        Some(mask) => scores
            .reshape((groups, rep, rows / rep, len))?
            .broadcast_add(mask)?
            .reshape((groups, rows, len))?,
        None => scores,
    };
    let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(v.dtype())?;
    Ok(probs.matmul(&v.contiguous()?)?)
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
        let mut spans = Vec::with_capacity(items.len());
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        for item in items.iter() {
            if item.tokens.is_empty() {
                return Err(ModelError::BadInput("a batch item has no tokens".into()));
            }
            self.check_tokens(item.tokens)?;
            item.cache.check_shape(cfg, true)?;
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
        // Each row's rotary angles, `(total, 1, head_dim / 2)`.
        let cos = self.rope_cos.index_select(&positions, 0)?.unsqueeze(1)?;
        let sin = self.rope_sin.index_select(&positions, 0)?.unsqueeze(1)?;
        let (heads, kv_heads, hd) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let rep = cfg.kv_group_size();
        let eps = cfg.rms_norm_eps;
        let masks: Vec<Option<Tensor>> = items
            .iter()
            .zip(&spans)
            .map(|(item, &(_, t))| {
                (t > 1)
                    .then(|| causal_mask(t, item.cache.len(), device))
                    .transpose()
            })
            .collect::<Result<_>>()?;

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
                Ok(rope(&t, &cos, &sin)?.to_dtype(dtype)?)
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
            let mut outs = Vec::with_capacity(items.len());
            for ((item, &(start, t)), mask) in items.iter_mut().zip(&spans).zip(&masks) {
                // (heads, t, hd) and (kv_heads, t, hd).
                let by_head = |m: &Tensor| -> Result<Tensor> {
                    Ok(m.narrow(0, start, t)?.transpose(0, 1)?.contiguous()?)
                };
                let (keys, values) =
                    item.cache
                        .append_on_device(layer, &by_head(&k)?, &by_head(&v)?)?;
                let q = by_head(&q)?.reshape((kv_heads, rep * t, hd))?;
                let out = attend(&q, &keys, &values, rep, mask.as_ref())?;
                outs.push(
                    out.reshape((heads, t, hd))?
                        .transpose(0, 1)?
                        .reshape((t, heads * hd))?,
                );
            }
            let attn = Tensor::cat(&outs, 0)?;
            x = (x + block
                .o_proj
                .forward(&attn, layer, &routing)?
                .to_dtype(DType::F32)?)?;
            let h = rms_norm(&x, &block.post_attention_norm, eps)?.to_dtype(dtype)?;
            x = (x + self.mlp(block, &h, layer, &routing)?.to_dtype(DType::F32)?)?;
        }
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
        self.backend = backend;
        Ok(self)
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
