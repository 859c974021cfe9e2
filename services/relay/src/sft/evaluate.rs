//! `relay sft`'s evaluation before and after training: greedy games from
//! each seat against each opponent bot ([`EvalResult`]).

use anyhow::Result;
use relay_bridge::EnvSection;
use relay_policy::text::Outcome;
use serde::Serialize;

use crate::play_text::{play_game, Player};

/// Results against one opponent, both seats together.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct EvalResult {
    pub opponent: String,
    pub games: u32,
    pub wins: u32,
    pub draws: u32,
    pub losses: u32,
    pub moves: u32,
    pub invalid_moves: u32,
}

impl EvalResult {
    /// Share of the model's moves the game accepted.
    pub fn legal_move_rate(&self) -> f64 {
        if self.moves == 0 {
            1.0
        } else {
            1.0 - self.invalid_moves as f64 / self.moves as f64
        }
    }

    /// Share of games not lost.
    pub fn non_loss_rate(&self) -> f64 {
        if self.games == 0 {
            0.0
        } else {
            (self.wins + self.draws) as f64 / self.games as f64
        }
    }
}

/// Plays `games` greedy games per seat against each opponent.
pub(super) fn evaluate(
    env: &str,
    section: &EnvSection,
    player: &mut Player,
    opponents: &[String],
    games: usize,
    seed: u64,
) -> Result<Vec<EvalResult>> {
    let seats = relay_bridge::make_text_game(env, section)?.num_players();
    let mut results = Vec::new();
    for opponent in opponents {
        let mut result = EvalResult {
            opponent: opponent.clone(),
            ..Default::default()
        };
        for seat in 0..seats {
            for g in 0..games {
                let game = play_game(
                    relay_bridge::make_text_game(env, section)?,
                    player,
                    seat,
                    opponent,
                    seed.wrapping_add((seat * games + g) as u64),
                    &mut std::io::empty(),
                    &mut std::io::sink(),
                )?;
                result.games += 1;
                result.moves += game.model_moves;
                result.invalid_moves += game.model_invalid_moves;
                match Outcome::of(&game.rewards, seat) {
                    Outcome::Win => result.wins += 1,
                    Outcome::Draw => result.draws += 1,
                    Outcome::Loss => result.losses += 1,
                }
            }
        }
        results.push(result);
    }
    Ok(results)
}

pub(super) fn print_eval(when: &str, results: &[EvalResult]) {
    for r in results {
        println!(
            "{when:<7} {:<10} {:>5} {:>5} {:>5} {:>5} {:>10.1}% {:>9.1}%",
            r.opponent,
            r.games,
            r.wins,
            r.draws,
            r.losses,
            100.0 * r.legal_move_rate(),
            100.0 * r.non_loss_rate()
        );
    }
}
