//! LoRA adapters in PEFT's on-disk format: a folder with
//! `adapter_config.json` and `adapter_model.safetensors`, tensors named
//! `base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`.
//!
//! What PEFT saves for a plain LoRA on a causal LM loads here, and what is
//! saved here loads in PEFT (`PeftModel.from_pretrained`). Features this
//! crate does not implement (DoRA, per-module rank/alpha patterns, layer
//! subsets, bias training, extra saved modules, regex targets) are rejected
//! with an error naming the field, never silently ignored.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use serde_json::{json, Value};

use crate::config::ModelConfig;
use crate::lora::{LoraAdapter, LoraConfig, LoraTarget};
use crate::model_error::{ModelError, Result};

/// File holding the adapter's hyperparameters.
pub const CONFIG_FILE: &str = "adapter_config.json";
/// File holding the adapter's tensors.
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";

fn is_empty_like(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) => true,
        Some(Value::Object(m)) => m.is_empty(),
        Some(Value::Array(a)) => a.is_empty(),
        Some(Value::Bool(b)) => !b,
        _ => false,
    }
}

/// Parses PEFT's `adapter_config.json` value.
pub fn lora_config_from_peft_json(v: &Value) -> Result<LoraConfig> {
    let peft_type = v.get("peft_type").and_then(Value::as_str).unwrap_or("LORA");
    if peft_type != "LORA" {
        return Err(ModelError::config(
            "peft_type",
            format!("`{peft_type}` is not supported (LORA)"),
        ));
    }
    for field in [
        "use_dora",
        "fan_in_fan_out",
        "rank_pattern",
        "alpha_pattern",
        "layers_to_transform",
        "modules_to_save",
        "lora_bias",
        "trainable_token_indices",
        "target_parameters",
        "layer_replication",
        "use_qalora",
        "use_bdlora",
    ] {
        if !is_empty_like(v.get(field)) {
            return Err(ModelError::config(
                field,
                format!("{} is not supported", v[field]),
            ));
        }
    }
    let bias = v.get("bias").and_then(Value::as_str).unwrap_or("none");
    if bias != "none" {
        return Err(ModelError::config(
            "bias",
            format!("`{bias}` is not supported (none)"),
        ));
    }
    let rank = v
        .get("r")
        .and_then(Value::as_u64)
        .ok_or_else(|| ModelError::config("r", "missing or not a positive integer"))?
        as usize;
    let alpha = v
        .get("lora_alpha")
        .and_then(Value::as_f64)
        .ok_or_else(|| ModelError::config("lora_alpha", "missing or not a number"))?;
    let targets = match v.get("target_modules") {
        Some(Value::Array(names)) => {
            let mut targets = names
                .iter()
                .map(|n| {
                    n.as_str()
                        .and_then(LoraTarget::from_module_name)
                        .ok_or_else(|| {
                            ModelError::config(
                                "target_modules",
                                format!("{n} is not one of the q/k/v/o/gate/up/down projections"),
                            )
                        })
                })
                .collect::<Result<Vec<_>>>()?;
            targets.sort();
            targets.dedup();
            targets
        }
        Some(Value::String(s)) if s == "all-linear" => LoraTarget::ALL.to_vec(),
        Some(Value::String(s)) => match LoraTarget::from_module_name(s) {
            Some(t) => vec![t],
            None => {
                return Err(ModelError::config(
                    "target_modules",
                    format!("regex `{s}` is not supported; list the module names"),
                ))
            }
        },
        _ => return Err(ModelError::config("target_modules", "missing")),
    };
    let config = LoraConfig {
        rank,
        alpha,
        dropout: v.get("lora_dropout").and_then(Value::as_f64).unwrap_or(0.0),
        targets,
        use_rslora: v
            .get("use_rslora")
            .and_then(Value::as_bool)
            .unwrap_or(false),
    };
    config.validate()?;
    Ok(config)
}

