//! The per-service sections: `env_runner`, `inference`, `learner`,
//! `replay`, `tracker`.

use serde::{Deserialize, Serialize};

use crate::check::{positive, unit_interval, ConfigError};
use crate::replay_ratio::SamplesPerInsert;

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

/// learner settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LearnerConfig {
    /// Learner replicas `relay up` starts (its `--learners` overrides it):
    /// synchronous data parallelism, each replica takes a share of every
    /// batch and the gradients are averaged, so the global batch is the
    /// config's whatever the count. Every algorithm (PPO, A2C, REINFORCE,
    /// DQN, SAC, and the text runs' LoRA objectives).
    pub replicas: usize,
    /// Shortest time between two weights versions an off-policy learner
    /// (DQN, SAC) publishes, in milliseconds. Its rounds can be one env
    /// step and a few milliseconds apart, and publishing each (serialised,
    /// digested, recorded, then fetched and loaded by every follower) costs
    /// about as much CPU as the round itself; a round that ends sooner
    /// after the last version is published with a later one, and the last
    /// round always is. The acting policy is then at most this much behind
    /// the learner, on top of the env-runner's fragments. 0 publishes every
    /// round. On-policy learners publish every update whatever this says
    /// (their lag is `replay.max_policy_lag`). Default 20.
    pub publish_interval_ms: u64,
}

impl Default for LearnerConfig {
    fn default() -> Self {
        Self {
            replicas: 1,
            publish_interval_ms: 20,
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
    /// per env step inserted (an off-policy table: transitions sampled per
    /// env step inserted; `rate_error_buffer` then counts samples). `auto`
    /// (the default): an off-policy run's own schedule, `gradient_steps x
    /// batch_size / train_freq`, and no limiter for other runs; `off`: none
    /// (the FIFO's capacity and the policy lag still bound the data; see
    /// [`crate::replay_ratio`]). With it, an insert is refused
    /// ("rate") while `inserted * ratio - taken` would exceed
    /// `ratio * min_size_to_sample + rate_error_buffer`, and a sample takes
    /// nothing while fewer than `min_size_to_sample` steps were inserted or
    /// `inserted * ratio - taken` is under `ratio * min_size_to_sample -
    /// rate_error_buffer`. Taken counts sampled and stale-dropped steps.
    pub samples_per_insert: SamplesPerInsert,
    /// Env steps inserted before the learner may sample (rate limiter; with
    /// `samples_per_insert: auto`, at least the algorithm's `learning_starts`).
    pub min_size_to_sample: u64,
    /// Slack of the rate limiter, in samples (env steps taken out; with
    /// `samples_per_insert: auto`, at least two fragments' worth).
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
            samples_per_insert: SamplesPerInsert::Auto,
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
    /// Text runs: the share of finished training games (`relay.<run>.games`)
    /// written to `runs/<id>/games.jsonl`, in `[0, 1]` (0: none, 1: every
    /// one). Which games is decided by a hash of each game (runner, seed,
    /// end time, branch), not by a random draw: the same games are written
    /// whichever tracker copy or restart hears them. Default 0.1: a fast
    /// run plays many games a second, and a tenth of them still shows what
    /// the policy does while the size bound covers ten times the stretch of
    /// training.
    pub games_train_rate: f64,
    /// Text runs: the share of evaluation games (`relay.<run>.eval.games`)
    /// written there, in `[0, 1]`, chosen the same way. Default 1: every
    /// game of every evaluation (they are few, and the ones a report sums up).
    pub games_eval_rate: f64,
    /// The most bytes the run's games take on disk (`null`: no bound). The
    /// newest games are kept: once writing a game would take `games.jsonl`
    /// past half of this, it is renamed `games.1.jsonl` (replacing the
    /// previous one, whose games are dropped) and a new `games.jsonl`
    /// begins, so the two files hold at most this many bytes. The tracker
    /// logs a warning the first time the bound is reached (and drops, with
    /// a warning, a single game larger than half of it); `relay games`
    /// reads both files. Default 256 MiB.
    pub games_max_bytes: Option<u64>,
}

impl Default for TrackerConfig {
    fn default() -> Self {
        Self {
            write_metrics: true,
            flush_ms: 500,
            games_train_rate: 0.1,
            games_eval_rate: 1.0,
            games_max_bytes: Some(256 << 20),
        }
    }
}

impl TrackerConfig {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        // tokio's interval panics on a zero period.
        positive("tracker.flush_ms", self.flush_ms as usize)?;
        unit_interval("tracker.games_train_rate", self.games_train_rate)?;
        unit_interval("tracker.games_eval_rate", self.games_eval_rate)?;
        if let Some(bytes) = self.games_max_bytes {
            positive("tracker.games_max_bytes", bytes as usize)?;
        }
        Ok(())
    }
}
