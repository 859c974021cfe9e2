//! The replay ratio: how many env steps the learner samples per env step
//! the env-runners insert (`replay.samples_per_insert`), and the
//! replay-buffer's rate limiter that holds a run to it.
//!
//! An off-policy run (DQN, SAC) keeps the ratio its `train_freq`,
//! `gradient_steps` and `batch_size` state, as Stable-Baselines3's loop
//! does by construction, whatever the speed of either side: by default
//! (`auto`) the limiter refuses inserts that would run further ahead of the
//! learner than its slack, so the env side waits. Without it a fast env
//! side on a slow learner trains at whatever ratio the two speeds give
//! (a Hopper SAC run made 29 env steps per gradient step instead of 1).
//! A user who wants that asks for it (`off`); the learner then reports the
//! ratio it reached (`learner_gradient_steps_per_env_step`).

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::check::{invalid, positive_f, ConfigError};
use crate::experiment::ExperimentConfig;
use crate::run::Algo;

/// `replay.samples_per_insert`: `auto`, `off` or a ratio.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum SamplesPerInsert {
    /// Off-policy runs: `gradient_steps x batch_size / train_freq` of the
    /// algorithm's section (its own schedule), with `min_size_to_sample`
    /// at least `learning_starts` and a slack of at least two fragments.
    /// On-policy and text runs: no limiter (the FIFO's capacity and the
    /// policy lag bound the data).
    #[default]
    Auto,
    /// No limiter: the env side runs as fast as it can.
    Off,
    /// Env steps taken out per env step inserted (transitions sampled per
    /// transition inserted in an off-policy table).
    Ratio(f64),
}

impl Serialize for SamplesPerInsert {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Auto => s.serialize_str("auto"),
            Self::Off => s.serialize_str("off"),
            Self::Ratio(r) => s.serialize_f64(*r),
        }
    }
}

impl<'de> Deserialize<'de> for SamplesPerInsert {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Ratio(f64),
            Name(String),
            // What `null` meant before `auto` existed: no limiter (a run
            // directory's saved config).
            Null(()),
        }
        match Raw::deserialize(d)? {
            Raw::Ratio(r) => Ok(Self::Ratio(r)),
            Raw::Null(()) => Ok(Self::Off),
            Raw::Name(name) => match name.as_str() {
                "auto" => Ok(Self::Auto),
                "off" => Ok(Self::Off),
                other => Err(serde::de::Error::custom(format!(
                    "replay.samples_per_insert is `auto`, `off` or a number, not {other:?}"
                ))),
            },
        }
    }
}

/// The rate limiter a run gets ([`ExperimentConfig::rate_limit`]), as
/// Reverb's `SampleToInsertRatio`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateLimit {
    /// Env steps taken out per env step inserted.
    pub samples_per_insert: f64,
    /// Env steps inserted before any sample.
    pub min_size_to_sample: u64,
    /// Slack, in samples.
    pub error_buffer: u64,
    /// Whether `samples_per_insert` came from the algorithm's schedule
    /// (`auto`) rather than the config.
    pub derived: bool,
}

impl RateLimit {
    /// The most `inserted x ratio - taken` may reach after an insert.
    pub fn max_diff(&self) -> f64 {
        self.samples_per_insert * self.min_size_to_sample as f64 + self.error_buffer as f64
    }

    /// The least `inserted x ratio - taken` must be for a sample to take.
    pub fn min_diff(&self) -> f64 {
        self.samples_per_insert * self.min_size_to_sample as f64 - self.error_buffer as f64
    }
}

impl ExperimentConfig {
    /// An off-policy run's schedule: `(learning_starts, train_freq,
    /// gradient_steps, batch_size)`; `None` for other runs.
    fn off_policy_schedule(&self) -> Option<(u64, u64, usize, usize)> {
        self.off_policy_table()?;
        match self.run.algo {
            Algo::Dqn => Some((
                self.dqn.learning_starts,
                self.dqn.train_freq,
                self.dqn.gradient_steps,
                self.dqn.batch_size,
            )),
            Algo::Sac => Some((
                self.sac.learning_starts,
                self.sac.train_freq,
                self.sac.gradient_steps,
                self.sac.batch_size,
            )),
            Algo::Ppo | Algo::A2c | Algo::Reinforce => None,
        }
    }

