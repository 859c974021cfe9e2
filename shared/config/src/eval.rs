//! The `eval` section: how the evaluator scores versions, when a run is
//! solved, and the seeds of confirmation episodes.

use serde::{Deserialize, Serialize};

use crate::check::{invalid, positive, ConfigError};

/// evaluator settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalConfig {
    /// Evaluate every this many weights versions (the newest is taken; others are skipped).
    pub every_versions: u64,
    /// Also evaluate once this many seconds have passed since the last
    /// evaluation and any newer version exists, whichever of the two comes
    /// first (unset: versions only). For slow learners whose versions are far apart.
    pub every_seconds: Option<f64>,
    /// Episodes per evaluation.
    pub episodes: usize,
    /// Seed of the eval episodes, distinct from the training seeds.
    pub seed: u64,
    /// Solved threshold on the mean eval return; defaults to the env's reward threshold.
    pub threshold: Option<f64>,
    /// Episodes (text games: games per opponent) of the confirmation: a
    /// version whose screening mean (the `episodes` on `seed`, the same set
    /// every time) reaches the threshold is played again on this many
    /// episodes from seeds no earlier evaluation of the run used, and only
    /// a pass there solves the run (100: Gymnasium's classic criterion of
    /// 100 consecutive episodes).
    pub confirm_episodes: usize,
    /// Standard errors the confirmation's mean must clear the threshold
    /// by: it passes when `mean - confirm_z * std / sqrt(episodes)` reaches
    /// the threshold. The first version to pass is a selection among many,
    /// and a policy that sits at the threshold passes half its
    /// confirmations; with 2 a version that passes holds its mean on fresh
    /// episodes about 9 times in 10. 0: the mean alone.
    pub confirm_z: f64,
    /// Evaluator plugin this evaluator copy runs (see the evaluator crate's
    /// registry): `greedy` (deterministic actions), `stochastic` (sampled
    /// actions), `threshold` (evaluates only once the training return crosses
    /// `options.level`), `record` (greedy, and writes each episode's
    /// trajectory to `runs/<id>/recordings/v<version>.jsonl`), and for
    /// text-game runs `vs-opponent` (the learning adapter against each of
    /// `options.opponents`, half of `options.games` in each seat). `relay
    /// eval use` switches a running evaluator to another one.
    pub evaluator: String,
    /// Options of the plugin, `key: value` (scalars); each plugin documents
    /// its own and rejects unknown ones.
    pub options: std::collections::BTreeMap<String, serde_yaml::Value>,
}

/// Where confirmation seeds start, above the eval seed: far past any
/// screening set (`eval.episodes` seeds from `eval.seed`).
pub(crate) const CONFIRM_SEED_OFFSET: u64 = 1 << 32;

/// Where fresh seeds for offline re-evaluation start, above the eval seed:
/// past every confirmation of any version a run can reach.
pub(crate) const FRESH_SEED_OFFSET: u64 = 1 << 48;

impl EvalConfig {
    /// First seed of the confirmation of `version`: `eval.seed + 2^32 +
    /// version * confirm_episodes`, so no two versions' confirmations, nor
    /// a confirmation and the screening set, share a seed.
    pub fn confirm_seed(&self, version: u64) -> u64 {
        self.seed
            .wrapping_add(CONFIRM_SEED_OFFSET)
            .wrapping_add(version.wrapping_mul(self.confirm_episodes as u64))
    }

    /// First seed of episodes that no evaluation of the run plays
    /// (`eval.seed + 2^48`): what `relay eval checkpoint` and the
    /// benchmarks re-evaluate saved checkpoints on by default.
    pub fn fresh_seed(&self) -> u64 {
        self.seed.wrapping_add(FRESH_SEED_OFFSET)
    }

    /// The plugin options as `key=value` strings.
    pub fn option_pairs(&self) -> Vec<(String, String)> {
        self.options
            .iter()
            .map(|(k, v)| {
                let text = match v {
                    serde_yaml::Value::String(s) => s.clone(),
                    other => serde_yaml::to_string(other)
                        .unwrap_or_default()
                        .trim()
                        .to_string(),
                };
                (k.clone(), text)
            })
            .collect()
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if self
            .every_seconds
            .is_some_and(|s| !(s.is_finite() && s > 0.0))
        {
            return Err(invalid(
                "eval.every_seconds",
                "must be a positive number of seconds",
            ));
        }
        positive("eval.confirm_episodes", self.confirm_episodes)?;
        if !(self.confirm_z.is_finite() && self.confirm_z >= 0.0) {
            return Err(invalid(
                "eval.confirm_z",
                "must be a finite number of standard errors >= 0",
            ));
        }
        if self.evaluator.trim().is_empty() {
            return Err(invalid("eval.evaluator", "must name an evaluator plugin"));
        }
        for (k, v) in &self.options {
            if matches!(
                v,
                serde_yaml::Value::Mapping(_) | serde_yaml::Value::Sequence(_)
            ) {
                return Err(invalid(
                    &format!("eval.options.{k}"),
                    "must be a scalar (string, number or bool)",
                ));
            }
        }
        Ok(())
    }
}

impl Default for EvalConfig {
    fn default() -> Self {
        Self {
            every_versions: 5,
            every_seconds: None,
            episodes: 20,
            seed: 1_000_003,
            threshold: None,
            confirm_episodes: 100,
            confirm_z: 2.0,
            evaluator: "greedy".into(),
            options: Default::default(),
        }
    }
}
