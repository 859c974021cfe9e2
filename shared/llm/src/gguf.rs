//! [`CausalLm`] from a GGUF file (llama.cpp's format): the model's shape
//! from the `{arch}.*` metadata, its weights from the tensors. Tokenizer
//! metadata (`tokenizer.ggml.*`) belongs to the tokenizer modules; only the
//! special token ids are read here.
//!
//! Three ways to hold the base ([`GgufBase`]): the file's quantized blocks
//! multiplied in f32 (exact), the quantized blocks through candle's
//! `QMatMul` (8-bit activations, as llama.cpp), or dequantized to f32 once
//! (for training: a quantized projection passes no gradient to its input,
//! so LoRA factors before it would never learn).
//!
//! llama.cpp's converter permutes the rows of Llama's `q`/`k` weights so
//! that its interleaved RoPE applies; the loader undoes that permutation
//! (on the quantized rows, exactly), so the model uses Hugging Face's
//! layout and rotary convention and a PEFT adapter trained on the
//! safetensors checkpoint applies unchanged, and the reverse.

use std::borrow::Cow;
use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::{gguf_file, QMatMul, QStorage, QTensor};
use candle_core::{Device, Tensor};

use crate::config::{Architecture, ModelConfig, RopeScaling};
use crate::lora::LoraTarget;
use crate::model::{rope_tables, BaseWeight, Block, CausalLm, Embedding, Projection, QkNorm};
use crate::model_error::{ModelError, Result};

/// How to hold and multiply the base weights of a GGUF model.
///
/// Measured on SmolLM2-135M Q4_1 (`cargo bench -p relay-llm`, 2 CPU cores
/// shared with other jobs, so only the ratios mean much):
///
/// | base | logits vs float32 | prefill 128 | decode step, batch 1 / 8 | memory |
/// |---|---|---|---|---|
/// | `Quantized` | 3e-5 | 2.1 s | 263 / 553 ms | Q4 (~100 MB) |
/// | `QMatMul8Bit` | ~1 logit | 16 s | 484 / 1253 ms | Q4 |
/// | `Dequantized` | 3e-5 | 2.4 s | 83 / 356 ms | f32 (~600 MB) |
///
/// candle's Q4_1 x Q8_1 kernel has no SIMD path on x86, and its 8-bit
/// activations move the chat case's logits by about one unit, enough to
/// flip a greedy choice whose reference margin is 0.08. Serve with
/// `Dequantized` when memory allows, `Quantized` when it does not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufBase {
    /// Keep the file's quantized blocks in memory and dequantize each
    /// weight to f32 for each product (float-exact logits; inference only:
    /// no gradient flows through a quantized projection).
    Quantized,
    /// Keep the quantized blocks and multiply with candle's `QMatMul`,
    /// which quantizes the activations too (8 bits for 4-bit weights), as
    /// llama.cpp does. Inference only.
    QMatMul8Bit,
    /// Dequantize every weight to f32 once at load (needed for
    /// [`CausalLm::forward_train`]).
    Dequantized,
}

impl GgufBase {
    fn weight(self, tensor: QTensor) -> Result<BaseWeight> {
        Ok(match self {
            Self::Quantized => BaseWeight::Quantized(Arc::new(tensor)),
            Self::QMatMul8Bit => BaseWeight::QMatMul(QMatMul::from_qtensor(tensor)?),
            Self::Dequantized => BaseWeight::Dense(tensor.dequantize(&Device::Cpu)?),
        })
    }
}

fn meta<'a>(content: &'a gguf_file::Content, key: &str) -> Result<&'a gguf_file::Value> {
    content
        .metadata
        .get(key)
        .ok_or_else(|| ModelError::config(key, "missing from the GGUF metadata"))
}

fn meta_usize(content: &gguf_file::Content, key: &str) -> Result<usize> {
    let v = meta(content, key)?;
    v.to_u64()
        .or_else(|_| v.to_u32().map(u64::from))
        .or_else(|_| v.to_i32().map(|x| x.max(0) as u64))
        .map(|x| x as usize)
        .map_err(|e| ModelError::config(key, e.to_string()))
}

fn meta_opt_u32(content: &gguf_file::Content, key: &str) -> Option<u32> {
    let v = content.metadata.get(key)?;
    v.to_u32()
        .ok()
        .or_else(|| v.to_u64().ok().map(|x| x as u32))
        .or_else(|| v.to_i32().ok().map(|x| x as u32))
}

