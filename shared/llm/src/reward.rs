//! Reward transforms applied to a finished game before it becomes
//! training examples: a draw's reward, per-environment normalisation of
//! the game's own reward, a format reward, a discount over the seat's
//! moves and an invalid-move penalty.
//!
//! This module owns [`GameResult`] (what the transforms read from a game),
//! the pure additive term [`format_reward`], [`RunningStats`] /
//! [`RewardNormalizer`] (running mean and standard deviation per
//! environment id) and [`RewardShaping`], which applies them in a fixed
//! order:
//!
//! ```text
//! reward = draw for a drawn game (when `draw` is set), else the game's own
//! seat = normalise_env(reward) + format_bonus · well_formatted_turns / turns
//! move = seat · discount^k − invalid_move_penalty   (k: the seat's later
//!        moves; the penalty only for a move the game refused)
//! ```
//!
//! The environment's own reward is normalised first (so that games with
//! different reward scales become comparable), and the format and
//! invalid-move terms are added after, in those normalised units, so a
//! given bonus means the same in every environment. The invalid-move
//! penalty lands on the refused move alone, not on the seat's other moves:
//! the credit goes where the mistake was. The normaliser is state the
//! learner keeps (and may checkpoint: it is serde).
//!
//! Why per game, and before the objective's own normalisation: in a
//! multi-game run (`text.games`) one batch holds games whose rewards live
//! on different scales and around different means (TicTacToe's ±1 against
//! a bot it mostly beats, Kuhn poker's chips). The objectives' group
//! baselines (`rloo`, `grpo`) only ever compare games of one game (group
//! ids never mix games), but the batch's advantage scale, the KL and
//! entropy terms and the learning rate are shared: without per-game
//! statistics the game with the larger or more lopsided rewards would
//! take most of the gradient. Normalising each game's raw reward by its
//! own running mean and std first puts every game in the same units;
//! the group normalisation then works on those units as it would on one
//! game's. (`reinforce` and `ppo`, without groups, get the same benefit
//! directly.)

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use relay_config::hyper::reward::{NormalizeConfig, RewardShaping};

/// One player's view of a finished game, as the reward transforms need it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GameResult {
    /// The environment id (`"TicTacToe-v0"`): the key of normalisation.
    pub env_id: String,
    /// The game's own final reward for this player (TextArena: 1 win,
    /// 0 draw, −1 loss, or the env's own scale).
    pub reward: f64,
    /// The game was a draw for this player: its reward ties the best of
    /// the other seats'.
    pub drawn: bool,
    /// Turns this player took.
    pub turns: u32,
    /// Of those, turns whose reply had the expected format (e.g. a move
    /// in brackets), whether or not the move was legal.
    pub well_formatted_turns: u32,
    /// Moves the environment rejected as invalid.
    pub invalid_moves: u32,
}

/// `bonus · well_formatted_turns / turns` (0 for a game without turns).
pub fn format_reward(result: &GameResult, bonus: f64) -> f64 {
    if result.turns == 0 {
        return 0.0;
    }
    bonus * f64::from(result.well_formatted_turns.min(result.turns)) / f64::from(result.turns)
}

/// Running mean and variance of a stream (Chan et al.'s parallel update,
/// as Gymnasium's `RunningMeanStd`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct RunningStats {
    /// Values seen.
    pub count: u64,
    /// Their mean.
    pub mean: f64,
    /// Their population variance.
    pub var: f64,
}

impl RunningStats {
    /// Adds a batch of values.
    pub fn update(&mut self, values: &[f64]) {
        if values.is_empty() {
            return;
        }
        let n = values.len() as f64;
        let mean = values.iter().sum::<f64>() / n;
        let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
        let total = self.count as f64 + n;
        let delta = mean - self.mean;
        let m2 =
            self.var * self.count as f64 + var * n + delta * delta * self.count as f64 * n / total;
        self.mean += delta * n / total;
        self.var = m2 / total;
        self.count += values.len() as u64;
    }

    /// Population standard deviation.
    pub fn std(&self) -> f64 {
        self.var.max(0.0).sqrt()
    }
}

/// Running reward statistics per environment id.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RewardNormalizer {
    /// Statistics per environment id.
    pub per_env: BTreeMap<String, RunningStats>,
}

impl RewardNormalizer {
    /// Updates `env_id`'s statistics with `rewards`, then returns them
    /// normalised: `(r − mean) / (std + eps)` (or `r / (std + eps)`
    /// without centring), clipped. The first rewards of an env are
    /// normalised by their own statistics.
    pub fn normalize(
        &mut self,
        config: &NormalizeConfig,
        env_id: &str,
        rewards: &[f64],
    ) -> Vec<f64> {
        let stats = self.per_env.entry(env_id.to_owned()).or_default();
        stats.update(rewards);
        let (mean, std) = (stats.mean, stats.std());
        rewards
            .iter()
            .map(|&r| {
                let centred = if config.center { r - mean } else { r };
                let z = centred / (std + config.eps);
                match config.clip {
                    Some(c) => z.clamp(-c, c),
                    None => z,
                }
            })
            .collect()
    }
}

/// Applies a run's [`RewardShaping`] (plain config data, defined in
/// relay-config) to game results.
pub trait ApplyShaping {
    /// The shaped reward of each result's seat, in order (before the
    /// per-move [`RewardShaping::move_reward`]). With normalisation, the
    /// results of each env update that env's statistics (all of this
    /// call's results of an env count as one batch).
    fn apply(&self, normalizer: &mut RewardNormalizer, results: &[GameResult]) -> Vec<f64>;
}

impl ApplyShaping for RewardShaping {
    fn apply(&self, normalizer: &mut RewardNormalizer, results: &[GameResult]) -> Vec<f64> {
        let mut env_rewards: Vec<f64> = results.iter().map(|r| game_reward(self, r)).collect();
        if let Some(config) = &self.normalize {
            let mut envs: Vec<&str> = results.iter().map(|r| r.env_id.as_str()).collect();
            envs.sort_unstable();
            envs.dedup();
            for env in envs {
                let idx: Vec<usize> = (0..results.len())
                    .filter(|&i| results[i].env_id == env)
                    .collect();
                let raw: Vec<f64> = idx.iter().map(|&i| env_rewards[i]).collect();
                for (i, z) in idx.into_iter().zip(normalizer.normalize(config, env, &raw)) {
                    env_rewards[i] = z;
                }
            }
        }
        results
            .iter()
            .zip(env_rewards)
            .map(|(r, base)| base + format_reward(r, self.format_bonus))
            .collect()
    }
}

/// The seat's reward before normalisation: the game's own, or `draw` for a
/// drawn game when it is set.
fn game_reward(shaping: &RewardShaping, result: &GameResult) -> f64 {
    match shaping.draw {
        Some(draw) if result.drawn => draw,
        _ => result.reward,
    }
}
