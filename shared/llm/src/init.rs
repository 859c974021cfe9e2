//! [`tiny`]: writes a small random Qwen2 checkpoint in Hugging Face's
//! layout (`config.json`, `model.safetensors`, `generation_config.json`),
//! small enough to train on two CPU cores, for tests and for `relay model
//! init`.
//!
//! The tokenizer is not written here: the tokenizer modules write
//! `tokenizer.json` and its config into the same folder, and hand this
//! module the vocabulary size and special token ids ([`TinyVocab`]), so the
//! embedding matrix and the tokenizer agree.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use serde_json::json;

use crate::config::{Architecture, ModelConfig};
use crate::lora::LoraTarget;
use crate::model_error::{ModelError, Result};

/// What the tokenizer decides: the vocabulary and its special tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TinyVocab {
    /// Number of token ids (rows of the embedding matrix); the tokenizer's
    /// vocabulary including its added special tokens.
    pub size: usize,
    /// Beginning-of-sequence token, if the tokenizer has one.
    pub bos_token_id: Option<u32>,
    /// Token that ends a generation (ChatML's `<|im_end|>` for a chat model).
    pub eos_token_id: Option<u32>,
    /// Padding token, if the tokenizer names one.
    pub pad_token_id: Option<u32>,
}

/// The shape of the tiny model (everything but the vocabulary).
#[derive(Debug, Clone, PartialEq)]
pub struct TinyShape {
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the gated MLP's inner layer.
    pub intermediate_size: usize,
    /// Number of transformer blocks.
    pub num_hidden_layers: usize,
    /// Query heads per layer (must divide `hidden_size`).
    pub num_attention_heads: usize,
    /// Key/value heads per layer (must divide `num_attention_heads`).
    pub num_key_value_heads: usize,
    /// Longest sequence the model can take (prompt plus completion).
    pub max_position_embeddings: usize,
    /// Base of the rotary frequencies.
    pub rope_theta: f32,
    /// Standard deviation of the normal initialisation of every matrix
    /// (Hugging Face's `initializer_range`).
    pub initializer_range: f64,
}

impl Default for TinyShape {
    /// About 0.6 M parameters plus `vocab x 128` for the (tied)
    /// embeddings: a forward of a few hundred tokens takes milliseconds.
    fn default() -> Self {
        Self {
            hidden_size: 128,
            intermediate_size: 384,
            num_hidden_layers: 3,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            max_position_embeddings: 2048,
            rope_theta: 10_000.0,
            initializer_range: 0.02,
        }
    }
}

/// The config [`tiny_with_shape`] writes for this vocabulary and shape.
pub fn tiny_config(vocab: &TinyVocab, shape: &TinyShape) -> Result<ModelConfig> {
    if shape.num_attention_heads == 0
        || !shape.hidden_size.is_multiple_of(shape.num_attention_heads)
    {
        return Err(ModelError::config(
            "num_attention_heads",
            format!(
                "{} does not divide hidden_size {}",
                shape.num_attention_heads, shape.hidden_size
            ),
        ));
    }
    let config = ModelConfig {
        architecture: Architecture::Qwen2,
        vocab_size: vocab.size,
        hidden_size: shape.hidden_size,
        intermediate_size: shape.intermediate_size,
        num_hidden_layers: shape.num_hidden_layers,
        num_attention_heads: shape.num_attention_heads,
        num_key_value_heads: shape.num_key_value_heads,
        head_dim: shape.hidden_size / shape.num_attention_heads,
        max_position_embeddings: shape.max_position_embeddings,
        rope_theta: shape.rope_theta,
        rope_scaling: None,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: true,
        qkv_bias: true,
        o_bias: false,
        mlp_bias: false,
        bos_token_id: vocab.bos_token_id,
        eos_token_ids: vocab.eos_token_id.into_iter().collect(),
        pad_token_id: vocab.pad_token_id,
    };
    config.validate()?;
    for (field, id) in [
        ("bos_token_id", vocab.bos_token_id),
        ("eos_token_id", vocab.eos_token_id),
        ("pad_token_id", vocab.pad_token_id),
    ] {
        if let Some(id) = id.filter(|&id| id as usize >= vocab.size) {
            return Err(ModelError::config(
                field,
                format!("{id} is outside the vocabulary of {}", vocab.size),
            ));
        }
    }
    Ok(config)
}