fn meta_opt_f32(content: &gguf_file::Content, key: &str) -> Option<f32> {
    let v = content.metadata.get(key)?;
    v.to_f32()
        .ok()
        .or_else(|| v.to_f64().ok().map(|x| x as f32))
}

/// The model shape described by a GGUF file's metadata and tensors.
pub fn config_from_gguf(content: &gguf_file::Content) -> Result<ModelConfig> {
    let arch_name = meta(content, "general.architecture")?
        .to_string()
        .map_err(|e| ModelError::config("general.architecture", e.to_string()))?
        .clone();
    let architecture = match arch_name.as_str() {
        "llama" => Architecture::Llama,
        "qwen2" => Architecture::Qwen2,
        "qwen3" => Architecture::Qwen3,
        other => {
            return Err(ModelError::config(
                "general.architecture",
                format!("`{other}` is not supported (llama, qwen2 or qwen3)"),
            ))
        }
    };
    let key = |k: &str| format!("{arch_name}.{k}");
    if let Some(kind) = content.metadata.get(&key("rope.scaling.type")) {
        let kind = kind
            .to_string()
            .map_err(|e| ModelError::config(key("rope.scaling.type"), e.to_string()))?;
        if kind != "none" {
            return Err(ModelError::config(
                key("rope.scaling.type"),
                format!("rope scaling `{kind}` is not supported (none; Llama 3's comes as rope_freqs.weight)"),
            ));
        }
    }
    let embed = content
        .tensor_infos
        .get("token_embd.weight")
        .ok_or_else(|| ModelError::config("token_embd.weight", "missing from the GGUF tensors"))?;
    let (vocab_size, hidden_size) = embed
        .shape
        .dims2()
        .map_err(|e| ModelError::config("token_embd.weight", e.to_string()))?;
    let num_attention_heads = meta_usize(content, &key("attention.head_count"))?;
    let num_key_value_heads = match content.metadata.get(&key("attention.head_count_kv")) {
        Some(_) => meta_usize(content, &key("attention.head_count_kv"))?,
        None => num_attention_heads,
    };
    let head_dim = match content.metadata.get(&key("attention.key_length")) {
        Some(_) => meta_usize(content, &key("attention.key_length"))?,
        None => hidden_size / num_attention_heads.max(1),
    };
    if content.metadata.contains_key(&key("rope.dimension_count")) {
        let rotated = meta_usize(content, &key("rope.dimension_count"))?;
        if rotated != head_dim {
            return Err(ModelError::config(
                key("rope.dimension_count"),
                format!("RoPE on {rotated} of {head_dim} head dimensions is not supported"),
            ));
        }
    }
    let has_bias = content.tensor_infos.contains_key("blk.0.attn_q.bias");
    let has_o_bias = content.tensor_infos.contains_key("blk.0.attn_output.bias");
    let has_mlp_bias = content.tensor_infos.contains_key("blk.0.ffn_up.bias");
    let config = ModelConfig {
        architecture,
        vocab_size,
        hidden_size,
        intermediate_size: meta_usize(content, &key("feed_forward_length"))?,
        num_hidden_layers: meta_usize(content, &key("block_count"))?,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        max_position_embeddings: meta_usize(content, &key("context_length"))?,
        rope_theta: meta_opt_f32(content, &key("rope.freq_base")).unwrap_or(10_000.0),
        // Llama 3's scaling is a tensor (`rope_freqs.weight`), read with the weights.
        rope_scaling: None,
        rms_norm_eps: f64::from(
            meta_opt_f32(content, &key("attention.layer_norm_rms_epsilon")).unwrap_or(1e-5),
        ),
        tie_word_embeddings: !content.tensor_infos.contains_key("output.weight"),
        qkv_bias: has_bias,
        o_bias: has_o_bias,
        mlp_bias: has_mlp_bias,
        bos_token_id: meta_opt_u32(content, "tokenizer.ggml.bos_token_id"),
        eos_token_ids: meta_opt_u32(content, "tokenizer.ggml.eos_token_id")
            .into_iter()
            .collect(),
        pad_token_id: meta_opt_u32(content, "tokenizer.ggml.padding_token_id"),
    };
    config.validate()?;
    Ok(config)
}

