//! [`CausalLm`]: one decoder-only transformer for Qwen2, Qwen3 and Llama, with a
//! KV-cached inference path and a differentiable training path.
//!
//! # Two paths, one set of weights
//!
//! * [`CausalLm::forward_batch`] (inference) advances any number of
//!   sequences, each with its own [`KvCache`] and its own adapter (or none),
//!   by any number of tokens each, in one call. Tokens of all sequences are
//!   packed into one `(tokens, hidden)` matrix for every projection and MLP
//!   (the expensive part); attention runs per sequence against its cache
//!   on the CPU engine, and for all one-token decodes at once over the
//!   paged KV pool on the candle backend ([`crate::generic`]).
//!   So a prefill of a new prompt can share a step with the one-token
//!   decodes of running sequences, and nothing is padded. It lives in
//!   [`crate::infer`]: plain Rust between the matmuls, packed dense weights,
//!   no backward.
//! * [`CausalLm::forward_train`] runs a right-padded `(batch, time)` block
//!   from position 0 with no cache, built only from ops that pass
//!   gradients, so a loss on its logits reaches the LoRA factors.
//!   Right padding needs no mask under causal attention: real tokens never
//!   attend to the padding after them; mask the padded positions in the
//!   loss.
//!
//! Both give the same logits (tested against each other and against
//! transformers). The base weights are plain tensors (never `Var`s): they
//! are frozen. They are dense f32 (Hugging Face safetensors, or a
//! dequantized GGUF) or GGUF-quantized blocks, multiplied either in f32
//! (dequantized per product: exact, and gradients reach the input) or by
//! candle's `QMatMul` (no backward: inference only); see
//! [`crate::gguf::GgufBase`].

use std::path::Path;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::VarBuilder;

use crate::backend::Backend;
use crate::cache::KvCache;
use crate::config::ModelConfig;
use crate::hf_weights::HfWeights;
use crate::lora::{LoraAdapter, LoraTarget};
use crate::model_error::{ModelError, Result};

/// A frozen weight matrix `(out_features, in_features)`.
#[derive(Debug, Clone)]
pub(crate) enum BaseWeight {
    /// f32, multiplied with candle's matmul (has a backward w.r.t. its input).
    Dense(Tensor),
    /// GGUF-quantized in memory, dequantized to f32 for each product
    /// (float-exact; no gradient reaches the input).
    Quantized(std::sync::Arc<QTensor>),
    /// GGUF-quantized, multiplied by candle's `QMatMul`, which also
    /// quantizes the activations (to 8 bits for 4-bit weights); no
    /// gradient reaches the input.
    QMatMul(QMatMul),
    /// Only in the model's packed inference copy: the f32 matrix was
    /// released once packed ([`CausalLm::keep_packed_only`]), so only
    /// the engine's [`CausalLm::forward_batch`] can multiply it.
    PackedOnly,
}

/// What a path other than the engine's forward says of a packed-only weight.
pub(crate) fn packed_only_error(what: &str) -> ModelError {
    ModelError::BadInput(format!(
        "{what} needs the base's f32 weights, which this model released after packing them \
         for inference (CausalLm::keep_packed_only); load the model again"
    ))
}

/// One linear projection of the base model, plus where LoRA may attach.
#[derive(Debug, Clone)]
pub(crate) struct Projection {
    pub(crate) weight: BaseWeight,
    pub(crate) bias: Option<Tensor>,
    pub(crate) target: LoraTarget,
}