    /// Env steps of one env-runner fragment (`num_envs x fragment_steps`).
    fn fragment_env_steps(&self) -> u64 {
        (self.env_runner.num_envs * self.env_runner.fragment_steps) as u64
    }

    /// The replay-buffer's rate limiter for this run, `None` without one
    /// (see [`SamplesPerInsert`]).
    pub fn rate_limit(&self) -> Option<RateLimit> {
        let replay = &self.replay;
        match replay.samples_per_insert {
            SamplesPerInsert::Off => None,
            SamplesPerInsert::Ratio(samples_per_insert) => Some(RateLimit {
                samples_per_insert,
                min_size_to_sample: replay.min_size_to_sample,
                error_buffer: replay.rate_error_buffer,
                derived: false,
            }),
            SamplesPerInsert::Auto => {
                let (learning_starts, train_freq, gradient_steps, batch_size) =
                    self.off_policy_schedule()?;
                let ratio = (gradient_steps * batch_size) as f64 / train_freq as f64;
                // Two fragments of slack: one being inserted while the
                // learner samples the one before.
                let two_fragments = (2.0 * ratio * self.fragment_env_steps() as f64).ceil() as u64;
                Some(RateLimit {
                    samples_per_insert: ratio,
                    min_size_to_sample: replay.min_size_to_sample.max(learning_starts),
                    error_buffer: replay.rate_error_buffer.max(two_fragments),
                    derived: true,
                })
            }
        }
    }

    /// Checks the limiter: a positive ratio, and one fragment fits in its
    /// slack, or no insert could ever pass.
    pub(crate) fn validate_rate_limit(&self) -> Result<(), ConfigError> {
        if let SamplesPerInsert::Ratio(ratio) = self.replay.samples_per_insert {
            positive_f("replay.samples_per_insert", ratio)?;
        }
        let Some(limit) = self.rate_limit() else {
            return Ok(());
        };
        // DQN and SAC sample on their own schedule, as many draws per env
        // step as the ratio once learning_starts steps are in: the slack
        // left above that is the error buffer (and what min_size_to_sample
        // holds beyond learning_starts).
        let ratio = limit.samples_per_insert;
        let fragment = self.fragment_env_steps() as f64;
        let min_size = limit.min_size_to_sample as f64;
        let held = match self.off_policy_schedule() {
            Some((learning_starts, ..)) => (min_size - learning_starts as f64).max(0.0),
            None => min_size,
        };
        let buffer = limit.error_buffer as f64;
        if ratio * fragment > ratio * held + buffer {
            let needed = (ratio * (fragment - held)).ceil() as u64;
            return Err(invalid(
                "replay.rate_error_buffer",
                format!(
                    "is {buffer}, which admits {:.0} env steps beyond what the learner has sampled, less than one fragment of {fragment} (env_runner.num_envs x fragment_steps): no insert could pass; set it to at least {needed}, or fewer env_runner.fragment_steps",
                    held + buffer / ratio
                ),
            ));
        }
        Ok(())
    }

    /// The line `relay up` prints for an off-policy run: the replay ratio
    /// it will keep, and where it came from; `None` for other runs.
    pub fn replay_ratio_summary(&self) -> Option<String> {
        let (_, train_freq, gradient_steps, batch_size) = self.off_policy_schedule()?;
        let per_env_step = gradient_steps as f64 / train_freq as f64;
        Some(match self.rate_limit() {
            Some(limit) => {
                let source = if limit.derived {
                    format!(
                        "replay.samples_per_insert auto: {gradient_steps} x {batch_size} / {train_freq}"
                    )
                } else {
                    "replay.samples_per_insert".to_string()
                };
                format!(
                    "replay ratio {per_env_step} gradient step(s) of {batch_size} per env step: the replay buffer holds env-runners to {} samples per env step inserted ({source}; slack {} samples, learning from {} env steps)",
                    limit.samples_per_insert, limit.error_buffer, limit.min_size_to_sample
                )
            }
            None => format!(
                "replay ratio not held (replay.samples_per_insert: off): env-runners run ahead of the learner's {per_env_step} gradient step(s) per env step; the learner reports the ratio reached (learner_gradient_steps_per_env_step)"
            ),
        })
    }
}
