//! Policy versions: the learner's weights updates, their announcement,
//! and the request for the latest one.

use serde::{Deserialize, Serialize};

use super::NormStats;
use crate::blob::WeightsBlob;
use crate::codec::{Rejection, WireMessage};

/// learner -> inference-server, evaluator, normalising env-runners: a new
/// policy version. Its parameters are a safetensors file (named f32
/// tensors) in [`WeightsUpdate::weights`]: inline when small, else fetched
/// by each reader (see [`crate::blob`]), whatever the policy's size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WeightsUpdate {
    pub schema: u16,
    /// Increases by one with each learner update; never goes back within a run.
    pub version: u64,
    /// Env steps the learner had consumed when it made this version.
    pub learner_env_steps: u64,
    /// Every parameter of the policy, by name, as safetensors bytes.
    pub weights: WeightsBlob,
    /// Runs with a `normalize` section on: the run's observation and return
    /// statistics as of this version. Whoever runs the policy normalises
    /// raw observations with them (frozen: never updated from evaluation);
    /// env-runners adopt them as their starting point. Absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub normalizer: Option<NormStats>,
    /// When the learner began publishing this version ([`crate::unix_ms`]
    /// on its clock, before any upload), so receivers measure the whole
    /// transfer; 0: unknown.
    #[serde(default)]
    pub published_unix_ms: u64,
}
wire_message!(WeightsUpdate, "WeightsUpdate", |m: &WeightsUpdate| {
    if let Some(stats) = &m.normalizer {
        stats.check("WeightsUpdate", "normalizer", None)?;
    }
    m.weights.check("WeightsUpdate", "weights")
});

/// learner -> evaluators (`weights.announce`): a version was published;
/// services that play only some versions fetch the ones they want.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WeightsAnnouncement {
    pub schema: u16,
    pub version: u64,
    pub learner_env_steps: u64,
}
wire_message!(WeightsAnnouncement, "WeightsAnnouncement");

/// Any service -> learner: ask for the latest [`WeightsUpdate`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WeightsRequest {
    pub schema: u16,
}
wire_message!(WeightsRequest, "WeightsRequest");