/// Which adapter applies to which rows of a packed batch.
pub(crate) enum Routing<'a> {
    /// No adapter anywhere.
    Base,
    /// One adapter on every row.
    All(&'a LoraAdapter),
    /// Several adapters, each on its rows (u32 row indices).
    Groups(Vec<(&'a LoraAdapter, Tensor)>),
}

impl Projection {
    /// `x · Wᵀ` without the bias.
    pub(crate) fn forward_base_no_bias(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match &self.weight {
            BaseWeight::Dense(w) => x.matmul(&w.t()?)?,
            BaseWeight::Quantized(q) => x.matmul(&q.dequantize(x.device())?.t()?)?,
            BaseWeight::QMatMul(q) => q.forward(x)?,
            BaseWeight::PackedOnly => return Err(packed_only_error("a candle matmul")),
        })
    }

    fn forward_base(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.forward_base_no_bias(x)?;
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }

    /// `x`: `(rows, in_features)` → `(rows, out_features)`.
    pub(crate) fn forward(
        &self,
        x: &Tensor,
        layer: usize,
        routing: &Routing<'_>,
    ) -> Result<Tensor> {
        let mut y = self.forward_base(x)?;
        match routing {
            Routing::Base => {}
            Routing::All(adapter) => {
                if let Some(delta) = adapter.delta(layer, self.target, x)? {
                    y = (y + delta)?;
                }
            }
            Routing::Groups(groups) => {
                for (adapter, rows) in groups {
                    if adapter.weights(layer, self.target).is_none() {
                        continue;
                    }
                    let xs = x.index_select(rows, 0)?;
                    if let Some(delta) = adapter.delta(layer, self.target, &xs)? {
                        y = y.index_add(rows, &delta, 0)?;
                    }
                }
            }
        }
        Ok(y)
    }
}

/// The token embedding matrix `(vocab, hidden)`.
#[derive(Debug, Clone)]
pub(crate) enum Embedding {
    Dense(Tensor),
    Quantized(std::sync::Arc<QTensor>),
}

impl Embedding {
    pub(crate) fn lookup(&self, ids: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Self::Dense(w) => w.index_select(ids, 0)?,
            Self::Quantized(q) => q.embedding(ids)?,
        })
    }
}

/// Qwen3's RMSNorm weights, `(head_dim,)` each, applied to every head's
/// queries and keys before RoPE.
#[derive(Debug, Clone)]
pub(crate) struct QkNorm {
    pub(crate) q: Tensor,
    pub(crate) k: Tensor,
}

/// One pre-norm transformer block.
#[derive(Debug, Clone)]
pub(crate) struct Block {
    pub(crate) input_norm: Tensor,
    pub(crate) q_proj: Projection,
    pub(crate) k_proj: Projection,
    pub(crate) v_proj: Projection,
    pub(crate) o_proj: Projection,
    /// Per-head norms of queries and keys (Qwen3 only).
    pub(crate) qk_norm: Option<QkNorm>,
    pub(crate) post_attention_norm: Tensor,
    pub(crate) gate_proj: Projection,
    pub(crate) up_proj: Projection,
    pub(crate) down_proj: Projection,
}

/// A Qwen2, Qwen3 or Llama causal language model with frozen base weights.
///
/// Cheap to share: wrap it in an `Arc` and run forwards from several
/// threads; all state of a sequence lives in its [`KvCache`].
#[derive(Debug, Clone)]
pub struct CausalLm {
    pub(crate) config: ModelConfig,
    pub(crate) embed: Embedding,
    pub(crate) blocks: Vec<Block>,
    pub(crate) final_norm: Tensor,
    pub(crate) lm_head: Projection,
    /// `(max_position_embeddings, head_dim / 2)` each.
    pub(crate) rope_cos: Tensor,
    pub(crate) rope_sin: Tensor,
    /// Packed weights and plain copies for [`CausalLm::forward_batch`],
    /// built on first use (see [`crate::infer`]).
    pub(crate) inference: std::sync::OnceLock<std::sync::Arc<crate::packed::InferenceWeights>>,
    /// Which code computes [`CausalLm::forward_batch`] (see [`crate::backend`]).
    pub(crate) backend: Backend,
    /// The candle backend's paged key/value store, shared by every cache
    /// of this model (and of its clones); `None` for the CPU engine.
    pub(crate) kv_pool: Option<std::sync::Arc<crate::cache::KvPool>>,
}

/// Which positions [`CausalLm::forward_batch`] returns logits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsWanted {
    /// Only each sequence's last fed token: `(sequences, vocab)`.
    Last,
    /// Every fed token, sequences one after another: `(total tokens, vocab)`.
    All,
}

/// One sequence's part of a [`CausalLm::forward_batch`] call.
#[derive(Debug)]
pub struct BatchItem<'a> {
    /// Tokens to feed now (the whole prompt, a chunk of it, or the last
    /// sampled token); at least one.
    pub tokens: &'a [u32],
    /// The sequence's cache: the tokens are placed after its positions and
    /// appended to it.
    pub cache: &'a mut KvCache,
    /// The adapter to apply to this sequence, or `None` for the base model.
    pub adapter: Option<&'a LoraAdapter>,
}

