//! The `normalize` section: SB3 `VecNormalize`-style observation and
//! reward normalisation.

use serde::{Deserialize, Serialize};

use crate::check::{positive_f, unit_interval, ConfigError};

/// Running observation and reward normalisation of classic-control runs,
/// as Stable-Baselines3's `VecNormalize` (same formulas, names and
/// defaults; relay-nn's `VecNormalize`). Off by default: with `obs` and
/// `reward` both false nothing is normalised and no statistics travel.
///
/// Each env-runner normalises what its envs return with the statistics of
/// the newest weights version plus what it has seen since, gathers the
/// statistics of its raw observations and discounted returns, and ships
/// them with each fragment; the learner merges them into the run's
/// statistics, which travel with every weights version and are saved in
/// checkpoints (`vec_normalize.safetensors`). Evaluation uses the version's
/// statistics frozen and reports raw returns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NormalizeSection {
    /// Normalise observations: `clip((obs - mean) / sqrt(var + epsilon),
    /// -clip_obs, clip_obs)` with the running mean and variance of the raw
    /// observations. Default `false`.
    pub obs: bool,
    /// Scale rewards by the running std of each env's discounted return
    /// (`ret = ret * gamma + reward`, reset when an episode ends by
    /// termination or truncation), clipped to `±clip_reward`; never
    /// shifted. The learner trains on the scaled rewards; episode returns
    /// and evaluations stay raw. Default `false`.
    pub reward: bool,
    /// Bound of normalised observations. Default `10`.
    pub clip_obs: f64,
    /// Bound of scaled rewards. Default `10`.
    pub clip_reward: f64,
    /// Discount of the running return that scales rewards; unset: the
    /// algorithm's own (`ppo.gamma`, `a2c.gamma` or `reinforce.gamma`), as
    /// rl-zoo does.
    pub gamma: Option<f64>,
    /// Added to the variance before the square root. Default `1e-8`.
    pub epsilon: f64,
}

impl Default for NormalizeSection {
    fn default() -> Self {
        Self {
            obs: false,
            reward: false,
            clip_obs: 10.0,
            clip_reward: 10.0,
            gamma: None,
            epsilon: 1e-8,
        }
    }
}

impl NormalizeSection {
    /// Whether anything is normalised (`obs` or `reward`).
    pub fn enabled(&self) -> bool {
        self.obs || self.reward
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        positive_f("normalize.clip_obs", self.clip_obs)?;
        positive_f("normalize.clip_reward", self.clip_reward)?;
        if let Some(g) = self.gamma {
            unit_interval("normalize.gamma", g)?;
        }
        positive_f("normalize.epsilon", self.epsilon)?;
        Ok(())
    }
}
