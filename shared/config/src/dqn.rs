//! The `dqn` section: DQN's hyperparameters (rl-zoo's defaults), its
//! cross-section checks, and the replay-buffer's off-policy table a run
//! with an off-policy algorithm uses ([`OffPolicyTable`]).

use crate::hyper::schedule::Schedule;
use serde::{Deserialize, Serialize};

use crate::check::{
    invalid, non_negative_f, positive, positive_f, schedule, unit_interval, ConfigError,
};
use crate::experiment::ExperimentConfig;
use crate::run::Algo;

/// DQN hyperparameters (names and defaults as Stable-Baselines3's `DQN`;
/// prioritized replay as Schaul et al. 2016, proportional variant).
///
/// The env-runners' fragments become transitions in the replay-buffer's
/// off-policy table (`relay:<run>:offpolicy:*`, at most `buffer_size`,
/// oldest evicted first), with `n_steps`-step returns computed at insert.
/// Once more than `learning_starts` env steps were inserted, the learner
/// takes `gradient_steps` gradient steps of `batch_size` transitions per
/// `train_freq` env steps inserted, updates the target network every
/// `target_update_interval` env steps and publishes a weights version
/// after each round. The inference servers act epsilon-greedily with the
/// `exploration_*` schedule at the published version's env steps; the
/// evaluator acts greedily. Network widths and activation come from
/// `policy.hidden` and `policy.activation`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DqnConfig {
    /// Learning rate of Adam (a schedule over training progress). SB3: 1e-4.
    pub learning_rate: Schedule,
    /// Transitions the off-policy table holds; past it the oldest are evicted. SB3: 1,000,000.
    pub buffer_size: u64,
    /// Env steps inserted before the first gradient step. SB3: 100.
    pub learning_starts: u64,
    /// Transitions per gradient step. SB3: 32.
    pub batch_size: usize,
    /// Target network update coefficient: 1 copies the online network (hard
    /// update), below 1 is a Polyak average. SB3: 1.0.
    pub tau: f64,
    /// Discount factor. SB3: 0.99.
    pub gamma: f64,
    /// Env steps (inserted, all env-runners together) per training round. SB3: 4.
    pub train_freq: u64,
    /// Gradient steps per training round. SB3: 1.
    pub gradient_steps: usize,
    /// Env steps between target network updates. SB3: 10,000.
    pub target_update_interval: u64,
    /// Fraction of `run.total_env_steps` over which epsilon falls linearly
    /// from `exploration_initial_eps` to `exploration_final_eps`. SB3: 0.1.
    pub exploration_fraction: f64,
    /// Epsilon at the start. SB3: 1.0.
    pub exploration_initial_eps: f64,
    /// Epsilon after `exploration_fraction` of the budget. SB3: 0.05.
    pub exploration_final_eps: f64,
    /// Global gradient-norm clip. SB3: 10.
    pub max_grad_norm: f64,
    /// Steps of the returns (`R = Σ_{i<k} γ^i r_i`, bootstrap with `γ^k`);
    /// 1 is SB3's DQN.
    pub n_steps: usize,
    /// Double DQN: the online network picks the next action, the target
    /// network values it. SB3's DQN: false.
    pub double_q: bool,
    /// Dueling Q-network (value and mean-subtracted advantage streams). Default false.
    pub dueling: bool,
    /// Huber loss threshold (1.0 is SB3's `smooth_l1_loss`).
    pub huber_delta: f64,
    /// Adam epsilon (PyTorch's default, which SB3 uses).
    pub adam_eps: f64,
    /// Prioritized replay (proportional): sample transition `i` with
    /// probability `p_i^α / Σ p^α`; new transitions get the largest priority
    /// seen; the learner sends `|td error| + prioritized_eps` back after
    /// each step. False samples uniformly (SB3).
    pub prioritized: bool,
    /// Priority exponent α (0 is uniform). Schaul et al.: 0.6.
    pub prioritized_alpha: f64,
    /// Importance-sampling exponent β (a schedule over training progress,
    /// annealed towards 1). Schaul et al.: 0.4 to 1.0.
    pub prioritized_beta: Schedule,
    /// Added to `|td error|` so that no priority is 0.
    pub prioritized_eps: f64,
    /// Write a checkpoint every this many training rounds (and at stop, at
    /// the first eval and at each new best eval mean).
    pub checkpoint_every: u64,
    /// Numbered checkpoints kept besides the pinned ones and the best.
    pub keep_checkpoints: usize,
}

impl Default for DqnConfig {
    fn default() -> Self {
        Self {
            learning_rate: Schedule::constant(1e-4),
            buffer_size: 1_000_000,
            learning_starts: 100,
            batch_size: 32,
            tau: 1.0,
            gamma: 0.99,
            train_freq: 4,
            gradient_steps: 1,
            target_update_interval: 10_000,
            exploration_fraction: 0.1,
            exploration_initial_eps: 1.0,
            exploration_final_eps: 0.05,
            max_grad_norm: 10.0,
            n_steps: 1,
            double_q: false,
            dueling: false,
            huber_delta: 1.0,
            adam_eps: 1e-8,
            prioritized: false,
            prioritized_alpha: 0.6,
            prioritized_beta: Schedule::linear(0.4, 1.0),
            prioritized_eps: 1e-6,
            checkpoint_every: 100,
            keep_checkpoints: 5,
        }
    }
}

