//! What the tracker aggregates: finished episodes and metric values
//! (gauges and counters, with their labels).

use serde::{Deserialize, Serialize};

use super::invalid;
use crate::codec::{Rejection, WireMessage};

/// One finished episode.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EpisodeSummary {
    /// Undiscounted sum of rewards (in a self-play game, the learning
    /// seat's).
    pub episode_return: f64,
    /// Steps (in a self-play game, the learning seat's moves).
    pub length: u32,
    /// True when it ended in a terminal state, false when cut by the time limit.
    pub terminated: bool,
    /// Self-play games: the learning policy's seat (0 moves first), drawn
    /// with the runner's seeded RNG.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seat: Option<u32>,
    /// Self-play games: who held the other seats (`mirror`, `random`,
    /// `minimax`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub opponent: Option<String>,
    /// Parallel games played by one shared policy: each agent's return, in
    /// the game's agent order; `episode_return` is their sum, the team's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_returns: Option<Vec<AgentReturn>>,
}

/// One agent's return in a game of a team ([`EpisodeSummary::agent_returns`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentReturn {
    pub agent: String,
    pub episode_return: f64,
}

/// env-runner -> tracker: episodes finished since the last report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpisodeReport {
    pub schema: u16,
    pub runner_id: String,
    pub env_id: String,
    pub policy_version: u64,
    pub episodes: Vec<EpisodeSummary>,
}
wire_message!(EpisodeReport, "EpisodeReport", |m: &EpisodeReport| {
    match m
        .episodes
        .iter()
        .position(|e| !e.episode_return.is_finite())
    {
        Some(i) => Err(invalid(
            "EpisodeReport",
            "episodes",
            format!("episode {i} has a non-finite return"),
        )),
        None => Ok(()),
    }
});

/// How the tracker aggregates a metric value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MetricKind {
    /// The latest value replaces the previous one.
    Gauge,
    /// The value is an increment added to a running total.
    Counter,
}

/// Label keys a [`MetricValue`] may carry (the tracker adds each as a
/// Prometheus label): `game`, the text game a per-game value is about.
pub const METRIC_LABELS: &[&str] = &["game"];

/// Longest label value a [`MetricValue`] may carry.
pub const MAX_METRIC_LABEL_LEN: usize = 64;

/// One named value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MetricValue {
    /// Name without the `relay_` prefix, e.g. `learner_policy_loss`.
    pub name: String,
    pub kind: MetricKind,
    pub value: f64,
    /// Labels of this value (keys from [`METRIC_LABELS`]), e.g.
    /// `{game: TicTacToe-v0}` for a per-game value. Empty for most values;
    /// absent on the wire when empty, so older readers and writers agree.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub labels: std::collections::BTreeMap<String, String>,
}

/// A gauge value for a [`MetricsReport`].
pub fn gauge(name: &str, value: f64) -> MetricValue {
    MetricValue {
        name: name.to_string(),
        kind: MetricKind::Gauge,
        value,
        labels: Default::default(),
    }
}

/// A counter increment for a [`MetricsReport`].
pub fn counter(name: &str, increment: f64) -> MetricValue {
    MetricValue {
        name: name.to_string(),
        kind: MetricKind::Counter,
        value: increment,
        labels: Default::default(),
    }
}

impl MetricValue {
    /// This value with label `key` set to `value`.
    pub fn with_label(mut self, key: &str, value: &str) -> Self {
        self.labels.insert(key.to_string(), value.to_string());
        self
    }

    /// The name with its labels, as the run directory's files key it:
    /// `name` alone, or `name{game=TicTacToe-v0}` (labels in key order,
    /// comma-separated).
    pub fn key(&self) -> String {
        if self.labels.is_empty() {
            return self.name.clone();
        }
        let labels: Vec<String> = self
            .labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        format!("{}{{{}}}", self.name, labels.join(","))
    }
}

/// Any service -> tracker: a batch of metric values.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MetricsReport {
    pub schema: u16,
    pub service: String,
    pub instance: String,
    /// Vectorized env steps at which these values hold, when the producer knows it.
    pub vec_steps: Option<u64>,
    pub values: Vec<MetricValue>,
}
wire_message!(MetricsReport, "MetricsReport", |m: &MetricsReport| {
    for v in &m.values {
        if v.name.is_empty()
            || !v
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            return Err(invalid(
                "MetricsReport",
                "values",
                format!("bad metric name {:?}", v.name),
            ));
        }
        for (key, value) in &v.labels {
            if !METRIC_LABELS.contains(&key.as_str()) {
                return Err(invalid(
                    "MetricsReport",
                    "values",
                    format!(
                        "metric {} has unknown label {key:?}; known: {}",
                        v.name,
                        METRIC_LABELS.join(", ")
                    ),
                ));
            }
            if value.is_empty()
                || value.len() > MAX_METRIC_LABEL_LEN
                || !value
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':'))
            {
                return Err(invalid(
                    "MetricsReport",
                    "values",
                    format!(
                        "metric {} has bad {key} label {value:?} (1 to {MAX_METRIC_LABEL_LEN} ASCII letters, digits, '-', '_', '.' or ':')",
                        v.name
                    ),
                ));
            }
        }
    }
    Ok(())
});
