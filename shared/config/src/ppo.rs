//! The `ppo` section: PPO's hyperparameters, with SB3's defaults.

use crate::hyper::schedule::{Schedule, Shape};
use serde::{Deserialize, Serialize};

use crate::check::{
    invalid, non_negative_f, positive, positive_f, schedule, unit_interval, ConfigError,
};
use crate::schedule::ScheduleShorthand;

/// PPO hyperparameters (names and defaults as Stable-Baselines3's where they exist).
///
/// `learning_rate`, `clip_range` and `ent_coef` are [`Schedule`]s over
/// training progress `env_steps / run.total_env_steps`: a bare number is a
/// constant, a map gives the shape (`{kind: cosine, start: 1e-3, end: 0,
/// warmup: {fraction: 0.05}}`; kinds `constant`, `linear`, `cosine`,
/// `exponential`, `piecewise_linear`, with optional `warmup` and `offset`,
/// see [`crate::hyper::schedule`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PpoConfig {
    /// Env steps gathered (from any number of env-runners) per update.
    pub rollout_steps: usize,
    /// Env steps per gradient step.
    pub minibatch_size: usize,
    /// Passes over each rollout.
    pub epochs: usize,
    /// Discount factor.
    pub gamma: f64,
    /// GAE lambda: bias/variance trade-off of the advantage estimate.
    pub gae_lambda: f64,
    /// Learning rate of Adam (a schedule over training progress).
    pub learning_rate: Schedule,
    /// Shorthand schedule of a constant `learning_rate` (`constant` or
    /// `linear` to zero); see [`ScheduleShorthand`].
    pub lr_schedule: ScheduleShorthand,
    /// PPO clip range for the probability ratio (a schedule).
    pub clip_range: Schedule,
    /// Shorthand schedule of a constant `clip_range`; see [`ScheduleShorthand`].
    pub clip_schedule: ScheduleShorthand,
    /// Clip range of the value function around the old values; none disables it.
    pub clip_range_vf: Option<f64>,
    /// Entropy bonus coefficient (a schedule).
    pub ent_coef: Schedule,
    /// Value loss coefficient.
    pub vf_coef: f64,
    /// Global gradient-norm clip.
    pub max_grad_norm: f64,
    /// Normalise advantages per minibatch.
    pub normalize_advantage: bool,
    /// Stop the epochs of an update early when approx KL exceeds 1.5x this.
    pub target_kl: Option<f64>,
    /// Adam epsilon.
    pub adam_eps: f64,
    /// Write a checkpoint every this many updates (and at stop, at the first
    /// eval and at each new best eval mean).
    pub checkpoint_every: u64,
    /// Numbered checkpoints kept: the newest this many, plus the pinned ones
    /// (`checkpoints/pinned.json`) and the best; older ones are removed.
    pub keep_checkpoints: usize,
}

impl Default for PpoConfig {
    fn default() -> Self {
        Self {
            rollout_steps: 2048,
            minibatch_size: 64,
            epochs: 10,
            gamma: 0.99,
            gae_lambda: 0.95,
            learning_rate: Schedule::constant(3e-4),
            lr_schedule: ScheduleShorthand::Constant,
            clip_range: Schedule::constant(0.2),
            clip_schedule: ScheduleShorthand::Constant,
            clip_range_vf: None,
            ent_coef: Schedule::constant(0.0),
            vf_coef: 0.5,
            max_grad_norm: 0.5,
            normalize_advantage: true,
            target_kl: None,
            adam_eps: 1e-5,
            checkpoint_every: 50,
            keep_checkpoints: 5,
        }
    }
}

impl PpoConfig {
    /// Ranges and schedules of the section on its own.
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let p = self;
        positive("ppo.rollout_steps", p.rollout_steps)?;
        positive("ppo.minibatch_size", p.minibatch_size)?;
        positive("ppo.epochs", p.epochs)?;
        unit_interval("ppo.gamma", p.gamma)?;
        unit_interval("ppo.gae_lambda", p.gae_lambda)?;
        if let Some(v) = p.clip_range_vf {
            positive_f("ppo.clip_range_vf", v)?;
        }
        schedule("ppo.learning_rate", &p.learning_rate_schedule(), true)?;
        schedule("ppo.clip_range", &p.clip_range_schedule(), true)?;
        schedule("ppo.ent_coef", &p.ent_coef, false)?;
        for (field, short, written) in [
            ("ppo.lr_schedule", p.lr_schedule, &p.learning_rate),
            ("ppo.clip_schedule", p.clip_schedule, &p.clip_range),
        ] {
            if short == ScheduleShorthand::Linear
                && !matches!(written.shape, Shape::Constant { .. })
            {
                return Err(invalid(
                    field,
                    "`linear` applies to a constant value only; write the schedule in place instead",
                ));
            }
        }
        non_negative_f("ppo.vf_coef", p.vf_coef)?;
        positive_f("ppo.max_grad_norm", p.max_grad_norm)?;
        positive_f("ppo.adam_eps", p.adam_eps)?;
        if let Some(v) = p.target_kl {
            positive_f("ppo.target_kl", v)?;
        }
        positive("ppo.checkpoint_every", p.checkpoint_every as usize)?;
        positive("ppo.keep_checkpoints", p.keep_checkpoints)?;
        Ok(())
    }

    /// The learning rate's schedule, `lr_schedule` applied.
    pub fn learning_rate_schedule(&self) -> Schedule {
        self.lr_schedule.apply(&self.learning_rate)
    }

    /// The clip range's schedule, `clip_schedule` applied.
    pub fn clip_range_schedule(&self) -> Schedule {
        self.clip_schedule.apply(&self.clip_range)
    }
}
