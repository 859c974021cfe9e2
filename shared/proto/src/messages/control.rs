//! The run's control plane: status changes, alerts, `relay scale`'s
//! requests and replies, and log lines for the tracker.

use serde::{Deserialize, Serialize};

use super::invalid;
use crate::codec::{Rejection, WireMessage};

/// Lifecycle of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RunStatus {
    Running,
    Solved,
    Stopped,
    Failed,
}

/// Any service -> tracker, supervisor: the run changed state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunStatusUpdate {
    pub schema: u16,
    pub status: RunStatus,
    pub service: String,
    pub policy_version: u64,
    pub detail: String,
}
wire_message!(RunStatusUpdate, "RunStatusUpdate");

/// tracker -> anyone watching (`relay top`, the supervisor): an alert was
/// raised or cleared.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AlertEvent {
    pub schema: u16,
    /// Rule name, e.g. `entropy_collapse`.
    pub alert: String,
    /// The metric the rule watches.
    pub metric: String,
    /// True when raised, false when cleared.
    pub active: bool,
    /// The smoothed value that raised or cleared it.
    pub value: f64,
    /// Vectorized env steps at the time, when known.
    pub vec_steps: Option<u64>,
    /// Human-readable explanation.
    pub message: String,
}
wire_message!(AlertEvent, "AlertEvent");

/// Largest number of copies of one service a [`ScaleRequest`] may ask for.
pub const MAX_COPIES: u32 = 64;

/// `relay scale` -> supervisor (`relay up`): run `copies` copies of `service`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScaleRequest {
    pub schema: u16,
    /// Service name, e.g. `env-runner`.
    pub service: String,
    /// Wanted number of copies (0 stops them all; the learner must stay at 1).
    pub copies: u32,
}
wire_message!(ScaleRequest, "ScaleRequest", |m: &ScaleRequest| {
    if m.service.is_empty()
        || m.service.len() > 64
        || !m
            .service
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
    {
        return Err(invalid(
            "ScaleRequest",
            "service",
            format!("bad service name {:?}", m.service),
        ));
    }
    if m.copies > MAX_COPIES {
        return Err(invalid(
            "ScaleRequest",
            "copies",
            format!("{} copies is over the limit of {MAX_COPIES}", m.copies),
        ));
    }
    Ok(())
});

/// A copy that a scale-down stopped, with its exit code (`None`: killed by a
/// signal, e.g. SIGKILL after the grace period).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoppedCopy {
    pub instance: String,
    pub exit_code: Option<i32>,
}

/// Supervisor -> `relay scale`: what changed. `error` is set (and nothing
/// changed) when the request was refused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScaleReply {
    pub schema: u16,
    pub service: String,
    /// Copies running now.
    pub copies: u32,
    /// Instance names of the running copies.
    pub instances: Vec<String>,
    /// Copies started by this request (healthy when the reply is sent).
    pub started: Vec<String>,
    /// Copies stopped by this request, after draining.
    pub stopped: Vec<StoppedCopy>,
    pub error: Option<String>,
}
wire_message!(ScaleReply, "ScaleReply");

/// Any service -> tracker: formatted log lines for `runs/<id>/logs/<service>.log`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LogBatch {
    pub schema: u16,
    pub service: String,
    pub instance: String,
    pub lines: Vec<String>,
}
wire_message!(LogBatch, "LogBatch", |m: &LogBatch| {
    if m.service.is_empty()
        || !m
            .service
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return Err(invalid(
            "LogBatch",
            "service",
            format!("bad service name {:?}", m.service),
        ));
    }
    Ok(())
});