/// Rotary tables as Hugging Face computes them (f32 inverse frequencies,
/// f32 angles), so logits match transformers to float precision.
pub(crate) fn rope_tables(config: &ModelConfig, device: &Device) -> Result<(Tensor, Tensor)> {
    let half = config.head_dim / 2;
    let inv_freq = config.rope_inv_freq();
    let positions = config.max_position_embeddings;
    let mut cos = Vec::with_capacity(positions * half);
    let mut sin = Vec::with_capacity(positions * half);
    for p in 0..positions {
        for f in &inv_freq {
            let angle = p as f32 * f;
            cos.push(angle.cos());
            sin.push(angle.sin());
        }
    }
    Ok((
        Tensor::from_vec(cos, (positions, half), device)?,
        Tensor::from_vec(sin, (positions, half), device)?,
    ))
}

/// RMSNorm from ops that pass gradients (candle's fused one does not).
pub(crate) fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let mean_square = x.sqr()?.mean_keepdim(D::Minus1)?;
    let inv_rms = (mean_square + eps)?.sqrt()?.recip()?;
    Ok(x.broadcast_mul(&inv_rms)?.broadcast_mul(weight)?)
}

/// Rotates `x` `(batch, heads, t, head_dim)` by the angles of positions
/// `cos`/`sin` `(t, head_dim / 2)` ("rotate half" layout).
pub(crate) fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let cos = Tensor::cat(&[cos, cos], D::Minus1)?;
    let sin = Tensor::cat(&[sin, sin], D::Minus1)?;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    Ok((x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?)?)
}

