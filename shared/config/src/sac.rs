//! The `sac` section: SAC's hyperparameters and its cross-section checks.

use crate::hyper::schedule::Schedule;
use serde::{Deserialize, Serialize};

use crate::check::{invalid, positive, schedule, unit_interval, ConfigError};
use crate::experiment::ExperimentConfig;
use crate::run::Algo;

/// A hyperparameter given as a number or a name (`"auto"`, `"auto_0.1"`):
/// SAC's `ent_coef` and `target_entropy`, spelled as in SB3.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum NumberOrName {
    /// A number.
    Number(f64),
    /// A name.
    Name(String),
}

/// How SAC's entropy coefficient α is set ([`SacSection::ent_coef`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum EntCoef {
    /// Tuned towards the target entropy, starting at `initial`.
    Auto { initial: f64 },
    /// Fixed at this value.
    Fixed(f64),
}

/// SAC hyperparameters (names and defaults as Stable-Baselines3's `SAC`,
/// without gSDE).
///
/// The env-runners' fragments become 1-step transitions in the
/// replay-buffer's off-policy table (as DQN's, actions in env units, at
/// most `buffer_size`, oldest evicted first, uniform sampling). Once more
/// than `learning_starts` env steps were inserted, the learner takes
/// `gradient_steps` SAC gradient steps of `batch_size` transitions per
/// `train_freq` env steps inserted and publishes the actor as a weights
/// version after each round. The inference servers sample the
/// tanh-squashed Gaussian actor (env units); the evaluator asks
/// deterministic actions, `tanh(μ)` scaled. Needs a continuous (Box)
/// action space.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SacSection {
    /// Learning rate of the three Adam optimizers (actor, critics, `log α`),
    /// a schedule over training progress. SB3: 3e-4.
    pub learning_rate: Schedule,
    /// Transitions the off-policy table holds; past it the oldest are evicted. SB3: 1,000,000.
    pub buffer_size: u64,
    /// Env steps inserted before the first gradient step. SB3: 100.
    pub learning_starts: u64,
    /// Transitions per gradient step. SB3: 256.
    pub batch_size: usize,
    /// Polyak coefficient of the target critics. SB3: 0.005.
    pub tau: f64,
    /// Discount factor. SB3: 0.99.
    pub gamma: f64,
    /// Env steps (inserted, all env-runners together) per training round. SB3: 1.
    pub train_freq: u64,
    /// Gradient steps per training round. SB3: 1.
    pub gradient_steps: usize,
    /// Entropy coefficient α: `"auto"` (tuned towards `target_entropy`,
    /// starting at 1), `"auto_<init>"` (tuned, starting at `<init>`, e.g.
    /// `"auto_0.1"`) or a number (fixed). SB3: `"auto"`.
    pub ent_coef: NumberOrName,
    /// Entropy target of the tuned α: `"auto"` is `-action_dim`, or a
    /// number. SB3: `"auto"`.
    pub target_entropy: NumberOrName,
    /// Gradient steps between Polyak updates of the target critics. SB3: 1.
    pub target_update_interval: u64,
    /// Hidden widths of the actor and of each of the two critics (ReLU). SB3: [256, 256].
    pub net_arch: Vec<usize>,
    /// Lower clamp of the actor's log std. SB3: -20.
    pub log_std_min: f64,
    /// Upper clamp of the actor's log std. SB3: 2.
    pub log_std_max: f64,
    /// Write a checkpoint every this many training rounds (and at stop, at
    /// the first eval and at each new best eval mean).
    pub checkpoint_every: u64,
    /// Numbered checkpoints kept besides the pinned ones and the best.
    pub keep_checkpoints: usize,
    /// Threads one gradient step runs on, 1 or 2: with 2 the twin critics'
    /// halves of each stage (targets, critic loss and backward, the actor
    /// loss's action gradients) run side by side. The result is the same
    /// either way; 2 takes a SAC step on Pendulum sizes from 5.9 to 3.9 ms
    /// on two cores. Not an SB3 setting.
    pub threads: usize,
}

impl Default for SacSection {
    fn default() -> Self {
        Self {
            learning_rate: Schedule::constant(3e-4),
            buffer_size: 1_000_000,
            learning_starts: 100,
            batch_size: 256,
            tau: 0.005,
            gamma: 0.99,
            train_freq: 1,
            gradient_steps: 1,
            ent_coef: NumberOrName::Name("auto".into()),
            target_entropy: NumberOrName::Name("auto".into()),
            target_update_interval: 1,
            net_arch: vec![256, 256],
            log_std_min: -20.0,
            log_std_max: 2.0,
            checkpoint_every: 1000,
            keep_checkpoints: 5,
            threads: 2,
        }
    }
}

