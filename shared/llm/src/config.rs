//! The shape of a decoder-only transformer ([`ModelConfig`]), read from a
//! Hugging Face `config.json` (`model_type` "qwen2", "qwen3" or "llama") or
//! built from GGUF metadata, and written back as a `config.json`.
//!
//! Qwen2, Qwen3 and Llama (2 and 3.x) share one architecture here:
//! pre-norm RMSNorm blocks, grouped-query attention with rotary embeddings
//! (the "rotate half" layout of Hugging Face), a SiLU-gated MLP. They differ
//! only in the fields below (q/k/v bias, Qwen3's per-head RMSNorm on q and
//! k, tied embeddings, rope theta and scaling, head size).
//!
//! transformers writes the rotary settings in two forms: version 4 (what
//! the Hub's Qwen3 and Llama 3 repositories hold) as top-level
//! `rope_theta` and `rope_scaling`, version 5 as one `rope_parameters`
//! object. Both are read. Any field that would change the forward pass
//! and that the model code does not implement is refused by name, never
//! skipped.

use std::path::Path;

use serde_json::{json, Value};

use crate::model_error::{ModelError, Result};

/// Which Hugging Face family a checkpoint belongs to (its `model_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// `model_type: "qwen2"`: bias on q/k/v, none on o.
    Qwen2,
    /// `model_type: "qwen3"`: per-head RMSNorm on q and k before RoPE
    /// (`q_norm`, `k_norm`); bias on all attention projections only when
    /// `attention_bias` is set.
    Qwen3,
    /// `model_type: "llama"`: bias on all attention projections only when
    /// `attention_bias` is set.
    Llama,
}

impl Architecture {
    /// The `model_type` string of `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Llama => "llama",
        }
    }

    /// The `architectures[0]` string of `config.json`.
    pub fn hf_class(self) -> &'static str {
        match self {
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
            Self::Llama => "LlamaForCausalLM",
        }
    }

    /// Whether each attention head's queries and keys go through an
    /// RMSNorm of `head_dim` before RoPE (Qwen3's `q_norm`, `k_norm`).
    pub fn has_qk_norm(self) -> bool {
        self == Self::Qwen3
    }
}

/// How the rotary frequencies are rescaled for contexts longer than the
/// model was pre-trained on.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Llama 3.1's frequency-dependent scaling (`rope_type: llama3`):
    /// wavelengths longer than `original_max_position_embeddings /
    /// low_freq_factor` are stretched by `factor`, those shorter than
    /// `original_max_position_embeddings / high_freq_factor` are kept, and
    /// the band between is interpolated.
    Llama3 {
        /// How much the long wavelengths are stretched.
        factor: f32,
        /// Wavelengths above `original / low_freq_factor` get the full factor.
        low_freq_factor: f32,
        /// Wavelengths below `original / high_freq_factor` are unchanged.
        high_freq_factor: f32,
        /// The context length of pre-training.
        original_max_position_embeddings: usize,
    },
    /// One divisor per rotary frequency, as llama.cpp stores Llama 3's
    /// scaling in a GGUF file (`rope_freqs.weight`): frequency `i` is
    /// `theta^(-2i/head_dim) / divisors[i]`.
    FrequencyDivisors(Vec<f32>),
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
    /// Rescaling of the rotary frequencies (Llama 3.x), if any.
    pub rope_scaling: Option<RopeScaling>,
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

