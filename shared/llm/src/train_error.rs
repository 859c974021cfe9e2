//! [`TrainError`]: what can go wrong on the training side of the crate
//! (batching token sequences, RL and SFT losses, the optimizer, reading SFT
//! data).

use std::path::PathBuf;

use crate::model_error::ModelError;
use crate::tokenizer::TokenizerError;

/// Result alias for the training side of `relay-llm`.
pub type TrainResult<T> = std::result::Result<T, TrainError>;

/// Everything that can go wrong while building batches, computing a loss
/// or taking an optimizer step.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// An error raised inside candle.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),

    /// The model refused the batch (token outside the vocabulary, context
    /// overflow, quantized base without a backward, ...).
    #[error(transparent)]
    Model(ModelError),

    /// The caller is stopping ([`relay_nn::BatchShare::stopping`]): the
    /// call ended between two blocks of a forward or backward pass. Steps it
    /// already applied (earlier epochs) stay applied: rolling them back is
    /// the caller's, from the state it took before the call.
    #[error("the update was stopped part-way: the learner is stopping")]
    Stopped,

    /// A replica's share of the step failed (its sum across the replicas,
    /// or shares that do not make one batch).
    #[error("learner replicas: {0}")]
    Replicas(#[from] relay_nn::ShareError),

    /// Tokenizing SFT text failed.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),

    /// A configuration value is invalid.
    #[error("config `{field}`: {reason}")]
    Config {
        /// The offending field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },

    /// The caller passed inconsistent inputs (empty batch, a completion
    /// whose behaviour log-probs do not match its length, ...).
    #[error("bad input: {0}")]
    BadInput(String),

    /// A loss or a gradient is NaN or infinite; no step was taken.
    #[error("non-finite {what}: {value}")]
    NonFinite {
        /// Which quantity.
        what: &'static str,
        /// Its value.
        value: f64,
    },

    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },

    /// A line of a JSONL file is not a valid example.
    #[error("{path}:{line}: {reason}")]
    Jsonl {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with the line.
        reason: String,
    },
}

impl From<ModelError> for TrainError {
    /// A model pass stopped part-way is the trainer's call stopped.
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::Stopped => Self::Stopped,
            e => Self::Model(e),
        }
    }
}

impl From<relay_config::FieldError> for TrainError {
    fn from(e: relay_config::FieldError) -> Self {
        Self::Config {
            field: e.field,
            reason: e.reason,
        }
    }
}

impl From<relay_nn::NnError> for TrainError {
    /// The shared layers' errors (the replicas' sum, candle) as the
    /// trainer's own.
    fn from(e: relay_nn::NnError) -> Self {
        match e {
            relay_nn::NnError::Replicas(e) => Self::Replicas(e),
            relay_nn::NnError::Candle(e) => Self::Candle(e),
            e => Self::BadInput(e.to_string()),
        }
    }
}
