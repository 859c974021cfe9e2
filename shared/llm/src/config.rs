//! The shape of a decoder-only transformer ([`ModelConfig`]), read from a
//! Hugging Face `config.json` (`model_type` "qwen2" or "llama") or built from
//! GGUF metadata, and written back as a `config.json`.
//!
//! Qwen2 and Llama share one architecture here: pre-norm RMSNorm blocks,
//! grouped-query attention with rotary embeddings (the "rotate half" layout
//! of Hugging Face), a SiLU-gated MLP. They differ only in the fields below
//! (q/k/v bias, tied embeddings, rope theta, head size).

use std::path::Path;

use serde_json::{json, Value};

use crate::model_error::{ModelError, Result};

/// Which Hugging Face family a checkpoint belongs to (its `model_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// `model_type: "qwen2"`: bias on q/k/v, none on o.
    Qwen2,
    /// `model_type: "llama"`: bias on all attention projections only when
    /// `attention_bias` is set.
    Llama,
}

impl Architecture {
    /// The `model_type` string of `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Qwen2 => "qwen2",
            Self::Llama => "llama",
        }
    }

    /// The `architectures[0]` string of `config.json`.
    pub fn hf_class(self) -> &'static str {
        match self {
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Llama => "LlamaForCausalLM",
        }
    }
}

/// Everything the model code needs to know about a checkpoint's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Qwen2 or Llama.
    pub architecture: Architecture,
    /// Rows of the embedding matrix (and of the LM head).
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the gated MLP's inner layer.
    pub intermediate_size: usize,
    /// Number of transformer blocks.
    pub num_hidden_layers: usize,
    /// Query heads per layer.
    pub num_attention_heads: usize,
    /// Key/value heads per layer (grouped-query attention when fewer than
    /// the query heads; must divide them).
    pub num_key_value_heads: usize,
    /// Size of one attention head (usually `hidden_size / num_attention_heads`).
    pub head_dim: usize,
    /// Longest sequence (prompt plus generated tokens) the rotary tables cover.
    pub max_position_embeddings: usize,
    /// Base of the rotary embedding frequencies.
    pub rope_theta: f32,
    /// Epsilon inside every RMSNorm.
    pub rms_norm_eps: f64,
    /// Whether the LM head reuses the token embedding matrix.
    pub tie_word_embeddings: bool,
    /// Whether q/k/v projections carry a bias (Qwen2: yes).
    pub qkv_bias: bool,
    /// Whether the attention output projection carries a bias.
    pub o_bias: bool,
    /// Whether the MLP projections carry a bias.
    pub mlp_bias: bool,
    /// Beginning-of-sequence token, if the model has one.
    pub bos_token_id: Option<u32>,
    /// Tokens that end generation.
    pub eos_token_ids: Vec<u32>,
    /// Padding token, if the model names one.
    pub pad_token_id: Option<u32>,
}

fn usize_field(v: &Value, field: &str) -> Result<usize> {
    v.get(field)
        .and_then(Value::as_u64)
        .map(|x| x as usize)
        .ok_or_else(|| ModelError::config(field, "missing or not a non-negative integer"))
}

fn opt_token(v: &Value, field: &str) -> Result<Option<u32>> {
    match v.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_u64()
            .map(|t| Some(t as u32))
            .ok_or_else(|| ModelError::config(field, format!("expected a token id, got {x}"))),
    }
}

