//! The `reinforce` section: REINFORCE's hyperparameters and baselines, and
//! its cross-section checks.

use crate::hyper::schedule::Schedule;
use serde::{Deserialize, Serialize};

use crate::check::{non_negative_f, positive, positive_f, schedule, unit_interval, ConfigError};
use crate::experiment::ExperimentConfig;

/// The baseline REINFORCE subtracts from the returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Baseline {
    /// The critic's value `V(s_t)`, trained towards the returns alongside.
    #[default]
    Value,
    /// No baseline: the policy gradient weighs log-probabilities by the
    /// returns themselves (the critic is not trained).
    None,
}

/// REINFORCE hyperparameters: Monte-Carlo returns over whole episodes.
///
/// The learner assembles each env's episodes from consecutive fragments
/// and trains, one gradient step with Adam, once `batch_episodes` of them
/// have ended. An episode cut by a time limit bootstraps its last return
/// from the critic's value of the final observation (with `baseline:
/// value`; without a trained critic, from 0); a terminated one never does.
/// Steps acted more than `replay.max_policy_lag` versions ago are left out
/// (their returns stay exact: returns look forward only).
/// `learning_rate` and `ent_coef` are [`Schedule`]s (see [`PpoConfig`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReinforceConfig {
    /// Completed episodes per update.
    pub batch_episodes: usize,
    /// Discount factor.
    pub gamma: f64,
    /// Learning rate of Adam (a schedule over training progress).
    pub learning_rate: Schedule,
    /// What is subtracted from the returns: `value` or `none`.
    pub baseline: Baseline,
    /// Entropy bonus coefficient (a schedule).
    pub ent_coef: Schedule,
    /// Value loss coefficient (with `baseline: value`).
    pub vf_coef: f64,
    /// Global gradient-norm clip; none disables it (classic REINFORCE).
    pub max_grad_norm: Option<f64>,
    /// Normalise `returns - baseline` over each update's batch.
    pub normalize_advantage: bool,
    /// Adam epsilon.
    pub adam_eps: f64,
    /// Write a checkpoint every this many updates (and at stop, at the first
    /// eval and at each new best eval mean).
    pub checkpoint_every: u64,
    /// Numbered checkpoints kept besides the pinned ones and the best.
    pub keep_checkpoints: usize,
}

impl Default for ReinforceConfig {
    fn default() -> Self {
        Self {
            batch_episodes: 8,
            gamma: 0.99,
            learning_rate: Schedule::constant(1e-3),
            baseline: Baseline::Value,
            ent_coef: Schedule::constant(0.0),
            vf_coef: 0.5,
            max_grad_norm: None,
            normalize_advantage: true,
            adam_eps: 1e-8,
            checkpoint_every: 100,
            keep_checkpoints: 5,
        }
    }
}

impl ExperimentConfig {
    pub(crate) fn validate_reinforce(&self) -> Result<(), ConfigError> {
        let r = &self.reinforce;
        positive("reinforce.batch_episodes", r.batch_episodes)?;
        unit_interval("reinforce.gamma", r.gamma)?;
        schedule("reinforce.learning_rate", &r.learning_rate, true)?;
        schedule("reinforce.ent_coef", &r.ent_coef, false)?;
        non_negative_f("reinforce.vf_coef", r.vf_coef)?;
        if let Some(v) = r.max_grad_norm {
            positive_f("reinforce.max_grad_norm", v)?;
        }
        positive_f("reinforce.adam_eps", r.adam_eps)?;
        positive("reinforce.checkpoint_every", r.checkpoint_every as usize)?;
        positive("reinforce.keep_checkpoints", r.keep_checkpoints)?;
        Ok(())
    }
}
