//! What a text update reports ([`Report`]): the objective's figures
//! (means over the update's epochs, or the first epoch's where later ones
//! would only measure the policy moving), the games' rewards and
//! legal-move rate (also per game), and the counts since the last report.

use relay_llm::{RlStats, TokenExample};
use relay_proto::{counter, gauge, MetricValue};

use crate::examples::Converted;

/// One update as its report sees it.
pub(super) struct Report<'a> {
    /// Each epoch's statistics (at least one).
    pub(super) steps: &'a [RlStats],
    /// What the batch's games became (rank 0's; empty for a step redone
    /// after a failed view, which rank 0 did not draw).
    pub(super) converted: &'a Converted,
    pub(super) examples: &'a [TokenExample],
    /// Tokens that end a completion by themselves.
    pub(super) eos_ids: &'a [u32],
    pub(super) seconds: f64,
    pub(super) learning_rate: f64,
}

impl Report<'_> {
    /// The games' mean reward (0 with none).
    pub(super) fn reward_mean(&self) -> f64 {
        let rewards = &self.converted.game_rewards;
        if rewards.is_empty() {
            0.0
        } else {
            rewards.iter().sum::<f64>() / rewards.len() as f64
        }
    }

    fn mean(&self, f: fn(&RlStats) -> f64) -> f64 {
        self.steps.iter().map(f).sum::<f64>() / self.steps.len() as f64
    }

    fn trained_tokens(&self) -> usize {
        self.steps
            .iter()
            .map(|s| (s.mean_seq_len * s.sequences as f64) as usize)
            .sum()
    }

    /// The update's values as `version`, with the games dropped as stale,
    /// the sequences truncated and the tokens cut since the last report.
    pub(super) fn values(
        &self,
        version: u64,
        [dropped_stale, truncated, tokens_cut]: [u64; 3],
    ) -> impl Iterator<Item = MetricValue> + '_ {
        let first = self.steps[0];
        [
            gauge("learner_adapter_version", version as f64),
            gauge("learner_loss", self.mean(|s| s.loss)),
            gauge("learner_policy_loss", self.mean(|s| s.policy_loss)),
            gauge("learner_kl_ref", self.mean(|s| s.kl)),
            gauge("learner_entropy", self.mean(|s| s.entropy)),
            gauge("learner_grad_norm", self.mean(|s| s.grad_norm)),
            gauge("learner_learning_rate", self.learning_rate),
            gauge("learner_reward_mean", self.reward_mean()),
            gauge("learner_shaped_reward_mean", first.reward_mean),
            gauge("learner_advantage_std", first.advantage_std),
            gauge("learner_mean_seq_len", first.mean_seq_len),
            gauge("learner_completion_len", first.mean_completion_len),
            gauge("learner_kl_penalty", first.kl_penalty),
            // score minus the KL penalty, TRL's rlhf_reward
            gauge("learner_rlhf_reward", first.reward_mean - first.kl_penalty),
            gauge("learner_ratio_mean", self.mean(|s| s.ratio_mean)),
            gauge("learner_ratio_var", self.mean(|s| s.ratio_var)),
            gauge(
                "learner_sampler_logprob_diff_mean",
                first.sampler_logprob_diff_mean,
            ),
            gauge(
                "learner_sampler_logprob_diff_max",
                first.sampler_logprob_diff_max,
            ),
            gauge(
                "learner_tis_capped_fraction",
                self.mean(|s| s.tis_capped_fraction),
            ),
            gauge("learner_eos_rate", eos_rate(self.examples, self.eos_ids)),
            gauge(
                "learner_format_rate",
                rate(self.converted.well_formatted_moves, self.converted.moves),
            ),
            gauge(
                "learner_legal_move_rate",
                1.0 - rate(self.converted.invalid_moves, self.converted.moves),
            ),
            gauge("learner_sequences", first.sequences as f64),
            gauge(
                "learner_tokens_per_second",
                self.trained_tokens() as f64 / self.seconds.max(1e-9),
            ),
            counter("learner_truncated_sequences_total", truncated as f64),
            counter("learner_tokens_cut_total", tokens_cut as f64),
            gauge("learner_last_update_seconds", self.seconds),
            counter("learner_dropped_stale_games_total", dropped_stale as f64),
        ]
        .into_iter()
        .chain(
            (self.steps.len() > 1)
                .then(|| {
                    let between = &self.steps[1..];
                    [
                        gauge("learner_approx_kl", self.mean(|s| s.approx_kl)),
                        gauge("learner_clip_fraction", self.mean(|s| s.clip_fraction)),
                        gauge(
                            "learner_epoch_kl",
                            between.iter().map(|s| s.epoch_kl).sum::<f64>() / between.len() as f64,
                        ),
                    ]
                })
                .into_iter()
                .flatten(),
        )
        .chain(self.converted.per_game.iter().flat_map(|(game, f)| {
            [
                gauge("learner_game_reward_mean", f.reward_mean()),
                gauge("learner_game_legal_move_rate", f.legal_move_rate()),
                counter("learner_game_examples_total", f.examples as f64),
            ]
            .map(|v| v.with_label("game", game))
        }))
    }
}

/// `part / whole`, 0 when `whole` is 0.
fn rate(part: usize, whole: usize) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

/// Share of completions that end on an end-of-sequence token (the policy
/// stopped by itself rather than at `text.max_turn_tokens`).
fn eos_rate(examples: &[TokenExample], eos_ids: &[u32]) -> f64 {
    let ended = examples
        .iter()
        .filter(|e| e.completion.last().is_some_and(|t| eos_ids.contains(t)))
        .count();
    rate(ended, examples.len())
}