/// Additive causal mask `(t, offset + t)` for `t` new tokens after
/// `offset` cached ones.
pub(crate) fn causal_mask(t: usize, offset: usize, device: &Device) -> Result<Tensor> {
    let total = offset + t;
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| {
            (0..total).map(move |j| {
                if j <= offset + i {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    Ok(Tensor::from_vec(mask, (t, total), device)?)
}

/// Grouped-query attention. `q`: `(groups, rep * t, hd)` where each group
/// is one key/value head and its `rep` query heads; `k`, `v`:
/// `(groups, len, hd)`; `mask`: `(t, len)` or none (when `t == 1`).
pub(crate) fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    rep: usize,
    mask: Option<&Tensor>,
) -> Result<Tensor> {
    let (groups, rows, head_dim) = q.dims3()?;
    let len = k.dim(1)?;
    let scores = (q.matmul(&k.t()?)? * (1.0 / (head_dim as f64).sqrt()))?;
    let scores = match mask {
        Some(mask) => scores
            .reshape((groups, rep, rows / rep, len))?
            .broadcast_add(mask)?
            .reshape((groups, rows, len))?,
        None => scores,
    };
    let probs = candle_nn::ops::softmax(&scores, D::Minus1)?;
    Ok(probs.matmul(v)?)
}

fn load_projection(
    vb: &VarBuilder,
    name: &str,
    target: LoraTarget,
    config: &ModelConfig,
    bias: bool,
) -> Result<Projection> {
    let (fan_in, fan_out) = crate::lora::target_dims(target, config);
    let vb = vb.pp(name);
    Ok(Projection {
        weight: BaseWeight::Dense(vb.get((fan_out, fan_in), "weight")?),
        bias: if bias {
            Some(vb.get(fan_out, "bias")?)
        } else {
            None
        },
        target,
    })
}

impl CausalLm {
    /// Builds the model from tensors named as in Hugging Face checkpoints
    /// (`model.embed_tokens.weight`, `model.layers.N.self_attn.q_proj.weight`,
    /// `model.norm.weight`, `lm_head.weight` unless tied), in `vb`'s dtype
    /// but the norms' weights, which are read in f32 (every forward
    /// normalises in f32).
    pub fn new(config: &ModelConfig, vb: VarBuilder) -> Result<Self> {
        config.validate()?;
        let hidden = config.hidden_size;
        let model = vb.pp("model");
        let embed = model.get((config.vocab_size, hidden), "embed_tokens.weight")?;
        let mut blocks = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let layer = model.pp(format!("layers.{i}"));
            let attn = layer.pp("self_attn");
            let mlp = layer.pp("mlp");
            blocks.push(Block {
                input_norm: layer
                    .to_dtype(DType::F32)
                    .get(hidden, "input_layernorm.weight")?,
                q_proj: load_projection(
                    &attn,
                    "q_proj",
                    LoraTarget::QProj,
                    config,
                    config.qkv_bias,
                )?,
                k_proj: load_projection(
                    &attn,
                    "k_proj",
                    LoraTarget::KProj,
                    config,
                    config.qkv_bias,
                )?,
                v_proj: load_projection(
                    &attn,
                    "v_proj",
                    LoraTarget::VProj,
                    config,
                    config.qkv_bias,
                )?,
                o_proj: load_projection(&attn, "o_proj", LoraTarget::OProj, config, config.o_bias)?,
                qk_norm: if config.architecture.has_qk_norm() {
                    Some(QkNorm {
                        q: attn
                            .to_dtype(DType::F32)
                            .get(config.head_dim, "q_norm.weight")?,
                        k: attn
                            .to_dtype(DType::F32)
                            .get(config.head_dim, "k_norm.weight")?,
                    })
                } else {
                    None
                },
                post_attention_norm: layer
                    .to_dtype(DType::F32)
                    .get(hidden, "post_attention_layernorm.weight")?,
                gate_proj: load_projection(
                    &mlp,
                    "gate_proj",
                    LoraTarget::GateProj,
                    config,
                    config.mlp_bias,
                )?,
                up_proj: load_projection(
                    &mlp,
                    "up_proj",
                    LoraTarget::UpProj,
                    config,
                    config.mlp_bias,
                )?,
                down_proj: load_projection(
                    &mlp,
                    "down_proj",
                    LoraTarget::DownProj,
                    config,
                    config.mlp_bias,
                )?,
            });
        }
        let final_norm = model.to_dtype(DType::F32).get(hidden, "norm.weight")?;
        let head = if config.tie_word_embeddings {
            embed.clone()
        } else {
            vb.get((config.vocab_size, hidden), "lm_head.weight")?
        };
        let (rope_cos, rope_sin) = rope_tables(config, vb.device())?;
        Ok(Self {
            config: config.clone(),
            embed: Embedding::Dense(embed),
            blocks,
            final_norm,
            lm_head: Projection {
                weight: BaseWeight::Dense(head),
                bias: None,
                // Never adapted: `LoraTarget` names the projection only for routing.
                target: LoraTarget::DownProj,
            },
            rope_cos,
            rope_sin,
            inference: Default::default(),
            backend: Default::default(),
            kv_pool: None,
        })
    }

    /// Loads a Hugging Face model folder: `config.json` and
    /// `model.safetensors` (or the shards listed in
    /// `model.safetensors.index.json`), in any float dtype, converted to
    /// f32 for the engine ([`CausalLm::load_hf_on`] for another backend).
    /// A tensor of the files that the model does not use is an error, as
    /// is a missing one.
    pub fn load_hf(dir: &Path) -> Result<Self> {
        Self::load_hf_on(dir, &Backend::Engine)
    }

    /// [`CausalLm::load_hf`] straight onto `backend`: for the candle
    /// backend every tensor is read from the file to the device as stored
    /// and converted there, so a bf16 checkpoint stays bf16 from the disk
    /// to the GPU (never widened to f32 on the host) and the host holds
    /// no copy of the weights.
    pub fn load_hf_on(dir: &Path, backend: &Backend) -> Result<Self> {
        let config = ModelConfig::from_hf_file(&dir.join("config.json"))?;
        let weights = HfWeights::open(dir)?;
        let (dtype, device) = match backend {
            Backend::Engine => (DType::F32, Device::Cpu),
            Backend::Candle { device, dtype } => (*dtype, device.clone()),
        };
        let (vb, read) = weights.var_builder(dtype, &device);
        let model = Self::new(&config, vb).map_err(|e| match e {
            ModelError::Candle(e) => ModelError::weights(dir, e.to_string()),
            other => other,
        })?;
        let read = read.lock().expect("read-names lock");
        weights.check_all_used(&config, |name| read.contains(name))?;
        // Norms and rotary tables to f32 where the backend keeps them so;
        // the weights are already where they belong.
        model.to_backend(backend.clone())
    }

    /// The model's shape.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// An empty cache for one sequence of this model.
    pub fn new_cache(&self) -> KvCache {
        match &self.kv_pool {
            None => KvCache::new(&self.config),
            Some(pool) => KvCache::paged(&self.config, pool.clone()),
        }
    }

    /// The candle backend's key/value pool (its usage and bound); `None`
    /// for the CPU engine, whose caches are host buffers of their own.
    pub fn kv_pool(&self) -> Option<&crate::cache::KvPool> {
        self.kv_pool.as_deref()
    }

    fn any_weight(&self, pred: impl Fn(&BaseWeight) -> bool) -> bool {
        pred(&self.lm_head.weight)
            || self.blocks.iter().any(|b| {
                [
                    &b.q_proj,
                    &b.k_proj,
                    &b.v_proj,
                    &b.o_proj,
                    &b.gate_proj,
                    &b.up_proj,
                    &b.down_proj,
                ]
                .iter()
                .any(|p| pred(&p.weight))
            })
    }

    /// Whether the base keeps GGUF-quantized weights in memory.
    pub fn is_quantized(&self) -> bool {
        self.any_weight(|w| matches!(w, BaseWeight::Quantized(_) | BaseWeight::QMatMul(_)))
    }

    /// Whether [`CausalLm::forward_train`] can pass gradients through the
    /// base (false for [`crate::GgufBase::QMatMul8Bit`] and once
    /// [`CausalLm::keep_packed_only`] released the f32 weights).
    pub fn supports_training(&self) -> bool {
        !self.any_weight(|w| matches!(w, BaseWeight::QMatMul(_) | BaseWeight::PackedOnly))
    }

    /// Whether [`CausalLm::keep_packed_only`] released the f32 weights.
    pub(crate) fn is_packed_only(&self) -> bool {
        self.any_weight(|w| matches!(w, BaseWeight::PackedOnly))
    }

    pub(crate) fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        if let Some(bad) = tokens
            .iter()
            .find(|&&t| t as usize >= self.config.vocab_size)
        {
            return Err(ModelError::BadInput(format!(
                "token {bad} is outside the vocabulary of {}",
                self.config.vocab_size
            )));
        }
        Ok(())
    }

    pub(crate) fn check_adapter(&self, adapter: Option<&LoraAdapter>) -> Result<()> {
        match adapter {
            Some(a) => a.check_fits(&self.config),
            None => Ok(()),
        }
    }

    /// Feeds `tokens` to one sequence and returns the logits of every fed
    /// position, `(tokens, vocab)`.
    pub fn forward_one(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        adapter: Option<&LoraAdapter>,
    ) -> Result<Tensor> {
        self.forward_batch(
            &mut [BatchItem {
                tokens,
                cache,
                adapter,
            }],
            LogitsWanted::All,
        )
    }

    /// The dtype of the base's weights and matmuls.
    pub(crate) fn compute_dtype(&self) -> DType {
        match &self.backend {
            crate::backend::Backend::Candle { dtype, .. } => *dtype,
            crate::backend::Backend::Engine => DType::F32,
        }
    }

    pub(crate) fn mlp(
        &self,
        block: &Block,
        h: &Tensor,
        layer: usize,
        routing: &Routing<'_>,
    ) -> Result<Tensor> {
        let gate = block.gate_proj.forward(h, layer, routing)?.silu()?;
        let up = block.up_proj.forward(h, layer, routing)?;
        block.down_proj.forward(&(gate * up)?, layer, routing)
    }
}

/// Log-probabilities of `targets` `(batch, time)` (u32) under `logits`
/// `(batch, time, vocab)`: `(batch, time)`, differentiable. For a causal
/// LM, `targets[t]` is usually `input_ids[t + 1]`.
pub fn token_log_probs(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let log_probs = candle_nn::ops::log_softmax(logits, D::Minus1)?;
    let targets = targets
        .to_dtype(DType::U32)?
        .unsqueeze(D::Minus1)?
        .contiguous()?;
    Ok(log_probs.gather(&targets, D::Minus1)?.squeeze(D::Minus1)?)
}

/// Groups the rows of a packed batch by adapter (compared by address).
pub(crate) fn route<'a>(
    adapters: &[Option<&'a LoraAdapter>],
    spans: &[(usize, usize)],
    device: &Device,
) -> Result<Routing<'a>> {
    let same = |a: Option<&LoraAdapter>, b: Option<&LoraAdapter>| match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => std::ptr::eq(a, b),
        _ => false,
    };
    let first = adapters[0];
    if adapters.iter().all(|a| same(*a, first)) {
        return Ok(match first {
            None => Routing::Base,
            Some(a) => Routing::All(a),
        });
    }
    let mut groups: Vec<(&LoraAdapter, Vec<u32>)> = Vec::new();
    for (adapter, &(start, t)) in adapters.iter().zip(spans) {
        let Some(adapter) = adapter else { continue };
        let rows = (start as u32)..((start + t) as u32);
        match groups.iter_mut().find(|(a, _)| std::ptr::eq(*a, *adapter)) {
            Some((_, r)) => r.extend(rows),
            None => groups.push((adapter, rows.collect())),
        }
    }
    let groups = groups
        .into_iter()
        .map(|(a, rows)| {
            let n = rows.len();
            Ok((a, Tensor::from_vec(rows, n, device)?))
        })
        .collect::<Result<_>>()?;
    Ok(Routing::Groups(groups))
}
