//! The error type of the model side of the crate (config, weights, LoRA,
//! PEFT, GGUF, caches, generation).

use std::path::PathBuf;

/// Result alias for the model side of `relay-llm`.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;

/// Everything that can go wrong while loading, running or saving a model or
/// an adapter.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// An error raised inside candle.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),

    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },

    /// A JSON file (config.json, adapter_config.json, ...) is malformed.
    #[error("{path}: {reason}")]
    Json {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// A configuration value is missing, invalid or not supported.
    #[error("config `{field}`: {reason}")]
    Config {
        /// The offending field.
        field: String,
        /// What is wrong with it.
        reason: String,
    },

    /// A weight file lacks a tensor, or holds one of the wrong shape.
    #[error("weights {path}: {reason}")]
    Weights {
        /// The file (or folder) the weights come from.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },

    /// A caller passed inconsistent inputs (wrong cache, empty tokens, ...).
    #[error("bad input: {0}")]
    BadInput(String),

    /// A sequence would grow past the model's `max_position_embeddings`.
    #[error("context overflow: position {position} is past the model's limit of {limit}")]
    ContextOverflow {
        /// The first position that does not fit.
        position: usize,
        /// The model's `max_position_embeddings`.
        limit: usize,
    },

    /// The candle backend's key/value pool holds as many blocks as its
    /// bound (`llm.kv_cache_mib`) allows, all in use.
    #[error(
        "the KV cache is full: all {blocks} blocks ({bytes} bytes) are in use; \
         raise llm.kv_cache_mib or lower llm.max_sequences"
    )]
    KvCacheFull {
        /// Blocks the pool holds.
        blocks: usize,
        /// Their bytes.
        bytes: usize,
    },

    /// A training pass ended between two blocks because its caller is
    /// stopping ([`relay_nn::StopCheck`]); nothing it computed is kept.
    #[error("the training pass was stopped part-way: the caller is stopping")]
    Stopped,
}

impl From<relay_config::FieldError> for ModelError {
    fn from(e: relay_config::FieldError) -> Self {
        Self::config(e.field, e.reason)
    }
}

impl ModelError {
    pub(crate) fn config(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Config {
            field: field.into(),
            reason: reason.into(),
        }
    }

    pub(crate) fn io(path: &std::path::Path, source: std::io::Error) -> Self {
        Self::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    pub(crate) fn weights(path: &std::path::Path, reason: impl Into<String>) -> Self {
        Self::Weights {
            path: path.to_path_buf(),
            reason: reason.into(),
        }
    }

    pub(crate) fn json(path: &std::path::Path, reason: impl std::fmt::Display) -> Self {
        Self::Json {
            path: path.to_path_buf(),
            reason: reason.to_string(),
        }
    }
}
