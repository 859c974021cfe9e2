//! The weights of a Hugging Face model folder ([`HfWeights`]):
//! `model.safetensors`, or the shards that `model.safetensors.index.json`
//! lists, as the Hub holds them (bf16, f16 or f32).
//!
//! The files are memory-mapped and each tensor is read in the dtype and
//! onto the device the model asks for when it asks, so a checkpoint of
//! billions of parameters is never held twice (once as read, once
//! converted), and a bf16 checkpoint goes to a bf16 GPU model as bf16.
//! Every name the model asks for is recorded, and a tensor of the files that it never asked
//! for is an error naming it: a checkpoint of an architecture that the
//! model code only partly implements (Qwen3's `q_norm` read as Llama)
//! must fail to load, not run without that weight.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;

use crate::config::ModelConfig;
use crate::model_error::{ModelError, Result};

/// The memory-mapped safetensors files of one model folder.
pub(crate) struct HfWeights {
    dir: PathBuf,
    files: MmapedSafetensors,
}

/// The tensor names a [`HfWeights::var_builder`] was asked for.
pub(crate) type ReadNames = Arc<Mutex<HashSet<String>>>;

impl HfWeights {
    /// Maps the folder's safetensors files.
    pub(crate) fn open(dir: &Path) -> Result<Self> {
        let files = safetensors_files(dir)?;
        // SAFETY: the files are mapped read-only; like every safetensors
        // loader that maps (candle's, transformers'), this assumes nobody
        // rewrites a checkpoint while a model is being loaded from it.
        let files = unsafe { MmapedSafetensors::multi(&files) }
            .map_err(|e| ModelError::weights(dir, e.to_string()))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            files,
        })
    }

    /// One tensor in its stored dtype, on `device`.
    pub(crate) fn load(&self, name: &str, device: &Device) -> Result<Tensor> {
        self.files
            .load(name, device)
            .map_err(|e| ModelError::weights(&self.dir, format!("tensor `{name}`: {e}")))
    }

    /// A `VarBuilder` that reads these tensors in `dtype` on `device` (each
    /// copied to the device as stored, then converted there), and the set
    /// of names it was asked for (for [`HfWeights::check_all_used`]).
    pub(crate) fn var_builder(&self, dtype: DType, device: &Device) -> (VarBuilder<'_>, ReadNames) {
        let read = ReadNames::default();
        let backend = Recording {
            files: &self.files,
            read: read.clone(),
        };
        (
            VarBuilder::from_backend(Box::new(backend), dtype, device.clone()),
            read,
        )
    }

    /// Fails naming the tensors of the files for which `used` is false.
    /// Tolerated: rotary `inv_freq` buffers (derived from the config; old
    /// checkpoints store them) and `lm_head.weight` of a model with tied
    /// embeddings (transformers ties it to the embeddings too).
    pub(crate) fn check_all_used(
        &self,
        config: &ModelConfig,
        used: impl Fn(&str) -> bool,
    ) -> Result<()> {
        let mut unused: Vec<String> = self
            .files
            .tensors()
            .into_iter()
            .map(|(name, _)| name)
            .filter(|name| {
                let tolerated = name.ends_with(".rotary_emb.inv_freq")
                    || (config.tie_word_embeddings && name == "lm_head.weight");
                !(used(name) || tolerated)
            })
            .collect();
        if unused.is_empty() {
            return Ok(());
        }
        unused.sort();
        let shown: Vec<&str> = unused.iter().take(5).map(String::as_str).collect();
        Err(ModelError::weights(
            &self.dir,
            format!(
                "{} tensor(s) that a `{}` model as configured does not use, e.g. {} (a different architecture, or a config.json that does not match the weights)",
                unused.len(),
                config.architecture.model_type(),
                shown.join(", ")
            ),
        ))
    }
}

/// The mapped files as a `VarBuilder` backend that records every name read.
struct Recording<'a> {
    files: &'a MmapedSafetensors,
    read: ReadNames,
}

impl Recording<'_> {
    fn record(&self, name: &str) {
        self.read
            .lock()
            .expect("read-names lock")
            .insert(name.to_owned());
    }
}

impl SimpleBackend for Recording<'_> {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        init: candle_nn::Init,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        self.record(name);
        SimpleBackend::get(self.files, shape, name, init, dtype, device)
    }

    fn get_unchecked(
        &self,
        name: &str,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        self.record(name);
        SimpleBackend::get_unchecked(self.files, name, dtype, device)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        SimpleBackend::contains_tensor(self.files, name)
    }
}

/// The safetensors files of a Hugging Face model folder.
fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index).map_err(|e| {
        ModelError::weights(
            dir,
            format!("neither model.safetensors nor model.safetensors.index.json is readable: {e}"),
        )
    })?;
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| ModelError::json(&index, e))?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| ModelError::json(&index, "no `weight_map` object"))?;
    let mut files: Vec<String> = map
        .values()
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect();
    files.sort();
    files.dedup();
    Ok(files.into_iter().map(|f| dir.join(f)).collect())
}
