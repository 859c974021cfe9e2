//! GuessTheNumber-v0, ported from TextArena 0.7.4's
//! `envs/GuessTheNumber/env.py`: a single-player task with a verifiable
//! answer (numbers 1..=20, 10 turns).
//!
//! This module owns the hidden target, the guesses and the score. A guess
//! is the first `[n]` of the text (no spaces inside the brackets). A wrong
//! guess is answered with "higher" or "lower". Guessing the target scores
//! 1; otherwise the game ends at the turn limit (or by a repeated invalid
//! move) with the score `1 - |last wrong guess - target| / (max - min)`
//! (0 if no valid guess was made). As in TextArena, the limit is checked
//! before a guess is counted, so an 11th guess is accepted before the game
//! ends, and a guess outside the range or repeated is an invalid move.
//!
//! The target comes from a `StdRng` seeded by `reset`; it does not
//! reproduce Python's `random.randint` for the same seed.

use std::collections::BTreeSet;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::text::arena::{format_action, Arena, Seats, Sender};
use crate::text::{arena_accessors, ensure_running, parse, StepOutcome, TextGame};
use crate::EnvError;

/// Registry id.
pub const ID: &str = "GuessTheNumber-v0";
/// Smallest possible target.
const MIN_NUMBER: usize = 1;
/// Largest possible target.
const MAX_NUMBER: usize = 20;
/// TextArena's `max_turns` of the registered id.
const MAX_TURNS: u32 = 10;

/// TextArena's GuessTheNumber with its default wrappers.
#[derive(Debug, Clone)]
pub struct GuessTheNumber {
    arena: Arena,
    target: usize,
    guessed: BTreeSet<usize>,
    /// The last wrong valid guess, for the partial score.
    last_wrong_guess: Option<usize>,
}

impl Default for GuessTheNumber {
    fn default() -> Self {
        Self::new()
    }
}

impl GuessTheNumber {
    /// Registry id.
    pub const ID: &'static str = ID;

    /// A game reset with seed 0.
    pub fn new() -> Self {
        let mut game = Self {
            arena: Arena::new(Seats::Single),
            target: MIN_NUMBER,
            guessed: BTreeSet::new(),
            last_wrong_guess: None,
        };
        game.reset(0);
        game
    }

    /// The hidden number (the verifiable answer).
    pub fn target(&self) -> usize {
        self.target
    }

    fn prompt(player: usize) -> String {
        format!(
            "You are Player {player}. You are playing Guess The Number.\n\
             You have to guess the number between {MIN_NUMBER} and {MAX_NUMBER} within {MAX_TURNS} turns.\n\
             As you enter your guess, the game will provide you with hints such as 'higher' or 'lower'.\n\
             You may provide your response in any manner. Only the number that is wrapped in square brackets will be considered as your guess. For example, [5].\n\
             As you play, the history of your guesses will be appended below. Use the information to complete the game before you run out of guesses.\n\
             Enter your guess."
        )
    }

    /// TextArena's `_get_percentage_completion`.
    fn score(&self) -> f64 {
        match self.last_wrong_guess {
            None => 0.0,
            Some(guess) => {
                let distance = guess.abs_diff(self.target) as f64;
                1.0 - (distance / (MAX_NUMBER - MIN_NUMBER) as f64)
            }
        }
    }

    fn apply(&mut self, action: &str) {
        let player = self.arena.current_player();
        let Some(number) = parse::bracketed_number(action) else {
            let reason = format!(
                "Invalid move format. Player {player} did not respond with valid '[number]'."
            );
            self.arena.set_invalid_move_single(&reason, self.score());
            return;
        };
        match number
            .value()
            .filter(|n| (MIN_NUMBER..=MAX_NUMBER).contains(n))
        {
            None => {
                let reason = format!(
                    "Invalid move. Player {player} guessed a number outside the range specified."
                );
                self.arena.set_invalid_move_single(&reason, self.score());
            }
            Some(guess) if self.guessed.contains(&guess) => {
                let reason =
                    format!("Invalid move. Player {player} has already guessed the number.");
                self.arena.set_invalid_move_single(&reason, self.score());
            }
            Some(guess) => {
                self.guessed.insert(guess);
                if guess == self.target {
                    self.arena
                        .set_outcome(1.0, "Congratulations! You guessed the correct number.");
                } else {
                    let hint = if guess > self.target {
                        "lower"
                    } else {
                        "higher"
                    };
                    self.arena.add_observation(
                        Sender::Game,
                        None,
                        &format!("The target number is {hint}."),
                    );
                    self.last_wrong_guess = Some(guess);
                }
            }
        }
        // TextArena's `check_turn_limit`, reached by any bracketed number.
        if self.arena.turn() >= MAX_TURNS && !self.arena.is_done() {
            let reason = format!(
                "The turn limit has been reached. Guess: {number}, Target: {}",
                self.target
            );
            self.arena.set_outcome(self.score(), &reason);
        }
    }
}

impl TextGame for GuessTheNumber {
    arena_accessors!();

    fn reset(&mut self, seed: u64) {
        let mut rng = StdRng::seed_from_u64(seed);
        self.target = rng.random_range(MIN_NUMBER..=MAX_NUMBER);
        self.guessed.clear();
        self.last_wrong_guess = None;
        self.arena.reset(Self::prompt);
    }

    fn legal_moves(&self) -> Vec<String> {
        if self.arena.is_done() {
            return Vec::new();
        }
        (MIN_NUMBER..=MAX_NUMBER)
            .filter(|n| !self.guessed.contains(n))
            .map(|n| format!("[{n}]"))
            .collect()
    }

    fn step(&mut self, action: &str) -> Result<StepOutcome, EnvError> {
        ensure_running(ID, self.arena.is_done())?;
        let player = self.arena.current_player();
        let action = format_action(action);
        self.arena.begin_step(&action);
        self.apply(&action);
        let done = self.arena.finish_step(false);
        Ok(StepOutcome {
            player,
            invalid_move: self.arena.step_was_invalid(),
            done,
        })
    }

    /// The target, `:`, then the guesses so far in increasing order; e.g.
    /// `"7:3,10"`.
    fn state_key(&self) -> String {
        let guesses: Vec<String> = self.guessed.iter().map(|g| g.to_string()).collect();
        format!("{}:{}", self.target, guesses.join(","))
    }
}