/// Reorders the rows of a `(heads * head_dim, in)` weight from llama.cpp's
/// interleaved-RoPE layout back to Hugging Face's: within each head, GGUF
/// row `2 i + s` is Hugging Face row `s * head_dim / 2 + i`. Works on the
/// quantized bytes (blocks never straddle rows), so it is exact.
fn unpermute_rows(tensor: QTensor, heads: usize) -> Result<QTensor> {
    let (rows, cols) = tensor.shape().dims2()?;
    let dtype = tensor.dtype();
    let row_bytes = cols / dtype.block_size() * dtype.type_size();
    let data = tensor.data()?;
    if rows % heads != 0 || data.len() != rows * row_bytes {
        return Err(ModelError::BadInput(format!(
            "cannot unpermute a {rows}x{cols} {dtype:?} tensor over {heads} heads"
        )));
    }
    let head_dim = rows / heads;
    let half = head_dim / 2;
    let mut out = vec![0u8; data.len()];
    for h in 0..heads {
        for s in 0..2 {
            for i in 0..half {
                let hf_row = h * head_dim + s * half + i;
                let gguf_row = h * head_dim + 2 * i + s;
                out[hf_row * row_bytes..(hf_row + 1) * row_bytes]
                    .copy_from_slice(&data[gguf_row * row_bytes..(gguf_row + 1) * row_bytes]);
            }
        }
    }
    let storage = QStorage::from_data(Cow::Owned(out), &Device::Cpu, dtype)?;
    Ok(QTensor::new(storage, (rows, cols))?)
}

struct Reader<'a, R> {
    content: &'a gguf_file::Content,
    file: &'a mut R,
    path: &'a Path,
    base: GgufBase,
    /// Every tensor read, so that one the model does not use is an error.
    read: std::collections::HashSet<String>,
}

impl<R: std::io::Read + std::io::Seek> Reader<'_, R> {
    fn qtensor(&mut self, name: &str) -> Result<QTensor> {
        self.read.insert(name.to_owned());
        self.content
            .tensor(self.file, name, &Device::Cpu)
            .map_err(|e| ModelError::weights(self.path, format!("tensor `{name}`: {e}")))
    }

    /// Fails naming the file's tensors that were never read.
    fn check_all_used(&self, config: &ModelConfig) -> Result<()> {
        let mut unused: Vec<&str> = self
            .content
            .tensor_infos
            .keys()
            .map(String::as_str)
            .filter(|name| !self.read.contains(*name))
            .collect();
        if unused.is_empty() {
            return Ok(());
        }
        unused.sort();
        Err(ModelError::weights(
            self.path,
            format!(
                "{} tensor(s) that a `{}` model does not use, e.g. {}",
                unused.len(),
                config.architecture.model_type(),
                unused[..unused.len().min(5)].join(", ")
            ),
        ))
    }

    fn dense(&mut self, name: &str) -> Result<Tensor> {
        Ok(self.qtensor(name)?.dequantize(&Device::Cpu)?)
    }

    fn projection(
        &mut self,
        name: &str,
        target: LoraTarget,
        bias: bool,
        unpermute_heads: Option<usize>,
    ) -> Result<Projection> {
        let mut weight = self.qtensor(&format!("{name}.weight"))?;
        if let Some(heads) = unpermute_heads {
            weight = unpermute_rows(weight, heads)?;
        }
        let weight = self.base.weight(weight)?;
        let bias = if bias {
            let mut b = self.dense(&format!("{name}.bias"))?;
            if let Some(heads) = unpermute_heads {
                // A bias is a one-column weight: same row order.
                let column =
                    QTensor::quantize(&b.unsqueeze(1)?, candle_core::quantized::GgmlDType::F32)?;
                b = unpermute_rows(column, heads)?
                    .dequantize(&Device::Cpu)?
                    .squeeze(1)?;
            }
            Some(b)
        } else {
            None
        };
        Ok(Projection {
            weight,
            bias,
            target,
        })
    }
}

