//! The per-service sections: `env_runner`, `inference`, `replay`, `tracker`.

use serde::{Deserialize, Serialize};

/// env-runner settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EnvRunnerConfig {
    /// Environments stepped together by each env-runner copy.
    pub num_envs: usize,
    /// Vector steps per rollout fragment sent to the replay buffer.
    pub fragment_steps: usize,
    /// Compute threads (candle/rayon) for this process.
    pub threads: usize,
    /// On-policy runs (PPO, A2C): while the replay buffer holds a whole
    /// rollout (`ppo.rollout_steps`; `a2c.n_steps` x `num_envs`) for the
    /// learner, this copy begins no fragment but waits for the learner's
    /// next version. The learner trains each version on one rollout, so
    /// steps acted beyond it would wait until they are too old and be
    /// dropped as stale: CPU taken from the learner for nothing (a 2-core
    /// Breakout run dropped 40 % of its env steps; paced it trained 17 %
    /// more env steps a second). Off by default: with cheap envs the wait
    /// for each version costs more than the steps it saves (CartPole
    /// solved in 2.56-2.73 s paced, 2.35 s not).
    pub pace: bool,
    /// The longest such wait, in seconds: a learner that needs more data
    /// without a newer version (a rollout it had to drop, a restart from an
    /// older checkpoint) gets it after this long.
    pub pace_timeout_s: f64,
}

impl Default for EnvRunnerConfig {
    fn default() -> Self {
        Self {
            num_envs: 8,
            fragment_steps: 32,
            threads: 1,
            pace: false,
            pace_timeout_s: 30.0,
        }
    }
}

/// inference-server settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct InferenceConfig {
    /// Largest number of observations run in one forward pass.
    pub max_batch: usize,
    /// After taking every request already queued, how long a batch waits for
    /// more before the forward pass (0: never wait; right for few env-runners).
    pub batch_wait_us: u64,
    /// Compute threads (candle/rayon) for this process.
    pub threads: usize,
}

impl Default for InferenceConfig {
    fn default() -> Self {
        Self {
            max_batch: 512,
            batch_wait_us: 0,
            threads: 1,
        }
    }
}

/// replay-buffer settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReplayConfig {
    /// Env steps the on-policy FIFO holds before refusing inserts (backpressure).
    pub capacity_steps: u64,
    /// Fragments acted by a policy more than this many versions behind the
    /// learner are dropped (and counted).
    pub max_policy_lag: u64,
    /// How long an env-runner waits before retrying a refused insert (after
    /// the rate limiter's refusals, twice as long with each one in a row,
    /// up to 16 ms).
    pub retry_after_ms: u32,
    /// Rate limiter (as Reverb's `SampleToInsertRatio`): env steps taken out
    /// per env step inserted (DQN's off-policy table: transitions sampled
    /// per env step inserted; `rate_error_buffer` then counts samples). None disables it (the FIFO's capacity and the
    /// policy lag still bound the data). With it, an insert is refused
    /// ("rate") while `inserted * ratio - taken` would exceed
    /// `ratio * min_size_to_sample + rate_error_buffer`, and a sample takes
    /// nothing while fewer than `min_size_to_sample` steps were inserted or
    /// `inserted * ratio - taken` is under `ratio * min_size_to_sample -
    /// rate_error_buffer`. Taken counts sampled and stale-dropped steps.
    pub samples_per_insert: Option<f64>,
    /// Env steps inserted before the learner may sample (rate limiter).
    pub min_size_to_sample: u64,
    /// Slack of the rate limiter, in env steps.
    pub rate_error_buffer: u64,
    /// Text runs: games that ended more than this many seconds before the
    /// learner samples them are dropped (counted as `too_old`) whatever
    /// their adapter version: the bound in time beside `max_policy_lag`'s
    /// in versions (slow learners, stalled runs, a queue of old games
    /// after a restart). None: versions only.
    pub max_age_s: Option<f64>,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        Self {
            capacity_steps: 8192,
            max_policy_lag: 1,
            retry_after_ms: 5,
            samples_per_insert: None,
            min_size_to_sample: 0,
            rate_error_buffer: 8192,
            max_age_s: None,
        }
    }
}

/// tracker settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrackerConfig {
    /// Write metrics to `runs/<id>/metrics.jsonl`.
    pub write_metrics: bool,
    /// How often buffered metric lines are flushed to disk.
    pub flush_ms: u64,
}

impl Default for TrackerConfig {
    fn default() -> Self {
        Self {
            write_metrics: true,
            flush_ms: 500,
        }
    }
}