impl ModelConfig {
    /// Query heads that share one key/value head.
    pub fn kv_group_size(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// Reads `config.json` from a model folder (or the file itself).
    pub fn from_hf_file(path: &Path) -> Result<Self> {
        let path = if path.is_dir() {
            path.join("config.json")
        } else {
            path.to_path_buf()
        };
        let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
        let value: Value = serde_json::from_str(&text).map_err(|e| ModelError::json(&path, e))?;
        Self::from_hf_json(&value)
    }

    /// Parses a Hugging Face `config.json` value.
    ///
    /// Rejects what the model code does not implement (other activations,
    /// rope scaling, sliding-window attention) rather than running it wrong.
    pub fn from_hf_json(v: &Value) -> Result<Self> {
        let model_type = v
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| ModelError::config("model_type", "missing"))?;
        let architecture = match model_type {
            "qwen2" => Architecture::Qwen2,
            "llama" => Architecture::Llama,
            other => {
                return Err(ModelError::config(
                    "model_type",
                    format!("`{other}` is not supported (qwen2 or llama)"),
                ))
            }
        };
        let act = v
            .get("hidden_act")
            .and_then(Value::as_str)
            .unwrap_or("silu");
        if act != "silu" {
            return Err(ModelError::config(
                "hidden_act",
                format!("`{act}` is not supported (silu)"),
            ));
        }
        for field in ["rope_scaling", "rope_parameters"] {
            if let Some(kind) = v
                .get(field)
                .and_then(|r| r.get("rope_type").or_else(|| r.get("type")))
                .and_then(Value::as_str)
            {
                if kind != "default" {
                    return Err(ModelError::config(
                        field,
                        format!("rope type `{kind}` is not supported (default)"),
                    ));
                }
            }
        }
        if v.get("use_sliding_window").and_then(Value::as_bool) == Some(true) {
            return Err(ModelError::config(
                "use_sliding_window",
                "sliding-window attention is not supported",
            ));
        }
        let hidden_size = usize_field(v, "hidden_size")?;
        let num_attention_heads = usize_field(v, "num_attention_heads")?;
        let num_key_value_heads = match v.get("num_key_value_heads") {
            None | Some(Value::Null) => num_attention_heads,
            Some(_) => usize_field(v, "num_key_value_heads")?,
        };
        let head_dim = match v.get("head_dim") {
            None | Some(Value::Null) => hidden_size / num_attention_heads.max(1),
            Some(_) => usize_field(v, "head_dim")?,
        };
        let rope_theta = v
            .get("rope_theta")
            .or_else(|| v.get("rope_parameters").and_then(|r| r.get("rope_theta")))
            .and_then(Value::as_f64)
            .unwrap_or(10_000.0) as f32;
        let eos_token_ids = match v.get("eos_token_id") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(ids)) => ids
                .iter()
                .map(|x| {
                    x.as_u64().map(|t| t as u32).ok_or_else(|| {
                        ModelError::config("eos_token_id", format!("not a token id: {x}"))
                    })
                })
                .collect::<Result<_>>()?,
            Some(_) => opt_token(v, "eos_token_id")?.into_iter().collect(),
        };
        let attention_bias = v.get("attention_bias").and_then(Value::as_bool);
        let (qkv_bias, o_bias) = match architecture {
            Architecture::Qwen2 => (true, false),
            Architecture::Llama => {
                let b = attention_bias.unwrap_or(false);
                (b, b)
            }
        };
        let config = Self {
            architecture,
            vocab_size: usize_field(v, "vocab_size")?,
            hidden_size,
            intermediate_size: usize_field(v, "intermediate_size")?,
            num_hidden_layers: usize_field(v, "num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            max_position_embeddings: usize_field(v, "max_position_embeddings")?,
            rope_theta,
            rms_norm_eps: v
                .get("rms_norm_eps")
                .and_then(Value::as_f64)
                .unwrap_or(1e-6),
            tie_word_embeddings: v
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            qkv_bias,
            o_bias,
            mlp_bias: v.get("mlp_bias").and_then(Value::as_bool).unwrap_or(false),
            bos_token_id: opt_token(v, "bos_token_id")?,
            eos_token_ids,
            pad_token_id: opt_token(v, "pad_token_id")?,
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks the invariants the model code relies on.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (field, value) in positive {
            if value == 0 {
                return Err(ModelError::config(field, "must be positive"));
            }
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(ModelError::config(
                "num_key_value_heads",
                format!(
                    "{} does not divide num_attention_heads {}",
                    self.num_key_value_heads, self.num_attention_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(ModelError::config(
                "head_dim",
                format!("{} is odd; rotary embeddings need pairs", self.head_dim),
            ));
        }
        if self.rope_theta.is_nan() || self.rope_theta <= 0.0 {
            return Err(ModelError::config("rope_theta", "must be positive"));
        }
        Ok(())
    }

    /// The config as a Hugging Face `config.json` value that transformers
    /// (and [`ModelConfig::from_hf_json`]) load.
    pub fn to_hf_json(&self) -> Value {
        let eos = match self.eos_token_ids.as_slice() {
            [] => Value::Null,
            [one] => json!(one),
            many => json!(many),
        };
        let mut v = json!({
            "architectures": [self.architecture.hf_class()],
            "model_type": self.architecture.model_type(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "torch_dtype": "float32",
            "use_cache": true,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
        });
        let obj = v.as_object_mut().expect("json! object");
        match self.architecture {
            Architecture::Qwen2 => {
                obj.insert("use_sliding_window".into(), json!(false));
                obj.insert("sliding_window".into(), Value::Null);
                obj.insert("max_window_layers".into(), json!(self.num_hidden_layers));
            }
            Architecture::Llama => {
                obj.insert("attention_bias".into(), json!(self.qkv_bias));
                obj.insert("mlp_bias".into(), json!(self.mlp_bias));
            }
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hf_json_round_trips() {
        let v = json!({
            "model_type": "llama", "vocab_size": 100, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 128,
            "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": true,
            "eos_token_id": [2, 3], "bos_token_id": 1, "rope_scaling": null
        });
        let c = ModelConfig::from_hf_json(&v).unwrap();
        assert_eq!(c.head_dim, 8);
        assert_eq!(c.eos_token_ids, vec![2, 3]);
        assert!(!c.qkv_bias);
        assert_eq!(ModelConfig::from_hf_json(&c.to_hf_json()).unwrap(), c);
    }

    #[test]
    fn unsupported_features_are_rejected() {
        let mut v = json!({
            "model_type": "llama", "vocab_size": 100, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "max_position_embeddings": 128,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0}
        });
        let err = ModelConfig::from_hf_json(&v).unwrap_err().to_string();
        assert!(err.contains("rope_scaling"), "{err}");
        v["rope_scaling"] = Value::Null;
        v["num_key_value_heads"] = json!(3);
        let err = ModelConfig::from_hf_json(&v).unwrap_err().to_string();
        assert!(err.contains("num_key_value_heads"), "{err}");
    }
}
