//! The `llm` section: which language model a text run serves and trains,
//! and on which backend, device and dtype.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::check::{invalid, positive, ConfigError};

/// How the inference server holds a GGUF model's weights (see
/// `relay_llm::GgufBase`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", try_from = "String")]
pub enum GgufBaseName {
    /// Quantized blocks in memory, dequantized for each product: the least
    /// memory, slower decode steps.
    Quantized,
    /// Dequantized to f32 once at load: about 4x the memory of Q4, the
    /// fastest decode steps on a CPU.
    Dequantized,
}

impl TryFrom<String> for GgufBaseName {
    type Error = String;
    /// serde's own error would not name the field.
    fn try_from(value: String) -> Result<Self, String> {
        match value.as_str() {
            "quantized" => Ok(Self::Quantized),
            "dequantized" => Ok(Self::Dequantized),
            other => Err(format!(
                "llm.gguf_base: {other:?} is neither `quantized` nor `dequantized`"
            )),
        }
    }
}

/// The LLM the inference server serves on `relay.<run>.generate` (text
/// games): the base model, its adapters and the continuous batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LlmConfig {
    /// The base model: a Hugging Face folder (`config.json`,
    /// `model.safetensors`, `tokenizer.json`; e.g. one written by `relay
    /// model init tiny`), a `.gguf` file, or `smollm2` for
    /// SmolLM2-135M-Instruct as `deploy/install.sh` installs it. Unset: no
    /// `generate` endpoint unless `run.env_id` is a text game (then it is
    /// required).
    pub model: Option<String>,
    /// How a GGUF model's weights are held (ignored for other models).
    pub gguf_base: GgufBaseName,
    /// Most sequences decoded together (the continuous batch); requests
    /// beyond it wait in a queue and join as others finish.
    pub max_sequences: usize,
    /// Most generate requests waiting for a place in the continuous batch;
    /// a request arriving when this many wait is refused at once with a
    /// 503 service error "queue full (N waiting)"
    /// (`relay_llm_queue_full_total`) instead of waiting without bound.
    pub max_queue: usize,
    /// Most LoRA adapters (name, version) kept loaded; the least recently
    /// used is dropped past it and reloaded from its source when asked for.
    pub max_adapters: usize,
    /// Fixed adapters (e.g. opponents), name -> PEFT adapter folder;
    /// served as version 0 of that name.
    pub adapters: std::collections::BTreeMap<String, PathBuf>,
    /// Compute threads (candle/rayon) of the inference server when it serves
    /// an LLM (it then replaces `inference.threads`).
    pub threads: usize,
    /// Recent prompts whose keys and values are kept, so a new prompt that
    /// shares a prefix of 16 tokens or more with one (a game's
    /// instructions, the earlier turns of a game) prefills only the rest;
    /// 0 disables it. Memory: prompt tokens x layers x 2 x kv width x 4 bytes
    /// each (SmolLM2: 46 KB per token).
    pub prefix_cache: usize,
    /// Most MiB of keys and values the `candle` backend's paged KV pool may
    /// hold (running sequences and cached prefixes together; Qwen3-0.6B in
    /// bf16: 112 KiB per token). A request is admitted only while the
    /// pool can hold its prompt and every token it may generate beside
    /// what the running sequences may still take; cached prefixes are
    /// dropped first to make room, and a request that could never fit is
    /// refused with the numbers. 0: no bound but `max_sequences` and the
    /// device's memory. The CPU engine keeps host caches of its own and
    /// refuses a bound.
    pub kv_cache_mib: usize,
    /// What computes the LLM, in the inference servers and the learner of a
    /// text run: `engine` (the tuned CPU engine, f32), `candle` (candle
    /// tensor ops on `device` in `dtype`: the path to a GPU), or `auto`
    /// (the default: the engine for f32 on the CPU, candle otherwise, so
    /// `llm.device: cuda` alone is enough).
    pub backend: crate::hyper::backend::BackendKind,
    /// Where the `candle` backend computes: `cpu`, `cuda` (GPU 0) or
    /// `cuda:N`; CUDA needs a build with the `cuda` feature (`just
    /// build-cuda`) and the NVIDIA driver.
    pub device: crate::hyper::backend::DeviceSpec,
    /// The `candle` backend's weights and matmuls: `f32`, `bf16` or `f16`
    /// (norms, softmax and logits stay f32).
    pub dtype: crate::hyper::backend::LlmDtype,
    /// Extra variables of the model's chat template, passed to every
    /// rendering of a prompt as transformers' `apply_chat_template(**kwargs)`
    /// and vLLM's `chat_template_kwargs` pass them, e.g. `{enable_thinking:
    /// false}` for Qwen3 (an empty thought block, then the answer).
    pub chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
}

impl Default for LlmConfig {
    fn default() -> Self {
        Self {
            model: None,
            gguf_base: GgufBaseName::Dequantized,
            max_sequences: 32,
            max_queue: 256,
            max_adapters: 8,
            adapters: Default::default(),
            threads: 2,
            prefix_cache: 16,
            kv_cache_mib: 0,
            backend: Default::default(),
            device: Default::default(),
            dtype: Default::default(),
            chat_template_kwargs: Default::default(),
        }
    }
}

impl LlmConfig {
    /// The inference backend the config asks for.
    pub fn backend_spec(&self) -> crate::hyper::backend::BackendSpec {
        crate::hyper::backend::BackendSpec {
            kind: self.backend,
            device: self.device,
            dtype: self.dtype,
        }
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        self.backend_spec()
            .validate()
            .map_err(|e| invalid(e.field, e.detail))?;
        if let Some(model) = &self.model {
            if model.trim().is_empty() {
                return Err(invalid(
                    "llm.model",
                    "is empty; give a model folder, a .gguf file or `smollm2`",
                ));
            }
        }
        positive("llm.max_sequences", self.max_sequences)?;
        positive("llm.max_queue", self.max_queue)?;
        positive("llm.max_adapters", self.max_adapters)?;
        positive("llm.threads", self.threads)?;
        for (name, path) in &self.adapters {
            if name.is_empty() || name.chars().any(char::is_whitespace) {
                return Err(invalid(
                    "llm.adapters",
                    format!("adapter name {name:?} must be non-empty without spaces"),
                ));
            }
            if path.as_os_str().is_empty() {
                return Err(invalid(
                    &format!("llm.adapters.{name}"),
                    "is empty; give a PEFT adapter folder",
                ));
            }
        }
        Ok(())
    }
}