impl DqnConfig {
    /// Epsilon at `progress` (`env_steps / run.total_env_steps`): SB3's
    /// `get_linear_fn(initial, final, exploration_fraction)`.
    pub fn exploration_rate(&self, progress: f64) -> f64 {
        let (a, b) = (self.exploration_initial_eps, self.exploration_final_eps);
        if self.exploration_fraction <= 0.0 || progress >= self.exploration_fraction {
            return b;
        }
        a + (b - a) * (progress.max(0.0) / self.exploration_fraction)
    }
}

/// What the replay-buffer's off-policy table needs to know (from the
/// algorithm's section, so another off-policy learner can supply its own).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OffPolicyTable {
    /// Transitions held; the oldest are evicted past it.
    pub capacity: u64,
    /// Steps of the returns computed at insert.
    pub n_steps: usize,
    /// Discount of those returns.
    pub gamma: f64,
    /// Prioritized (proportional) or uniform sampling.
    pub prioritized: bool,
    /// Priority exponent α.
    pub alpha: f64,
}

impl ExperimentConfig {
    pub(crate) fn validate_dqn(&self) -> Result<(), ConfigError> {
        let d = &self.dqn;
        schedule("dqn.learning_rate", &d.learning_rate, true)?;
        positive(
            "dqn.buffer_size",
            d.buffer_size.min(usize::MAX as u64) as usize,
        )?;
        if d.buffer_size > 1 << 24 {
            return Err(invalid(
                "dqn.buffer_size",
                format!(
                    "{} is above the table's limit of 16,777,216 transitions",
                    d.buffer_size
                ),
            ));
        }
        positive("dqn.batch_size", d.batch_size)?;
        if !(d.tau.is_finite() && d.tau > 0.0 && d.tau <= 1.0) {
            return Err(invalid(
                "dqn.tau",
                format!("must be in (0, 1], got {}", d.tau),
            ));
        }
        unit_interval("dqn.gamma", d.gamma)?;
        positive(
            "dqn.train_freq",
            d.train_freq.min(usize::MAX as u64) as usize,
        )?;
        positive("dqn.gradient_steps", d.gradient_steps)?;
        positive(
            "dqn.target_update_interval",
            d.target_update_interval.min(usize::MAX as u64) as usize,
        )?;
        unit_interval("dqn.exploration_fraction", d.exploration_fraction)?;
        unit_interval("dqn.exploration_initial_eps", d.exploration_initial_eps)?;
        unit_interval("dqn.exploration_final_eps", d.exploration_final_eps)?;
        positive_f("dqn.max_grad_norm", d.max_grad_norm)?;
        positive("dqn.n_steps", d.n_steps)?;
        if d.n_steps > 100 {
            return Err(invalid(
                "dqn.n_steps",
                format!("must be at most 100, got {}", d.n_steps),
            ));
        }
        positive_f("dqn.huber_delta", d.huber_delta)?;
        positive_f("dqn.adam_eps", d.adam_eps)?;
        non_negative_f("dqn.prioritized_alpha", d.prioritized_alpha)?;
        schedule("dqn.prioritized_beta", &d.prioritized_beta, false)?;
        for q in [0.0, 1.0] {
            let beta = d.prioritized_beta.value(q);
            if !(0.0..=1.0).contains(&beta) {
                return Err(invalid(
                    "dqn.prioritized_beta",
                    format!("must stay in [0, 1], is {beta} at progress {q}"),
                ));
            }
        }
        positive_f("dqn.prioritized_eps", d.prioritized_eps)?;
        positive("dqn.checkpoint_every", d.checkpoint_every as usize)?;
        positive("dqn.keep_checkpoints", d.keep_checkpoints)?;
        if self.run.algo == Algo::Dqn {
            if let Some(env) = self.builtin_env_spec() {
                if !matches!(env.action_space, relay_envs::ActionSpace::Discrete { .. }) {
                    return Err(invalid(
                        "run.algo",
                        format!(
                            "dqn needs discrete actions; {} has continuous ones",
                            self.run.env_id
                        ),
                    ));
                }
            }
            if d.batch_size as u64 > d.buffer_size {
                return Err(invalid(
                    "dqn.batch_size",
                    format!(
                        "{} is larger than dqn.buffer_size ({})",
                        d.batch_size, d.buffer_size
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The replay-buffer's off-policy table of this run, if its algorithm
    /// trains off-policy (`dqn`, `sac`: 1-step, uniform); none for the
    /// on-policy FIFO.
    pub fn off_policy_table(&self) -> Option<OffPolicyTable> {
        if self.is_text_game() {
            return None;
        }
        match self.run.algo {
            Algo::Dqn => Some(OffPolicyTable {
                capacity: self.dqn.buffer_size,
                n_steps: self.dqn.n_steps,
                gamma: self.dqn.gamma,
                prioritized: self.dqn.prioritized,
                alpha: self.dqn.prioritized_alpha,
            }),
            Algo::Sac => Some(OffPolicyTable {
                capacity: self.sac.buffer_size,
                n_steps: 1,
                gamma: self.sac.gamma,
                prioritized: false,
                alpha: 0.0,
            }),
            Algo::Ppo | Algo::A2c | Algo::Reinforce => None,
        }
    }
}
