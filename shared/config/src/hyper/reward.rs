//! Reward shaping of text games: per-game normalisation, format bonus,
//! invalid-move penalty, discount over a seat's moves, a draw's reward.
//! relay-llm's `reward` applies it.

use serde::{Deserialize, Serialize};

use crate::check::FieldError;

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
    pub fn validate(&self) -> Result<(), FieldError> {
        if !self.format_bonus.is_finite() {
            return Err(FieldError::new("format_bonus", "must be finite"));
        }
        if !self.invalid_move_penalty.is_finite() {
            return Err(FieldError::new("invalid_move_penalty", "must be finite"));
        }
        if self.draw.is_some_and(|d| !d.is_finite()) {
            return Err(FieldError::new("draw", "must be finite"));
        }
        if !(self.discount > 0.0 && self.discount <= 1.0) {
            return Err(FieldError::new("discount", "must be in (0, 1]"));
        }
        if let Some(n) = &self.normalize {
            if !(n.eps.is_finite() && n.eps > 0.0) {
                return Err(FieldError::new("normalize.eps", "must be > 0"));
            }
            if n.clip.is_some_and(|c| c.is_nan() || c <= 0.0) {
                return Err(FieldError::new("normalize.clip", "must be > 0"));
            }
        }
        Ok(())
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
