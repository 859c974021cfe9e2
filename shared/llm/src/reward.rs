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

use crate::train_error::{TrainError, TrainResult};

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

/// Per-environment reward normalisation settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NormalizeConfig {
    /// Subtract the running mean (otherwise only divide by the std).
    pub center: bool,
    /// Added to the std before dividing.
    pub eps: f64,
    /// Clip normalised rewards to `[-clip, clip]`; `None`: no clipping.
    pub clip: Option<f64>,
}

impl Default for NormalizeConfig {
    fn default() -> Self {
        Self {
            center: true,
            eps: 1e-8,
            clip: Some(10.0),
        }
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

/// The reward transforms of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RewardShaping {
    /// Normalise each environment's (each game's) own reward by that
    /// game's running mean and std, before the objective's group
    /// normalisation (see the module docs: in multi-game runs, so that no
    /// game dominates the gradient); `None`: leave it as the environment
    /// gave it.
    pub normalize: Option<NormalizeConfig>,
    /// Reward for a game whose every turn was well formatted (scaled by the
    /// fraction of well-formatted turns).
    pub format_bonus: f64,
    /// Subtracted from the reward of each move the game refused (that
    /// move only).
    pub invalid_move_penalty: f64,
    /// Discount per later move of the same seat, in `(0, 1]`: a move gets
    /// the seat's shaped reward times `discount^k`, `k` the seat's moves
    /// after it in the game. 1 gives every move the game's result; below
    /// 1 the result weighs most on the moves just before it (the one that
    /// won, the one that missed a block), which a terminal reward
    /// otherwise spreads evenly over the whole game.
    pub discount: f64,
    /// A drawn game's reward, in place of the game's own (TextArena's is
    /// 0); `None`: the game's own. Set to the win's reward (1), a draw
    /// counts as a win and the objective is not losing: the advantages
    /// then tell lost games from the others only, without the noise of
    /// which of a win or a draw the opponent's later moves allowed.
    pub draw: Option<f64>,
}

impl Default for RewardShaping {
    fn default() -> Self {
        Self {
            normalize: None,
            format_bonus: 0.0,
            invalid_move_penalty: 0.0,
            discount: 1.0,
            draw: None,
        }
    }
}

impl RewardShaping {
    /// Checks the fields.
    pub fn validate(&self) -> TrainResult<()> {
        if !self.format_bonus.is_finite() {
            return Err(TrainError::config("format_bonus", "must be finite"));
        }
        if !self.invalid_move_penalty.is_finite() {
            return Err(TrainError::config("invalid_move_penalty", "must be finite"));
        }
        if self.draw.is_some_and(|d| !d.is_finite()) {
            return Err(TrainError::config("draw", "must be finite"));
        }
        if !(self.discount > 0.0 && self.discount <= 1.0) {
            return Err(TrainError::config("discount", "must be in (0, 1]"));
        }
        if let Some(n) = &self.normalize {
            if !(n.eps.is_finite() && n.eps > 0.0) {
                return Err(TrainError::config("normalize.eps", "must be > 0"));
            }
            if n.clip.is_some_and(|c| c.is_nan() || c <= 0.0) {
                return Err(TrainError::config("normalize.clip", "must be > 0"));
            }
        }
        Ok(())
    }

    /// The seat's reward before normalisation: the game's own, or `draw`
    /// for a drawn game when it is set.
    fn game_reward(&self, result: &GameResult) -> f64 {
        match self.draw {
            Some(draw) if result.drawn => draw,
            _ => result.reward,
        }
    }

    /// The shaped reward of each result's seat, in order (before the
    /// per-move [`RewardShaping::move_reward`]). With normalisation, the
    /// results of each env update that env's statistics (all of this
    /// call's results of an env count as one batch).
    pub fn apply(&self, normalizer: &mut RewardNormalizer, results: &[GameResult]) -> Vec<f64> {
        let mut env_rewards: Vec<f64> = results.iter().map(|r| self.game_reward(r)).collect();
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

    /// The reward of one move of a seat whose shaped reward is `seat`,
    /// made `later_moves` moves of that seat before the game's end:
    /// discounted by `discount^later_moves`, less `invalid_move_penalty`
    /// if the game refused it.
    pub fn move_reward(&self, seat: f64, invalid: bool, later_moves: usize) -> f64 {
        let discounted = seat * self.discount.powi(later_moves as i32);
        if invalid {
            discounted - self.invalid_move_penalty
        } else {
            discounted
        }
    }
}
