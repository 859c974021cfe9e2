//! The `rl` section: the token-level RL objective of text runs (REINFORCE,
//! RLOO, GRPO, Dr. GRPO, PPO presets), batches, optimizer and reward shaping.

use serde::{Deserialize, Serialize};

use crate::check::{invalid, positive, ConfigError};

/// Names of the RL objective presets (`rl.preset`).
pub const RL_PRESETS: [&str; 5] = ["reinforce", "rloo", "grpo", "dr_grpo", "ppo"];

/// The policy a text run's KL term measures against (`rl.kl_reference`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KlReference {
    /// The policy the run started from (the warm start's adapter, or the
    /// base model under a fresh adapter).
    #[default]
    Start,
    /// The base model without adapter.
    Base,
}

/// How the learner trains the LoRA adapter in text runs (see
/// `relay_llm::rl` for the objectives' formulas); ignored for
/// classic-control envs.
///
/// Each learning move of a game is one training sequence (its prompt and
/// completion tokens, the behaviour log-probs); its reward is its seat's
/// final game reward shaped by `reward`. Sequences are grouped (the
/// baselines of `rloo` and `grpo`) by the adapter version that played the
/// game and the seat it played from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RlConfig {
    /// Objective preset: `reinforce` (batch-mean baseline), `rloo`,
    /// `grpo` (DeepSeekMath: group-normalised advantages, PPO clip 0.2,
    /// k3 KL loss 0.04), `dr_grpo` (its length is `text.max_turn_tokens`),
    /// `ppo` (clip 0.2, batch-mean baseline).
    pub preset: String,
    /// A full objective (advantage, policy_loss, aggregation, kl,
    /// entropy_coef) that replaces the preset.
    pub objective: Option<crate::hyper::objective::ObjectiveConfig>,
    /// Most learning moves (sequences) per optimizer step; the learner
    /// gathers whole games up to it.
    pub batch_size: usize,
    /// Sequences per forward/backward pass (bounds memory; the gradients
    /// of one step are summed).
    pub minibatch_size: usize,
    /// Longest prompt plus completion trained on; at most the model's
    /// context + 1.
    pub max_seq_len: usize,
    /// Longer sequences: `cut_prompt_start` (keep the completion, cut the
    /// prompt's start) or `drop`.
    pub truncation: crate::hyper::objective::Truncation,
    /// On the candle backend (a GPU), recompute each block's activations
    /// in the backward pass instead of keeping them all (activation
    /// checkpointing: one block's memory, one more forward's compute;
    /// the same gradients). Ignored by the CPU engine.
    pub recompute_activations: bool,
    /// Optimizer steps on each batch (PPO-style epochs; 1 is on-policy).
    pub epochs: usize,
    /// Truncated importance sampling between the inference servers'
    /// token log-probs and the learner's: `{cap: 2.0}` weights each
    /// token's loss by `min(π_learner / π_sampler, cap)` and makes PPO's
    /// ratio relative to the learner's own log-probs (see
    /// `relay_llm::rl`); unset: off. Set over the preset's or
    /// `objective`'s.
    pub truncated_is: Option<crate::hyper::objective::TruncatedIs>,
    /// A KL term towards `kl_reference`: `{coef, estimator, mode}` (for
    /// example `{coef: 0.05, estimator: k3, mode: loss}`), set over the
    /// preset's or `objective`'s (`dr_grpo` has none); unset: theirs.
    pub kl: Option<crate::hyper::objective::KlConfig>,
    /// AdamW over the adapter: `lr`, `beta1`, `beta2`, `eps`,
    /// `weight_decay`, `max_grad_norm`.
    pub optimizer: crate::hyper::objective::AdamWConfig,
    /// Reward transforms: `invalid_move_penalty` (taken from each move the
    /// game refused), `format_bonus` (times the share of the seat's moves that
    /// contain a bracketed move such as `[4]`), `normalize` (`{center,
    /// eps, clip}`: each game's reward by its own running mean and std, per
    /// game id, before the objective's group normalisation; recommended for
    /// multi-game runs, see `relay_llm::reward`), `discount` (in `(0,
    /// 1]`: each move's reward times `discount^k`, `k` the seat's later
    /// moves in the game; 1 by default), `draw` (a drawn game's reward in
    /// place of the game's own; 1 counts a draw as a win, so that not
    /// losing is the objective; unset by default).
    pub reward: crate::hyper::reward::RewardShaping,
    /// What the objective's KL term measures against (unused without
    /// one): `start` (default), the policy the run started from: the
    /// adapter of `run.init_from` (a warm start, such as `relay sft`'s),
    /// kept in every checkpoint as `reference/` so that a resumed run
    /// measures against the same policy; with a fresh adapter (`B = 0`)
    /// that is exactly the base model. `base`: the base model without
    /// adapter (TRL's reference for a PEFT model), also after a warm start.
    pub kl_reference: KlReference,
    /// Write a checkpoint every this many updates (and at the end).
    pub checkpoint_every: u64,
    /// Numbered checkpoints kept (the newest ones, plus pinned ones).
    pub keep_checkpoints: usize,
}