/// Refuses the config fields that change the forward pass in ways the
/// model code does not implement (the rotary settings are read apart, by
/// [`rope_settings`]).
fn refuse_unimplemented(v: &Value) -> Result<()> {
    if v.get("use_sliding_window").and_then(Value::as_bool) == Some(true) {
        return Err(ModelError::config(
            "use_sliding_window",
            "sliding-window attention is not supported",
        ));
    }
    if let Some(types) = v.get("layer_types").and_then(Value::as_array) {
        if let Some(other) = types.iter().find(|t| t.as_str() != Some("full_attention")) {
            return Err(ModelError::config(
                "layer_types",
                format!("layer type {other} is not supported (full_attention)"),
            ));
        }
    }
    if v.get("quantization_config").is_some_and(|q| !q.is_null()) {
        return Err(ModelError::config(
            "quantization_config",
            "quantized safetensors checkpoints are not supported (use bf16/f16/f32 weights, or a GGUF file)",
        ));
    }
    if let Some(f) = v.get("partial_rotary_factor").and_then(Value::as_f64) {
        if f != 1.0 {
            return Err(ModelError::config(
                "partial_rotary_factor",
                format!("{f} is not supported (1.0: RoPE on the whole head)"),
            ));
        }
    }
    for field in ["attn_logit_softcapping", "final_logit_softcapping"] {
        if v.get(field).is_some_and(|x| !x.is_null()) {
            return Err(ModelError::config(
                field,
                "logit soft-capping is not supported",
            ));
        }
    }
    Ok(())
}