impl CausalLm {
    /// Loads a Llama, Qwen2 or Qwen3 GGUF file (tensor names as llama.cpp
    /// writes them: `token_embd`, `blk.N.attn_q`, ..., `blk.N.attn_q_norm`
    /// (Qwen3), `output_norm`, `output`, `rope_freqs` (Llama 3)). A tensor
    /// of the file that the model does not use is an error.
    pub fn load_gguf(path: &Path, base: GgufBase) -> Result<Self> {
        let mut file = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
        let content = gguf_file::Content::read(&mut file)
            .map_err(|e| ModelError::weights(path, e.to_string()))?;
        let mut config = config_from_gguf(&content)?;
        let permuted = config.architecture == Architecture::Llama;
        let q_heads = permuted.then_some(config.num_attention_heads);
        let k_heads = permuted.then_some(config.num_key_value_heads);
        let mut reader = Reader {
            content: &content,
            file: &mut file,
            path,
            base,
            read: Default::default(),
        };
        if content.tensor_infos.contains_key("rope_freqs.weight") {
            let divisors = reader
                .dense("rope_freqs.weight")?
                .flatten_all()?
                .to_vec1()?;
            config.rope_scaling = Some(RopeScaling::FrequencyDivisors(divisors));
            config.validate()?;
        }
        let embed_q = Arc::new(reader.qtensor("token_embd.weight")?);
        let embed = match base {
            GgufBase::Quantized | GgufBase::QMatMul8Bit => Embedding::Quantized(embed_q.clone()),
            GgufBase::Dequantized => Embedding::Dense(embed_q.dequantize(&Device::Cpu)?),
        };
        let mut blocks = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let p = format!("blk.{i}");
            blocks.push(Block {
                input_norm: reader.dense(&format!("{p}.attn_norm.weight"))?,
                q_proj: reader.projection(
                    &format!("{p}.attn_q"),
                    LoraTarget::QProj,
                    config.qkv_bias,
                    q_heads,
                )?,
                k_proj: reader.projection(
                    &format!("{p}.attn_k"),
                    LoraTarget::KProj,
                    config.qkv_bias,
                    k_heads,
                )?,
                v_proj: reader.projection(
                    &format!("{p}.attn_v"),
                    LoraTarget::VProj,
                    config.qkv_bias,
                    None,
                )?,
                o_proj: reader.projection(
                    &format!("{p}.attn_output"),
                    LoraTarget::OProj,
                    config.o_bias,
                    None,
                )?,
                qk_norm: if config.architecture.has_qk_norm() {
                    Some(QkNorm {
                        q: reader.dense(&format!("{p}.attn_q_norm.weight"))?,
                        k: reader.dense(&format!("{p}.attn_k_norm.weight"))?,
                    })
                } else {
                    None
                },
                post_attention_norm: reader.dense(&format!("{p}.ffn_norm.weight"))?,
                gate_proj: reader.projection(
                    &format!("{p}.ffn_gate"),
                    LoraTarget::GateProj,
                    config.mlp_bias,
                    None,
                )?,
                up_proj: reader.projection(
                    &format!("{p}.ffn_up"),
                    LoraTarget::UpProj,
                    config.mlp_bias,
                    None,
                )?,
                down_proj: reader.projection(
                    &format!("{p}.ffn_down"),
                    LoraTarget::DownProj,
                    config.mlp_bias,
                    None,
                )?,
            });
        }
        let final_norm = reader.dense("output_norm.weight")?;
        let head_weight = match (config.tie_word_embeddings, base, &embed) {
            (true, GgufBase::Quantized, _) => BaseWeight::Quantized(embed_q),
            (true, GgufBase::QMatMul8Bit, _) => BaseWeight::QMatMul(QMatMul::from_arc(embed_q)?),
            (true, GgufBase::Dequantized, Embedding::Dense(w)) => BaseWeight::Dense(w.clone()),
            (true, GgufBase::Dequantized, Embedding::Quantized(_)) => {
                unreachable!("a dequantized base has a dense embedding")
            }
            (false, _, _) => {
                reader
                    .projection("output", LoraTarget::DownProj, false, None)?
                    .weight
            }
        };
        reader.check_all_used(&config)?;
        let (rope_cos, rope_sin) = rope_tables(&config, &Device::Cpu)?;
        Ok(Self {
            config,
            embed,
            blocks,
            final_norm,
            lm_head: Projection {
                weight: head_weight,
                bias: None,
                target: LoraTarget::DownProj,
            },
            rope_cos,
            rope_sin,
            inference: Default::default(),
            backend: Default::default(),
            kv_pool: None,
        })
    }
}
