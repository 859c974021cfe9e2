//! The `a2c` section: A2C's hyperparameters, with SB3's defaults, and the
//! checks A2C makes against the rest of the config.

use crate::hyper::schedule::Schedule;
use serde::{Deserialize, Serialize};

use crate::check::{
    invalid, non_negative_f, positive, positive_f, schedule, unit_interval, ConfigError,
};
use crate::experiment::ExperimentConfig;
use crate::run::Algo;

/// A2C hyperparameters (Stable-Baselines3's `A2C`: names and defaults).
///
/// Each update is one gradient step on `n_steps` vector steps of every env
/// of one env-runner (`n_steps x env_runner.num_envs` env steps), with
/// `gae_lambda`-returns bootstrapped from the critic at the fragment's end
/// and through time-limit truncations, never through terminations.
/// `learning_rate` and `ent_coef` are [`Schedule`]s (see [`PpoConfig`]).
/// Whether actor and critic share their hidden layers is `policy.trunk`
/// (SB3's A2C `MlpPolicy` default: separate).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct A2cConfig {
    /// Vector steps per env per update (SB3 `n_steps`); must equal
    /// `env_runner.fragment_steps`, so each fragment is one rollout.
    pub n_steps: usize,
    /// Discount factor.
    pub gamma: f64,
    /// GAE lambda; `1.0` gives plain n-step returns (SB3's default).
    pub gae_lambda: f64,
    /// Learning rate (a schedule over training progress).
    pub learning_rate: Schedule,
    /// Entropy bonus coefficient (a schedule).
    pub ent_coef: Schedule,
    /// Value loss coefficient.
    pub vf_coef: f64,
    /// Global gradient-norm clip.
    pub max_grad_norm: f64,
    /// Normalise advantages over each update's batch.
    pub normalize_advantage: bool,
    /// Optimise with RMSprop (SB3's default); otherwise Adam.
    pub use_rms_prop: bool,
    /// RMSprop's decay of the running mean of squared gradients.
    pub rms_prop_alpha: f64,
    /// RMSprop epsilon (added to the root-mean-square).
    pub rms_prop_eps: f64,
    /// Adam epsilon (with `use_rms_prop: false`; SB3 sets 1e-5 for Adam).
    pub adam_eps: f64,
    /// Write a checkpoint every this many updates (and at stop, at the first
    /// eval and at each new best eval mean).
    pub checkpoint_every: u64,
    /// Numbered checkpoints kept besides the pinned ones and the best.
    pub keep_checkpoints: usize,
}

impl Default for A2cConfig {
    fn default() -> Self {
        Self {
            n_steps: 5,
            gamma: 0.99,
            gae_lambda: 1.0,
            learning_rate: Schedule::constant(7e-4),
            ent_coef: Schedule::constant(0.0),
            vf_coef: 0.5,
            max_grad_norm: 0.5,
            normalize_advantage: false,
            use_rms_prop: true,
            rms_prop_alpha: 0.99,
            rms_prop_eps: 1e-5,
            adam_eps: 1e-5,
            checkpoint_every: 1000,
            keep_checkpoints: 5,
        }
    }
}

impl ExperimentConfig {
    pub(crate) fn validate_a2c(&self) -> Result<(), ConfigError> {
        let a = &self.a2c;
        positive("a2c.n_steps", a.n_steps)?;
        unit_interval("a2c.gamma", a.gamma)?;
        unit_interval("a2c.gae_lambda", a.gae_lambda)?;
        schedule("a2c.learning_rate", &a.learning_rate, true)?;
        schedule("a2c.ent_coef", &a.ent_coef, false)?;
        non_negative_f("a2c.vf_coef", a.vf_coef)?;
        positive_f("a2c.max_grad_norm", a.max_grad_norm)?;
        if !(0.0..1.0).contains(&a.rms_prop_alpha) {
            return Err(invalid(
                "a2c.rms_prop_alpha",
                format!("must be in [0, 1), got {}", a.rms_prop_alpha),
            ));
        }
        positive_f("a2c.rms_prop_eps", a.rms_prop_eps)?;
        positive_f("a2c.adam_eps", a.adam_eps)?;
        positive("a2c.checkpoint_every", a.checkpoint_every as usize)?;
        positive("a2c.keep_checkpoints", a.keep_checkpoints)?;
        if self.run.algo == Algo::A2c && self.env_runner.fragment_steps != a.n_steps {
            return Err(invalid(
                "env_runner.fragment_steps",
                format!(
                    "is {} but A2C trains on fragments of a2c.n_steps = {} steps; set both to the same value",
                    self.env_runner.fragment_steps, a.n_steps
                ),
            ));
        }
        Ok(())
    }
}