/// `(rope_theta, rope_scaling)` from either form transformers writes:
/// version 5's `rope_parameters` object, or version 4's top-level
/// `rope_theta` and `rope_scaling`. A rope type, or a key of its
/// parameters, that the model code does not implement is refused.
fn rope_settings(v: &Value) -> Result<(f32, Option<RopeScaling>)> {
    let present = |field: &str| v.get(field).filter(|x| !x.is_null());
    let kind_of = |params: &Value| -> String {
        params
            .get("rope_type")
            .or_else(|| params.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default")
            .to_owned()
    };
    let (field, params) = match (present("rope_parameters"), present("rope_scaling")) {
        (Some(params), Some(legacy)) => {
            if kind_of(params) != kind_of(legacy) {
                return Err(ModelError::config(
                    "rope_scaling",
                    format!(
                        "rope type `{}` disagrees with rope_parameters' `{}`",
                        kind_of(legacy),
                        kind_of(params)
                    ),
                ));
            }
            ("rope_parameters", Some(params))
        }
        (Some(params), None) => ("rope_parameters", Some(params)),
        (None, legacy) => ("rope_scaling", legacy),
    };
    let theta = params
        .and_then(|p| p.get("rope_theta"))
        .or_else(|| present("rope_theta"));
    let rope_theta = match theta {
        None => 10_000.0,
        Some(x) => x
            .as_f64()
            .ok_or_else(|| ModelError::config("rope_theta", format!("not a number: {x}")))?
            as f32,
    };
    let Some(params) = params else {
        return Ok((rope_theta, None));
    };
    let obj = params
        .as_object()
        .ok_or_else(|| ModelError::config(field, format!("expected an object, got {params}")))?;
    let kind = kind_of(params);
    let keys: &[&str] = match kind.as_str() {
        "default" => &["rope_type", "type", "rope_theta"],
        "llama3" => &[
            "rope_type",
            "type",
            "rope_theta",
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ],
        other => {
            return Err(ModelError::config(
                field,
                format!("rope type `{other}` is not supported (default or llama3)"),
            ))
        }
    };
    if let Some(extra) = obj.keys().find(|k| !keys.contains(&k.as_str())) {
        return Err(ModelError::config(
            field,
            format!("`{extra}` is not supported with rope type `{kind}`"),
        ));
    }
    if kind == "default" {
        return Ok((rope_theta, None));
    }
    let number = |key: &str| {
        obj.get(key)
            .and_then(Value::as_f64)
            .ok_or_else(|| ModelError::config(field, format!("`{key}` missing or not a number")))
    };
    let scaling = RopeScaling::Llama3 {
        factor: number("factor")? as f32,
        low_freq_factor: number("low_freq_factor")? as f32,
        high_freq_factor: number("high_freq_factor")? as f32,
        original_max_position_embeddings: number("original_max_position_embeddings")? as usize,
    };
    Ok((rope_theta, Some(scaling)))
}

impl ModelConfig {
    /// Query heads that share one key/value head.
    pub fn kv_group_size(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// The `head_dim / 2` rotary frequencies, computed in f32 as
    /// transformers computes them (so logits match it to float precision),
    /// after [`ModelConfig::rope_scaling`].
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let dim = self.head_dim as f32;
        let base = (0..self.head_dim / 2).map(|i| 1.0 / self.rope_theta.powf((2 * i) as f32 / dim));
        match &self.rope_scaling {
            None => base.collect(),
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: original,
            }) => {
                let original = *original as f32;
                let (low_wavelen, high_wavelen) = (original / low, original / high);
                base.map(|f| {
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (original / wavelen - low) / (high - low);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
            }
            Some(RopeScaling::FrequencyDivisors(divisors)) => {
                base.zip(divisors).map(|(f, d)| f / d).collect()
            }
        }
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
            "qwen3" => Architecture::Qwen3,
            "llama" => Architecture::Llama,
            other => {
                return Err(ModelError::config(
                    "model_type",
                    format!("`{other}` is not supported (qwen2, qwen3 or llama)"),
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
        refuse_unimplemented(v)?;
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
        let (rope_theta, rope_scaling) = rope_settings(v)?;
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
            Architecture::Qwen3 | Architecture::Llama => {
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
            rope_scaling,
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
        let positive = |x: f32| x.is_finite() && x > 0.0;
        match &self.rope_scaling {
            None => {}
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                let valid = positive(*factor)
                    && positive(*low_freq_factor)
                    && positive(*high_freq_factor - *low_freq_factor)
                    && *original_max_position_embeddings > 0;
                if !valid {
                    return Err(ModelError::config(
                        "rope_scaling",
                        format!(
                            "llama3 scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor and original_max_position_embeddings > 0 (got {factor}, {low_freq_factor}, {high_freq_factor}, {original_max_position_embeddings})"
                        ),
                    ));
                }
            }
            Some(RopeScaling::FrequencyDivisors(divisors))
                if divisors.len() != self.head_dim / 2
                    || !divisors.iter().all(|&d| positive(d)) =>
            {
                return Err(ModelError::config(
                    "rope_freqs",
                    format!(
                        "expected {} positive divisors, got {divisors:?}",
                        self.head_dim / 2
                    ),
                ));
            }
            Some(RopeScaling::FrequencyDivisors(_)) => {}
        }
        Ok(())
    }

    /// The config as a Hugging Face `config.json` value that transformers
    /// (and [`ModelConfig::from_hf_json`]) load, in transformers 4's form
    /// (top-level `rope_theta` and `rope_scaling`), which version 5 reads
    /// too. Fails for rotary divisors read from a GGUF file, which
    /// `config.json` cannot express.
    pub fn to_hf_json(&self) -> Result<Value> {
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
        let rope_scaling = match &self.rope_scaling {
            None => Value::Null,
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => json!({
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original_max_position_embeddings,
            }),
            Some(RopeScaling::FrequencyDivisors(_)) => {
                return Err(ModelError::config(
                    "rope_scaling",
                    "per-frequency rotary divisors (from a GGUF file) have no config.json form",
                ))
            }
        };
        obj.insert("rope_scaling".into(), rope_scaling);
        match self.architecture {
            Architecture::Qwen2 | Architecture::Qwen3 => {
                obj.insert("use_sliding_window".into(), json!(false));
                obj.insert("sliding_window".into(), Value::Null);
                obj.insert("max_window_layers".into(), json!(self.num_hidden_layers));
            }
            Architecture::Llama => {}
        }
        if self.architecture != Architecture::Qwen2 {
            obj.insert("attention_bias".into(), json!(self.qkv_bias));
        }
        if self.architecture == Architecture::Llama {
            obj.insert("mlp_bias".into(), json!(self.mlp_bias));
        }
        Ok(v)
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
        assert_eq!(
            ModelConfig::from_hf_json(&c.to_hf_json().unwrap()).unwrap(),
            c
        );
    }

    fn llama3_fields() -> Value {
        json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    }

    /// transformers 4 writes `rope_theta` and `rope_scaling` at the top
    /// level, transformers 5 one `rope_parameters` object: the same model.
    #[test]
    fn both_forms_of_the_rotary_settings_read_the_same() {
        let mut v4 = json!({
            "model_type": "llama", "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "max_position_embeddings": 128, "rope_theta": 500000.0,
            "rope_scaling": llama3_fields()
        });
        let mut v5 = v4.clone();
        v5.as_object_mut().unwrap().remove("rope_theta");
        v5.as_object_mut().unwrap().remove("rope_scaling");
        let mut params = llama3_fields();
        params["rope_theta"] = json!(500000.0);
        v5["rope_parameters"] = params;
        let (a, b) = (
            ModelConfig::from_hf_json(&v4).unwrap(),
            ModelConfig::from_hf_json(&v5).unwrap(),
        );
        assert_eq!(a, b);
        assert_eq!(a.rope_theta, 500000.0);
        assert!(
            matches!(a.rope_scaling, Some(RopeScaling::Llama3 { factor, .. }) if factor == 8.0)
        );
        assert_eq!(
            ModelConfig::from_hf_json(&a.to_hf_json().unwrap()).unwrap(),
            a
        );
        // Scaling leaves the high frequencies and divides the low ones by the factor.
        let plain = ModelConfig {
            rope_scaling: None,
            ..a.clone()
        }
        .rope_inv_freq();
        let scaled = a.rope_inv_freq();
        assert_eq!(scaled[0], plain[0]);
        let last = plain.len() - 1;
        assert!((scaled[last] - plain[last] / 8.0).abs() < 1e-12);
        // A key of the scaling that would change the frequencies is refused.
        v4["rope_scaling"]["attention_factor"] = json!(0.5);
        let err = ModelConfig::from_hf_json(&v4).unwrap_err().to_string();
        assert!(err.contains("attention_factor"), "{err}");
    }

    #[test]
    fn qwen3_reads_its_head_dim_and_writes_back() {
        let v = json!({
            "model_type": "qwen3", "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 24, "max_position_embeddings": 128,
            "rope_theta": 1000000.0, "rope_scaling": null, "attention_bias": false,
            "use_sliding_window": false, "sliding_window": null
        });
        let c = ModelConfig::from_hf_json(&v).unwrap();
        assert_eq!(c.architecture, Architecture::Qwen3);
        assert!(c.architecture.has_qk_norm());
        assert_eq!(c.head_dim, 24);
        assert!(!c.qkv_bias && !c.o_bias);
        assert_eq!(
            ModelConfig::from_hf_json(&c.to_hf_json().unwrap()).unwrap(),
            c
        );
    }

    #[test]
    fn unsupported_features_are_rejected() {
        let mut v = json!({
            "model_type": "llama", "vocab_size": 100, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "max_position_embeddings": 128,
            "rope_scaling": {"rope_type": "yarn", "factor": 8.0}
        });
        let err = ModelConfig::from_hf_json(&v).unwrap_err().to_string();
        assert!(
            err.contains("rope_scaling") && err.contains("yarn"),
            "{err}"
        );
        v["rope_scaling"] = Value::Null;
        v["model_type"] = json!("gemma");
        let err = ModelConfig::from_hf_json(&v).unwrap_err().to_string();
        assert!(err.contains("gemma"), "{err}");
        v["model_type"] = json!("llama");
        v["quantization_config"] = json!({"quant_method": "fp8"});
        let err = ModelConfig::from_hf_json(&v).unwrap_err().to_string();
        assert!(err.contains("quantization_config"), "{err}");
        v["quantization_config"] = Value::Null;
        v["num_key_value_heads"] = json!(3);
        let err = ModelConfig::from_hf_json(&v).unwrap_err().to_string();
        assert!(err.contains("num_key_value_heads"), "{err}");
    }
}
