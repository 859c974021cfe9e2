//! A LoRA adapter as the two files of a PEFT folder, in memory: what the
//! learner publishes (inline in an `AdapterUpdate`, or as objects of the
//! object store) without writing a folder first.
//! [`crate::LoraAdapter::from_peft_bytes`] reads them back.

use std::collections::HashMap;

use candle_core::DType;

use std::path::Path;

use crate::lora::LoraAdapter;
use crate::model_error::{ModelError, Result};
use crate::peft::{lora_config_to_peft_json, CONFIG_FILE, WEIGHTS_FILE};

/// The contents of `adapter_config.json` and `adapter_model.safetensors`.
#[derive(Debug, Clone, PartialEq)]
pub struct PeftBytes {
    pub config_json: String,
    pub safetensors: Vec<u8>,
}

impl PeftBytes {
    /// Bytes of both files.
    pub fn len(&self) -> usize {
        self.config_json.len() + self.safetensors.len()
    }

    /// Whether both files are empty (never, for a valid adapter).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Writes both files into folder `dir` (created if needed), each
    /// beside its final name and renamed into place, so a crash never
    /// leaves a half-written adapter under the real names.
    pub fn save(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
        for (file, bytes) in [
            (WEIGHTS_FILE, self.safetensors.as_slice()),
            (CONFIG_FILE, self.config_json.as_bytes()),
        ] {
            let path = dir.join(file);
            let tmp = dir.join(format!(".{file}.tmp"));
            std::fs::write(&tmp, bytes).map_err(|e| ModelError::io(&tmp, e))?;
            std::fs::rename(&tmp, &path).map_err(|e| ModelError::io(&path, e))?;
        }
        Ok(())
    }
}

/// Serialises `adapter` as PEFT saves it (`base_model` fills
/// `base_model_name_or_path`); what [`crate::peft::save_adapter`] writes
/// writes.
pub fn to_peft_bytes(adapter: &LoraAdapter, base_model: Option<&str>) -> Result<PeftBytes> {
    let tensors: Vec<(String, candle_core::Tensor)> = adapter
        .named_vars()
        .into_iter()
        .map(|(name, var)| Ok((name, var.as_tensor().to_dtype(DType::F32)?.contiguous()?)))
        .collect::<Result<_>>()?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let safetensors =
        safetensors::serialize(tensors.iter().map(|(n, t)| (n.as_str(), t)), Some(metadata))
            .map_err(|e| ModelError::weights(std::path::Path::new("<memory>"), e.to_string()))?;
    let config_json =
        serde_json::to_string_pretty(&lora_config_to_peft_json(adapter.config(), base_model))
            .expect("a JSON value serialises");
    Ok(PeftBytes {
        config_json,
        safetensors,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LoraConfig, ModelConfig};

    fn tiny_config() -> ModelConfig {
        let dir = relay_testkit::llm_fixture("tiny-qwen2");
        ModelConfig::from_hf_file(&dir.join("config.json")).unwrap()
    }

    #[test]
    fn bytes_round_trip_and_match_the_saved_folder() {
        let model = tiny_config();
        let adapter = LoraAdapter::new(&model, LoraConfig::all_projections(4, 8.0), 3).unwrap();
        let bytes = to_peft_bytes(&adapter, Some("tiny")).unwrap();
        let back =
            LoraAdapter::from_peft_bytes(&bytes.config_json, &bytes.safetensors, &model).unwrap();
        let (values, back_values) = (
            adapter.named_values().unwrap(),
            back.named_values().unwrap(),
        );
        assert_eq!(values.len(), adapter.named_vars().len());
        assert_eq!(values, back_values);
        let dir = std::env::temp_dir().join(format!("relay-peft-bytes-{}", std::process::id()));
        adapter.save_peft(&dir, Some("tiny")).unwrap();
        let saved = std::fs::read(dir.join(crate::peft::WEIGHTS_FILE)).unwrap();
        let saved_config = std::fs::read_to_string(dir.join(crate::peft::CONFIG_FILE)).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(saved, bytes.safetensors);
        assert_eq!(saved_config, bytes.config_json);
    }
}
