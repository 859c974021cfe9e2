//! The crate's error types: [`NnError`], and [`ShareError`] (a replica's
//! share of a step, which [`crate::share`] reports and `NnError` wraps).

use std::path::PathBuf;

/// Result alias used throughout `relay-nn`.
pub type Result<T, E = NnError> = std::result::Result<T, E>;

/// Everything that can go wrong in `relay-nn`.
///
/// Parameter errors name the parameter and both shapes, so a bad weight
/// message or checkpoint can be diagnosed from the log line alone.
#[derive(Debug, thiserror::Error)]
pub enum NnError {
    /// An error raised inside candle.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),

    /// A `PolicySpec`, optimizer or loss configuration value is invalid.
    #[error("invalid config `{field}`: {reason}")]
    InvalidConfig {
        /// The offending field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },

    /// An input buffer or tensor has the wrong length or shape.
    #[error("bad input `{what}`: expected {expected}, got {got}")]
    BadInput {
        /// Which input.
        what: &'static str,
        /// What was expected (e.g. a length or shape).
        expected: String,
        /// What was received.
        got: String,
    },

    /// A parameter the model needs was not provided.
    #[error("parameter `{name}` is missing (expected shape {expected:?}, got none)")]
    MissingParameter {
        /// Parameter name.
        name: String,
        /// The shape the model expects.
        expected: Vec<usize>,
    },

    /// A parameter was provided that the model does not have.
    #[error("unexpected parameter `{name}` (expected none, got shape {got:?})")]
    UnexpectedParameter {
        /// Parameter name.
        name: String,
        /// The shape that was provided.
        got: Vec<usize>,
    },

    /// A parameter has the wrong shape (or its data does not fill its shape).
    #[error("parameter `{name}`: expected shape {expected:?}, got {got:?}{detail}")]
    ShapeMismatch {
        /// Parameter name.
        name: String,
        /// The shape the model expects.
        expected: Vec<usize>,
        /// The shape that was provided.
        got: Vec<usize>,
        /// Extra detail (empty, or e.g. "; data has 7 values").
        detail: String,
    },

    /// A parameter holds a NaN or infinite value.
    #[error(
        "parameter `{name}` (shape {shape:?}) has a non-finite value {value} at flat index {index}"
    )]
    NonFinite {
        /// Parameter name.
        name: String,
        /// Its shape.
        shape: Vec<usize>,
        /// Flat index of the first bad value.
        index: usize,
        /// The bad value.
        value: f32,
    },

    /// A safetensors file could not be read or written, or is not what we expect.
    /// A learner replica's share of a step failed (its all-reduce, or
    /// shares that do not make one batch).
    #[error("learner replicas: {0}")]
    Replicas(#[from] ShareError),
    #[error("safetensors file {path}: {reason}")]
    Checkpoint {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
}

impl From<relay_config::FieldError> for NnError {
    fn from(e: relay_config::FieldError) -> Self {
        Self::InvalidConfig {
            field: e.field,
            reason: e.reason,
        }
    }
}

impl NnError {
    pub(crate) fn bad_input(
        what: &'static str,
        expected: impl std::fmt::Display,
        got: impl std::fmt::Display,
    ) -> Self {
        Self::BadInput {
            what,
            expected: expected.to_string(),
            got: got.to_string(),
        }
    }

    pub(crate) fn config(field: &'static str, reason: impl Into<String>) -> Self {
        Self::InvalidConfig {
            field,
            reason: reason.into(),
        }
    }
}

/// Why a replica's share of a step cannot be trusted.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ShareError {
    /// A sum across the replicas failed (a member left, the ring broke):
    /// the step is rolled back and redone in the next view.
    #[error("summing across the replicas failed: {0}")]
    SumFailed(String),
    /// The replicas' summed shares do not make one batch: they hold
    /// different batches, and a mixture must not be trained on.
    #[error(
        "the replicas' parts cover {covered} of a batch, not all of it: they hold different batches"
    )]
    Uncovered { covered: f32 },
}