impl Default for RlConfig {
    fn default() -> Self {
        Self {
            preset: "grpo".into(),
            objective: None,
            batch_size: 32,
            minibatch_size: 8,
            max_seq_len: 1024,
            truncation: crate::hyper::objective::Truncation::CutPromptStart,
            recompute_activations: true,
            epochs: 1,
            truncated_is: None,
            kl: None,
            optimizer: crate::hyper::objective::AdamWConfig {
                lr: 1e-4,
                ..Default::default()
            },
            reward: crate::hyper::reward::RewardShaping {
                normalize: None,
                format_bonus: 0.0,
                invalid_move_penalty: 0.1,
                ..Default::default()
            },
            kl_reference: KlReference::Start,
            checkpoint_every: 10,
            keep_checkpoints: 5,
        }
    }
}

impl RlConfig {
    /// The objective: `objective` if given, else the preset's.
    pub fn objective_config(
        &self,
        max_completion_len: usize,
    ) -> Result<crate::hyper::objective::ObjectiveConfig, ConfigError> {
        let mut objective = match &self.objective {
            Some(objective) => objective.clone(),
            None => self.preset_objective(max_completion_len)?,
        };
        if self.truncated_is.is_some() {
            objective.truncated_is = self.truncated_is;
        }
        if self.kl.is_some() {
            objective.kl = self.kl;
        }
        Ok(objective)
    }

    pub(crate) fn preset_objective(
        &self,
        max_completion_len: usize,
    ) -> Result<crate::hyper::objective::ObjectiveConfig, ConfigError> {
        Ok(match self.preset.as_str() {
            "reinforce" => crate::hyper::objective::ObjectiveConfig::reinforce(),
            "rloo" => crate::hyper::objective::ObjectiveConfig::rloo(),
            "grpo" => crate::hyper::objective::ObjectiveConfig::grpo(),
            "dr_grpo" => crate::hyper::objective::ObjectiveConfig::dr_grpo(max_completion_len),
            "ppo" => crate::hyper::objective::ObjectiveConfig::ppo(),
            other => {
                return Err(invalid(
                    "rl.preset",
                    format!("unknown preset {other:?}; known: {}", RL_PRESETS.join(", ")),
                ))
            }
        })
    }

    /// The trainer's whole configuration (`max_completion_len` sizes the
    /// `dr_grpo` preset).
    pub fn train_config(
        &self,
        max_completion_len: usize,
    ) -> Result<crate::hyper::objective::RlTrainConfig, ConfigError> {
        let config = crate::hyper::objective::RlTrainConfig {
            objective: self.objective_config(max_completion_len)?,
            batch: crate::hyper::objective::BatchConfig {
                batch_size: self.batch_size,
                minibatch_size: self.minibatch_size,
                max_seq_len: self.max_seq_len,
                truncation: self.truncation,
                recompute_activations: self.recompute_activations,
            },
            optimizer: self.optimizer.clone(),
        };
        config
            .validate()
            .map_err(|e| invalid("rl", e.to_string()))?;
        Ok(config)
    }

    pub(crate) fn validate(&self, max_completion_len: usize) -> Result<(), ConfigError> {
        positive("rl.batch_size", self.batch_size)?;
        positive("rl.minibatch_size", self.minibatch_size)?;
        positive("rl.epochs", self.epochs)?;
        positive("rl.checkpoint_every", self.checkpoint_every as usize)?;
        positive("rl.keep_checkpoints", self.keep_checkpoints)?;
        self.reward
            .validate()
            .map_err(|e| invalid("rl.reward", e.to_string()))?;
        self.train_config(max_completion_len).map(|_| ())
    }
}