impl SacSection {
    /// The entropy coefficient setting; the error names `sac.ent_coef`.
    pub fn ent_coef(&self) -> Result<EntCoef, ConfigError> {
        let bad = |detail: String| invalid("sac.ent_coef", detail);
        match &self.ent_coef {
            NumberOrName::Number(v) if v.is_finite() && *v > 0.0 => Ok(EntCoef::Fixed(*v)),
            NumberOrName::Number(v) => Err(bad(format!("a fixed value must be > 0, got {v}"))),
            NumberOrName::Name(name) if name == "auto" => Ok(EntCoef::Auto { initial: 1.0 }),
            NumberOrName::Name(name) => match name.strip_prefix("auto_").map(str::parse::<f64>) {
                Some(Ok(v)) if v.is_finite() && v > 0.0 => Ok(EntCoef::Auto { initial: v }),
                _ => Err(bad(format!(
                    "{name:?} is not \"auto\", \"auto_<initial value > 0>\" (e.g. \"auto_0.1\") or a number > 0"
                ))),
            },
        }
    }

    /// The entropy target for `action_dim` action dimensions; the error
    /// names `sac.target_entropy`.
    pub fn target_entropy_for(&self, action_dim: usize) -> Result<f64, ConfigError> {
        match &self.target_entropy {
            NumberOrName::Number(v) if v.is_finite() => Ok(*v),
            NumberOrName::Name(name) if name == "auto" => Ok(-(action_dim as f64)),
            other => Err(invalid(
                "sac.target_entropy",
                format!("{other:?} is not \"auto\" or a finite number"),
            )),
        }
    }
}

impl ExperimentConfig {
    pub(crate) fn validate_sac(&self) -> Result<(), ConfigError> {
        let s = &self.sac;
        schedule("sac.learning_rate", &s.learning_rate, true)?;
        positive(
            "sac.buffer_size",
            s.buffer_size.min(usize::MAX as u64) as usize,
        )?;
        if s.buffer_size > 1 << 24 {
            return Err(invalid(
                "sac.buffer_size",
                format!(
                    "{} is above the table's limit of 16,777,216 transitions",
                    s.buffer_size
                ),
            ));
        }
        positive("sac.batch_size", s.batch_size)?;
        unit_interval("sac.tau", s.tau)?;
        unit_interval("sac.gamma", s.gamma)?;
        positive(
            "sac.train_freq",
            s.train_freq.min(usize::MAX as u64) as usize,
        )?;
        positive("sac.gradient_steps", s.gradient_steps)?;
        positive(
            "sac.target_update_interval",
            s.target_update_interval.min(usize::MAX as u64) as usize,
        )?;
        s.ent_coef()?;
        s.target_entropy_for(1)?;
        if s.net_arch.is_empty() || s.net_arch.contains(&0) {
            return Err(invalid(
                "sac.net_arch",
                format!(
                    "needs at least one hidden layer, each of width >= 1, got {:?}",
                    s.net_arch
                ),
            ));
        }
        if !(s.log_std_min.is_finite() && s.log_std_max.is_finite())
            || s.log_std_min >= s.log_std_max
        {
            return Err(invalid(
                "sac.log_std_min",
                format!(
                    "must be finite and below sac.log_std_max, got {} and {}",
                    s.log_std_min, s.log_std_max
                ),
            ));
        }
        positive("sac.checkpoint_every", s.checkpoint_every as usize)?;
        positive("sac.keep_checkpoints", s.keep_checkpoints)?;
        if !(1..=2).contains(&s.threads) {
            return Err(invalid(
                "sac.threads",
                format!(
                    "must be 1 or 2 (the step has two halves), got {}",
                    s.threads
                ),
            ));
        }
        if self.run.algo == Algo::Sac {
            if let Some(env) = self.builtin_env_spec() {
                if !matches!(env.action_space, relay_envs::ActionSpace::Box { .. }) {
                    return Err(invalid(
                        "run.algo",
                        format!(
                            "sac needs continuous (Box) actions; {} has discrete ones (use dqn, ppo, a2c or reinforce)",
                            self.run.env_id
                        ),
                    ));
                }
            }
            if s.batch_size as u64 > s.buffer_size {
                return Err(invalid(
                    "sac.batch_size",
                    format!(
                        "{} is larger than sac.buffer_size ({})",
                        s.batch_size, s.buffer_size
                    ),
                ));
            }
        }
        Ok(())
    }
}
