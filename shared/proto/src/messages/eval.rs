//! Evaluations: their reports and confirmations, the start notice that
//! keeps a version's weights, per-opponent matchups, and the switch to
//! another evaluator plugin.

use serde::{Deserialize, Serialize};

use super::invalid;
use crate::codec::{Rejection, WireMessage};

/// evaluator -> tracker, supervisor: the result of one evaluation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalReport {
    pub schema: u16,
    /// Name of the evaluator plugin that produced it, e.g. `greedy`.
    pub evaluator: String,
    pub instance: String,
    pub env_id: String,
    pub policy_version: u64,
    /// Env steps the learner had consumed when it published this version.
    pub learner_env_steps: u64,
    pub returns: Vec<f64>,
    pub mean_return: f64,
    pub std_return: f64,
    /// The env's reward threshold.
    pub threshold: f64,
    /// The run is solved by this version: the screening mean (`mean_return`,
    /// on the run's fixed eval seeds) reached the threshold and so did the
    /// confirmation on fresh seeds (`confirmation.passed`).
    pub solved: bool,
    /// Text games (`vs-opponent`): the policy's results per opponent and
    /// seat; empty for classic-control evaluations.
    #[serde(default)]
    pub matchups: Vec<Matchup>,
    /// Present when the screening mean reached the threshold: the same
    /// version played again on episodes no earlier evaluation of the run
    /// used (absent from older writers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confirmation: Option<Confirmation>,
}
wire_message!(EvalReport, "EvalReport", |m: &EvalReport| {
    for r in &m.matchups {
        r.validate()?;
    }
    if let Some(c) = &m.confirmation {
        if c.returns.is_empty() || c.returns.len() != c.episodes as usize {
            return Err(invalid(
                "EvalReport",
                "confirmation.returns",
                format!("{} returns for {} episodes", c.returns.len(), c.episodes),
            ));
        }
        if !(c.mean_return.is_finite() && c.std_return.is_finite()) {
            return Err(invalid(
                "EvalReport",
                "confirmation.mean_return",
                "must be finite",
            ));
        }
    }
    Ok(())
});

/// The confirmation of a version that passed the screening: `episodes`
/// episodes from seeds `seed, seed + 1, ...`, which no earlier evaluation
/// of the run used (see the evaluator crate for how they are drawn).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Confirmation {
    /// Episodes (text games: games) played.
    pub episodes: u32,
    /// First seed of the episodes.
    pub seed: u64,
    pub returns: Vec<f64>,
    pub mean_return: f64,
    pub std_return: f64,
    /// `mean_return - z * std_return / sqrt(episodes) >= threshold`
    /// ([`mean_less_standard_errors`]), `z` the run's `eval.confirm_z` (2
    /// by default; 0: the mean alone).
    pub passed: bool,
}

/// `mean - z * std / sqrt(episodes)`: a mean over `episodes` less `z`
/// standard errors, what a confirmation must bring to the threshold and
/// what ranks evaluated versions for the `best` checkpoint.
pub fn mean_less_standard_errors(mean: f64, std: f64, episodes: usize, z: f64) -> f64 {
    mean - z * std / (episodes.max(1) as f64).sqrt()
}

/// evaluator -> learner: an evaluation of `policy_version` begins. The
/// learner keeps that version's weights until its [`EvalReport`] arrives,
/// so a best (or solved) checkpoint holds exactly what was evaluated.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalStarted {
    pub schema: u16,
    /// Name of the evaluator plugin, e.g. `greedy`.
    pub evaluator: String,
    pub instance: String,
    pub policy_version: u64,
}
wire_message!(EvalStarted, "EvalStarted");

/// The policy's results against one opponent from one seat (text games).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Matchup {
    /// Who sat opposite, as `text.opponents` names it: `random`, `minimax`,
    /// `connect_four_bot`, `self`, `base`, `adapter:<name>`; `none` in
    /// single-player games.
    pub opponent: String,
    /// The policy's seat (player index; 0 moves first).
    pub seat: u8,
    /// The text game played (multi-game runs evaluate each of their
    /// games); empty from writers that predate it: the report's `env_id`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub game: String,
    /// Games finished (`wins + draws + losses`).
    pub games: u32,
    pub wins: u32,
    pub draws: u32,
    pub losses: u32,
    /// Games given up because the inference servers gave no usable reply.
    pub abandoned: u32,
    /// Moves the policy submitted in the finished games.
    pub moves: u32,
    /// Of those, the moves the game refused.
    pub invalid_moves: u32,
}

impl Matchup {
    /// The game played: `game`, else (an older writer) `env_id`, the
    /// report's.
    pub fn game_or<'a>(&'a self, env_id: &'a str) -> &'a str {
        if self.game.is_empty() {
            env_id
        } else {
            &self.game
        }
    }

    /// Share of the policy's moves the game accepted (1 when it made none).
    pub fn legal_move_rate(&self) -> f64 {
        if self.moves == 0 {
            1.0
        } else {
            1.0 - self.invalid_moves as f64 / self.moves as f64
        }
    }

    fn validate(&self) -> Result<(), Rejection> {
        const K: &str = "EvalReport";
        if self.opponent.is_empty() {
            return Err(invalid(K, "matchups.opponent", "empty"));
        }
        if self.wins as u64 + self.draws as u64 + self.losses as u64 != self.games as u64 {
            return Err(invalid(
                K,
                "matchups.games",
                format!(
                    "{} wins + {} draws + {} losses != {} games",
                    self.wins, self.draws, self.losses, self.games
                ),
            ));
        }
        if self.invalid_moves > self.moves {
            return Err(invalid(
                K,
                "matchups.invalid_moves",
                format!("{} of {} moves", self.invalid_moves, self.moves),
            ));
        }
        Ok(())
    }
}

/// `relay eval use` -> evaluators: switch to another evaluator plugin
/// without restarting. Each evaluator copy validates the name and options and
/// applies them, or logs the refusal and counts it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalControl {
    pub schema: u16,
    /// Plugin name, e.g. `stochastic`.
    pub evaluator: String,
    /// Plugin options as `(key, value)` strings.
    pub options: Vec<(String, String)>,
}
wire_message!(EvalControl, "EvalControl", |m: &EvalControl| {
    if m.evaluator.is_empty() || m.evaluator.len() > 64 {
        return Err(invalid(
            "EvalControl",
            "evaluator",
            "must be a plugin name of 1 to 64 characters",
        ));
    }
    Ok(())
});
