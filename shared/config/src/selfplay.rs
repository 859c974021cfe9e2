//! The `selfplay` section: who the policy plays in a multi-agent game
//! stepped on observations (a PettingZoo game through the env bridge).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::check::{invalid, ConfigError};
use crate::league::LEAGUE_OPPONENT;

/// The `selfplay.opponents` key of the current policy playing itself.
pub const MIRROR_OPPONENT: &str = "mirror";

/// The prefix of a saved checkpoint as a fixed opponent of a game on
/// observations: `checkpoint:<folder>` (a run's checkpoint folder, e.g.
/// `checkpoint:runs/ttt-1/checkpoints/best`).
pub const CHECKPOINT_OPPONENT_PREFIX: &str = "checkpoint:";

/// The folder of a `checkpoint:<folder>` opponent name, else `None`.
pub fn checkpoint_opponent(name: &str) -> Option<&str> {
    name.strip_prefix(CHECKPOINT_OPPONENT_PREFIX)
}

/// Checks a fixed opponent of a game on observations by name (`field` is
/// where it was written): a bot of [`relay_envs::SEAT_BOT_NAMES`], or a
/// `checkpoint:<folder>` whose folder holds a checkpoint of a run (its
/// `config.yaml` and `model.safetensors`; whether it plays the game is
/// checked when it is loaded). Which bots play the game is checked once it
/// is made.
pub(crate) fn check_seat_opponent_name(field: &str, name: &str) -> Result<(), ConfigError> {
    if let Some(folder) = checkpoint_opponent(name) {
        let dir = std::path::Path::new(folder);
        for file in ["config.yaml", "model.safetensors"] {
            if !dir.join(file).is_file() {
                return Err(invalid(
                    field,
                    format!(
                        "{folder:?} is not a checkpoint folder (no {file}); give a run's checkpoint, e.g. checkpoint:runs/<run>/checkpoints/best"
                    ),
                ));
            }
        }
        return Ok(());
    }
    if !relay_envs::SEAT_BOT_NAMES.contains(&name) {
        return Err(invalid(
            field,
            format!(
                "unknown opponent {name:?}; known: {}, or {CHECKPOINT_OPPONENT_PREFIX}<folder> (a saved checkpoint)",
                relay_envs::SEAT_BOT_NAMES.join(", ")
            ),
        ));
    }
    Ok(())
}

/// Self-play in multi-agent games (`env.backend: pettingzoo`). The
/// env-runner gives the learning policy one seat of each game, drawn with
/// the run's seeded RNG, and the other seats to an opponent drawn per game
/// from `opponents`. Only the learning seat's moves are trained on; its
/// reward is everything its seat earns from one of its moves to the next.
///
/// Example (YAML):
///
/// ```yaml
/// selfplay:
///   opponents: {mirror: 0.8, random: 0.2}
/// ```
///
/// With a `league` weight, that share of games is played against an
/// opponent the `league` section's sampler draws from the run's pool
/// (past versions rated with TrueSkill, and fixed bots), as text runs do:
///
/// ```yaml
/// selfplay:
///   opponents: {league: 0.8, random: 0.2}
/// league:
///   sampler: {kind: mixture, components: [
///     {weight: 0.5, sampler: {kind: mirror}},
///     {weight: 0.5, sampler: {kind: match_quality, temperature: 0.5}}]}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SelfPlaySection {
    /// Weight of each opponent kind (need not sum to 1): `mirror` (the
    /// current policy, sampling, through the inference servers; its moves
    /// are not trained on), `random` (a uniformly random legal move),
    /// `minimax` (perfect play; `tictactoe_v3` only), `connect_four_bot`
    /// (a depth-4 search; `connect_four_v3` only), `checkpoint:<folder>`
    /// (a saved checkpoint of a run on the same game, sampling its moves)
    /// and `league` (drawn by `league.sampler` from the run's pool;
    /// two-player games). Default: `mirror` only.
    pub opponents: BTreeMap<String, f64>,
}

impl Default for SelfPlaySection {
    fn default() -> Self {
        Self {
            opponents: BTreeMap::from([(MIRROR_OPPONENT.to_string(), 1.0)]),
        }
    }
}

impl SelfPlaySection {
    /// Checks the names and weights (which bots play the game is checked
    /// once the env is made, [`crate::ExperimentConfig::check_env`]).
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        for (name, &weight) in &self.opponents {
            let field = format!("selfplay.opponents.{name}");
            if name != MIRROR_OPPONENT && name != LEAGUE_OPPONENT {
                check_seat_opponent_name(&field, name).map_err(|e| match e {
                    ConfigError::Invalid { field, detail } => ConfigError::Invalid {
                        field,
                        detail: format!("{detail}; or {MIRROR_OPPONENT}, {LEAGUE_OPPONENT}"),
                    },
                    other => other,
                })?;
            }
            if !weight.is_finite() || weight < 0.0 {
                return Err(invalid(
                    &field,
                    format!("weight {weight} must be finite and >= 0"),
                ));
            }
        }
        if self.opponents.values().sum::<f64>() <= 0.0 {
            return Err(invalid(
                "selfplay.opponents",
                "needs a positive weight on at least one opponent",
            ));
        }
        Ok(())
    }

    /// The opponents with a positive weight, with their weights.
    pub fn weighted(&self) -> Vec<(&str, f64)> {
        self.opponents
            .iter()
            .filter(|(_, &w)| w > 0.0)
            .map(|(name, &w)| (name.as_str(), w))
            .collect()
    }

    /// The weight of `league` games (0 without).
    pub fn league_weight(&self) -> f64 {
        self.opponents.get(LEAGUE_OPPONENT).copied().unwrap_or(0.0)
    }

    /// The fixed bots among the opponents, whatever their weight.
    pub fn bots(&self) -> impl Iterator<Item = &str> {
        self.opponents
            .keys()
            .map(String::as_str)
            .filter(|name| *name != MIRROR_OPPONENT && *name != LEAGUE_OPPONENT)
    }
}