/// The `adapter_config.json` value PEFT needs to load an adapter with
/// this config (a plain LoRA for a causal LM, inference mode).
pub fn lora_config_to_peft_json(config: &LoraConfig, base_model: Option<&str>) -> Value {
    let targets: Vec<&str> = config.targets.iter().map(|t| t.module_name()).collect();
    json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": targets,
        "use_rslora": config.use_rslora,
        "use_dora": false,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "modules_to_save": null,
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": null,
    })
}

/// Loads a PEFT LoRA adapter folder for a model of shape `model`.
pub fn load_adapter(dir: &Path, model: &ModelConfig) -> Result<LoraAdapter> {
    let config_path = dir.join(CONFIG_FILE);
    let text =
        std::fs::read_to_string(&config_path).map_err(|e| ModelError::io(&config_path, e))?;
    let weights_path = dir.join(WEIGHTS_FILE);
    let bytes = std::fs::read(&weights_path).map_err(|e| ModelError::io(&weights_path, e))?;
    adapter_from_parts(&text, &bytes, model, &config_path, &weights_path)
}

/// Loads a PEFT LoRA adapter from the contents of its two files
/// (`adapter_config.json` text, `adapter_model.safetensors` bytes), e.g.
/// received over the network. Errors name the files as `<memory>/...`.
pub fn load_adapter_from_bytes(
    config_json: &str,
    safetensors: &[u8],
    model: &ModelConfig,
) -> Result<LoraAdapter> {
    let memory = Path::new("<memory>");
    adapter_from_parts(
        config_json,
        safetensors,
        model,
        &memory.join(CONFIG_FILE),
        &memory.join(WEIGHTS_FILE),
    )
}

fn adapter_from_parts(
    config_json: &str,
    safetensors: &[u8],
    model: &ModelConfig,
    config_path: &Path,
    weights_path: &Path,
) -> Result<LoraAdapter> {
    let value: Value =
        serde_json::from_str(config_json).map_err(|e| ModelError::json(config_path, e))?;
    let config = lora_config_from_peft_json(&value).map_err(|e| match e {
        ModelError::Config { field, reason } => {
            ModelError::json(config_path, format!("`{field}`: {reason}"))
        }
        other => other,
    })?;
    let tensors = candle_core::safetensors::load_buffer(safetensors, &Device::Cpu)
        .map_err(|e| ModelError::weights(weights_path, e.to_string()))?;
    // PEFT saves without the adapter name; accept files that kept it.
    let tensors: HashMap<String, Tensor> = tensors
        .into_iter()
        .map(|(name, t)| (name.replace(".default.weight", ".weight"), t))
        .collect();
    LoraAdapter::from_named_tensors(model, config, tensors).map_err(|e| match e {
        ModelError::Config { field, reason } => {
            ModelError::weights(weights_path, format!("`{field}`: {reason}"))
        }
        other => other,
    })
}

/// Saves `adapter` as a PEFT adapter folder (created if needed). Files are
/// written beside their final names and renamed into place, so a crash
/// never leaves a half-written adapter under the real names.
/// `base_model` fills `base_model_name_or_path`.
pub fn save_adapter(adapter: &LoraAdapter, dir: &Path, base_model: Option<&str>) -> Result<()> {
    crate::to_peft_bytes(adapter, base_model)?.save(dir)
}

impl LoraAdapter {
    /// Loads a PEFT adapter folder (see [`load_adapter`]).
    pub fn load_peft(dir: &Path, model: &ModelConfig) -> Result<Self> {
        load_adapter(dir, model)
    }

    /// Loads a PEFT adapter from its files' contents (see
    /// [`load_adapter_from_bytes`]).
    pub fn from_peft_bytes(
        config_json: &str,
        safetensors: &[u8],
        model: &ModelConfig,
    ) -> Result<Self> {
        load_adapter_from_bytes(config_json, safetensors, model)
    }

    /// Saves as a PEFT adapter folder (see [`save_adapter`]).
    pub fn save_peft(&self, dir: &Path, base_model: Option<&str>) -> Result<()> {
        save_adapter(self, dir, base_model)
    }
}
