//! Why a configuration is refused ([`ConfigError`]) and the field checks
//! every section shares (positive, finite, in `[0, 1]`, schedules).

use std::path::PathBuf;

use crate::hyper::schedule::{Schedule, Shape};

/// A hyperparameter type's own check failed: the field, relative to the
/// type (`lr`, `warmup.start`), and why. The pure crates that use the type
/// turn it into their own error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("config `{field}`: {reason}")]
pub struct FieldError {
    /// The offending field.
    pub field: &'static str,
    /// What is wrong with it.
    pub reason: String,
}

impl FieldError {
    pub fn new(field: &'static str, reason: impl Into<String>) -> Self {
        Self {
            field,
            reason: reason.into(),
        }
    }
}

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config {origin}: {detail}")]
    Parse { origin: String, detail: String },
    #[error("override {key:?}: {detail}")]
    Override { key: String, detail: String },
    #[error("config field {field}: {detail}")]
    Invalid { field: String, detail: String },
}

pub(crate) fn invalid(field: &str, detail: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.to_string(),
        detail: detail.into(),
    }
}

pub(crate) fn yes() -> bool {
    true
}

pub(crate) fn positive(field: &str, v: usize) -> Result<(), ConfigError> {
    if v == 0 {
        return Err(invalid(field, "must be positive, got 0"));
    }
    Ok(())
}

pub(crate) fn positive_f(field: &str, v: f64) -> Result<(), ConfigError> {
    if !(v.is_finite() && v > 0.0) {
        return Err(invalid(
            field,
            format!("must be a positive number, got {v}"),
        ));
    }
    Ok(())
}

pub(crate) fn non_negative_f(field: &str, v: f64) -> Result<(), ConfigError> {
    if !(v.is_finite() && v >= 0.0) {
        return Err(invalid(field, format!("must be >= 0, got {v}")));
    }
    Ok(())
}

/// A scheduled hyperparameter: the schedule itself is valid (errors name
/// `field.<its field>`) and its value is finite and never negative over
/// training; with `positive`, it is above zero somewhere (a learning rate
/// may warm up from 0 or decay to 0, but not stay there).
pub(crate) fn schedule(field: &str, s: &Schedule, positive: bool) -> Result<(), ConfigError> {
    s.validate()
        .map_err(|e| invalid(field, format!("invalid {e}")))?;
    // Every shape is monotone or piecewise linear between its points, so
    // its extremes are at the ends, the warmup/offset joints or the points;
    // a fine grid includes all of them to within a step.
    let mut joints: Vec<f64> = (0..=1000).map(|i| i as f64 / 1000.0).collect();
    joints.extend(s.warmup.map(|w| w.fraction));
    joints.push(s.offset);
    if let Shape::PiecewiseLinear { points } = &s.shape {
        let begin = s.offset.max(s.warmup.map_or(0.0, |w| w.fraction));
        joints.extend(points.iter().map(|(q, _)| begin + q * (1.0 - begin)));
    }
    let values: Vec<f64> = joints.iter().map(|&p| s.value(p)).collect();
    if let Some(v) = values.iter().find(|v| !(v.is_finite() && **v >= 0.0)) {
        return Err(invalid(
            field,
            format!("must stay finite and >= 0 over training, reaches {v}"),
        ));
    }
    if positive && values.iter().all(|&v| v == 0.0) {
        return Err(invalid(field, "must be above zero somewhere in training"));
    }
    Ok(())
}

pub(crate) fn unit_interval(field: &str, v: f64) -> Result<(), ConfigError> {
    if !(0.0..=1.0).contains(&v) {
        return Err(invalid(field, format!("must be in [0, 1], got {v}")));
    }
    Ok(())
}