/// Writes a random Qwen2 model of the default [`TinyShape`] into
/// `out_dir` (created if needed); the same seed writes the same weights.
/// Returns its config. Load it with [`crate::CausalLm::load_hf`].
pub fn tiny(out_dir: &Path, seed: u64, vocab: &TinyVocab) -> Result<ModelConfig> {
    tiny_with_shape(out_dir, seed, vocab, &TinyShape::default())
}

/// [`tiny`] with a chosen shape.
pub fn tiny_with_shape(
    out_dir: &Path,
    seed: u64,
    vocab: &TinyVocab,
    shape: &TinyShape,
) -> Result<ModelConfig> {
    let config = tiny_config(vocab, shape)?;
    let normal = Normal::new(0.0f32, shape.initializer_range as f32)
        .map_err(|e| ModelError::config("initializer_range", e.to_string()))?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut random = |rows: usize, cols: usize| -> Result<Tensor> {
        let data: Vec<f32> = (0..rows * cols).map(|_| normal.sample(&mut rng)).collect();
        Ok(Tensor::from_vec(data, (rows, cols), &Device::Cpu)?)
    };
    let ones = |n: usize| Tensor::ones(n, candle_core::DType::F32, &Device::Cpu);
    let zeros = |n: usize| Tensor::zeros(n, candle_core::DType::F32, &Device::Cpu);

    // Insertion order fixes the random draws, so a seed always gives the same model.
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    tensors.push((
        "model.embed_tokens.weight".into(),
        random(config.vocab_size, config.hidden_size)?,
    ));
    for layer in 0..config.num_hidden_layers {
        let prefix = format!("model.layers.{layer}");
        for target in LoraTarget::ALL {
            let (fan_in, fan_out) = crate::lora::target_dims(target, &config);
            let name = format!("{prefix}.{}.{}", target.parent(), target.module_name());
            tensors.push((format!("{name}.weight"), random(fan_out, fan_in)?));
            if matches!(
                target,
                LoraTarget::QProj | LoraTarget::KProj | LoraTarget::VProj
            ) {
                tensors.push((format!("{name}.bias"), zeros(fan_out)?));
            }
        }
        tensors.push((
            format!("{prefix}.input_layernorm.weight"),
            ones(config.hidden_size)?,
        ));
        tensors.push((
            format!("{prefix}.post_attention_layernorm.weight"),
            ones(config.hidden_size)?,
        ));
    }
    tensors.push(("model.norm.weight".into(), ones(config.hidden_size)?));

    std::fs::create_dir_all(out_dir).map_err(|e| ModelError::io(out_dir, e))?;
    let weights = out_dir.join("model.safetensors");
    let tmp = out_dir.join(".model.safetensors.tmp");
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(
        tensors.iter().map(|(n, t)| (n.as_str(), t)),
        Some(metadata),
        &tmp,
    )
    .map_err(|e| ModelError::weights(&weights, e.to_string()))?;
    std::fs::rename(&tmp, &weights).map_err(|e| ModelError::io(&weights, e))?;

    let generation = json!({
        "bos_token_id": vocab.bos_token_id,
        "eos_token_id": vocab.eos_token_id,
        "pad_token_id": vocab.pad_token_id,
    });
    write_json(&out_dir.join("generation_config.json"), &generation)?;
    write_json(&out_dir.join("config.json"), &config.to_hf_json()?)?;
    Ok(config)
}

fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|e| ModelError::json(path, e))?;
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, text).map_err(|e| ModelError::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| ModelError::io(path, e))
}
