//! Text games reproducing TextArena 0.7.4, and bots that play them.
//!
//! This module owns the [`TextGame`] trait the env-runner and the evaluator
//! drive, the games behind it, the registry ([`make`], [`TEXT_GAME_IDS`])
//! and the [`bots`]. Pure computation: no I/O, no async.
//!
//! | id | players | TextArena source |
//! |----|---------|------------------|
//! | `TicTacToe-v0` | 2 | `envs/TicTacToe/env.py` ([`TicTacToe`]) |
//! | `ConnectFour-v0` | 2 | `envs/ConnectFour/env.py`, 6 x 7, open board ([`ConnectFour`]) |
//! | `KuhnPoker-v0` | 2 | `envs/KuhnPoker/env.py`, 3 rounds ([`KuhnPoker`]) |
//! | `GuessTheNumber-v0` | 1 | `envs/GuessTheNumber/env.py`, 1..=20, 10 turns ([`GuessTheNumber`]) |
//!
//! Each id behaves like TextArena's *default* registration of that id,
//! i.e. the environment wrapped in `LLMObservationWrapper` and
//! `ActionFormattingWrapper`. TicTacToe and ConnectFour are checked
//! string for string against games recorded from TextArena itself
//! (`tests/textarena_fixtures.rs`). All four games were also compared once,
//! outside the test suite (it needs Python), with TextArena 0.7.4 replaying
//! 1100 games of random, invalid and adversarial moves (Unicode digits,
//! role tags, several bracketed numbers), with Python's `random` patched to
//! deal this crate's cards and targets: transcripts, `done`, rewards,
//! `game_info` and turn counts all matched.
//!
//! # Observations
//! The game sends messages, each either to every player or to one player:
//! the prompt (private), each submitted action (public, as
//! `[Player 0] <action>`), descriptions of moves and boards (public),
//! invalid-move warnings (private to the mover in two-player games) and
//! private cards. [`TextGame::observation`] is everything sent to that
//! player since the reset, each message rendered as `"\n[<sender>] <text>"`
//! where the sender is `GAME` or the player's role (`Player 0`, or `Player`
//! in single-player games): exactly the string TextArena's
//! `get_observation()` returns under `LLMObservationWrapper`. So an
//! observation grows over the game and always starts with `"\n[GAME] "`
//! and the prompt. (Unlike TextArena, whose wrapper keeps its history
//! across `reset`, a reset here starts a fresh transcript.)
//!
//! # Actions
//! [`TextGame::step`] takes the model's raw text. As TextArena's
//! `ActionFormattingWrapper` does, an action containing neither `[` nor `]`
//! is first wrapped in brackets (`"4"` becomes `"[4]"`). Each game then
//! searches it with TextArena's pattern, with Python `re` semantics
//! (Unicode decimal digits such as `٤` count as digits, `[007]` is 7). Role tags such as `[Player 1]`
//! or `[GAME]` are cut out of the action before it is shown to the players.
//! [`TextGame::legal_moves`] lists canonical strings that are accepted now.
//!
//! # Invalid moves
//! TextArena's `error_allowance` is 1: the first invalid move (bad format,
//! occupied cell, full column, illegal bet...) is answered with a warning
//! (`"Player 1 attempted an invalid move. Reason: ... Please resubmit a
//! valid move and remember to follow the game rules to avoid penalties."`,
//! private to the mover) and the *same* player moves again; the turn does
//! not count. A second invalid move in a row ends the game: the mover gets
//! -1 and the opponent +1 (single player: the game's current score), and
//! `game_info` marks the mover's `invalid_move`. Any valid move restores
//! the allowance. [`StepOutcome::invalid_move`] reports both cases.
//!
//! # Rewards and game info
//! [`TextGame::rewards`] is `None` until the game ends, then one value per
//! player: +1 / -1 / 0 for win / loss / draw in two-player games, a score in
//! `[0, 1]` for GuessTheNumber. [`TextGame::game_info`] mirrors TextArena's
//! `game_info`: per player the role, `invalid_move`, `turn_count` and, once
//! the game is over, the `reason` string.
//!
//! # Example
//! ```
//! use relay_envs::{make_text_game, Bot, MinimaxBot};
//! let mut game = make_text_game("TicTacToe-v0")?;
//! game.reset(7);
//! assert!(game.observation(0).starts_with("\n[GAME] You are Player 0 in Tic Tac Toe."));
//! let first = game.step("4")?; // bracketed to "[4]"
//! assert!(!first.invalid_move && !first.done);
//! let retry = game.step("[4]")?; // occupied: a warning, player 1 moves again
//! assert!(retry.invalid_move && game.current_player() == 1);
//! let reply = MinimaxBot::new().choose_move(game.as_ref())?;
//! assert!(game.legal_moves().contains(&reply));
//! game.step(&reply)?;
//! assert_eq!(game.rewards(), None); // still running
//! # Ok::<(), relay_envs::EnvError>(())
//! ```
//!
//! # Randomness
//! KuhnPoker's deal and GuessTheNumber's target come from a `StdRng` seeded
//! by [`TextGame::reset`]'s seed. They follow TextArena's rules but do
//! **not** reproduce the deal Python's `random` makes for the same seed.

pub mod answer;
pub(crate) mod arena;
pub mod bots;
pub mod connect_four;
pub mod guess_the_number;
pub mod kuhn_poker;
pub(crate) mod parse;
pub mod registry;
pub mod tic_tac_toe;

use std::any::Any;

use serde::{Deserialize, Serialize};

use crate::EnvError;

pub use answer::{Answer, AnswerFormat, AnswerReader};
pub use bots::{Bot, ConnectFourBot, MinimaxBot, RandomBot};
pub use connect_four::ConnectFour;
pub use guess_the_number::GuessTheNumber;
pub use kuhn_poker::KuhnPoker;
pub use registry::{make, TEXT_GAME_IDS};
pub use tic_tac_toe::TicTacToe;

/// How a player's messages become the observation a model is prompted
/// with: TextArena's observation wrappers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ObservationView {
    /// `LLMObservationWrapper` (the default ids'): every message since the
    /// reset, each as `"\n[<sender>] <text>"`; it grows over the game.
    #[default]
    Full,
    /// `FirstLastObservationWrapper`: the first message (the game's prompt)
    /// and the latest one (in TicTacToe and ConnectFour the board with the
    /// available moves), bare, each followed by `"\n\n"`. Prompts stay
    /// short and the latest state is never buried under the history; after
    /// an invalid move the latest message is the warning, without the board.
    FirstLast,
    /// The state from the player's side in a few lines (not a TextArena
    /// wrapper): TicTacToe lists the player's cells, the opponent's and the
    /// free ones; ConnectFour each column bottom to top as `y` (yours) and
    /// `t` (theirs), then the open columns. A TicTacToe cell is named by
    /// its own digit token wherever it is, where TextArena's drawn board
    /// shifts the positions of later cells by its `X`/`O`/digit spellings,
    /// and the prompt is under half as long (~90 tokens with the tiny
    /// tokenizer against ~216); "yours/theirs" reads the same from both
    /// seats. Games without a board (Kuhn Poker, GuessTheNumber) show
    /// `first_last`, whose messages are short already.
    Compact,
}

impl std::str::FromStr for ObservationView {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "full" => Ok(Self::Full),
            "first_last" => Ok(Self::FirstLast),
            "compact" => Ok(Self::Compact),
            _ => Err(format!(
                "unknown observation view {text:?}; known: full, first_last, compact"
            )),
        }
    }
}

/// The messages one player was sent since the reset, and their renderings
/// as [`ObservationView::Full`] and [`ObservationView::FirstLast`]: the one
/// place those views are written, for relay's games and the games of the
/// env bridge alike.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Transcript {
    /// Every message as LLMObservationWrapper renders it:
    /// `"\n[<sender>] <message>"` each.
    full: String,
    /// The first message, bare.
    first: Option<String>,
    /// The latest message after the first, bare.
    last: Option<String>,
}

impl Transcript {
    /// Appends `message` from `sender` (`GAME`, or the sender's role name).
    pub fn push(&mut self, sender: &str, message: &str) {
        self.full.push('\n');
        self.full.push('[');
        self.full.push_str(sender);
        self.full.push_str("] ");
        self.full.push_str(message);
        match self.first {
            None => self.first = Some(message.to_string()),
            Some(_) => self.last = Some(message.to_string()),
        }
    }

    /// The transcript as `view` shows it (`Compact`, which only a game can
    /// render, shows `FirstLast`).
    pub fn render(&self, view: ObservationView) -> String {
        match view {
            ObservationView::Full => self.full.clone(),
            // TextArena's FirstLastObservationWrapper: the first message,
            // then the latest one if there is another, each followed by a
            // blank line.
            ObservationView::FirstLast | ObservationView::Compact => {
                match (&self.first, &self.last) {
                    (Some(first), Some(last)) => format!("{first}\n\n{last}\n\n"),
                    (first, _) => format!("{}\n\n", first.as_deref().unwrap_or_default()),
                }
            }
        }
    }
}

/// What [`TextGame::step`] reports about one submitted action.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepOutcome {
    /// The player who submitted the action.
    pub player: usize,
    /// The action was rejected: either with a warning (the same player
    /// must move again) or, if `done`, as the repeated invalid move that
    /// forfeits the game (GuessTheNumber: or the game hit its turn limit
    /// on this move).
    pub invalid_move: bool,
    /// The game is over; [`TextGame::rewards`] is now available.
    pub done: bool,
}

/// One player's entry of TextArena's `game_info`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlayerInfo {
    /// `"Player <id>"`.
    pub role: String,
    /// This player lost by a repeated invalid move.
    pub invalid_move: bool,
    /// Turns credited to this player (TextArena's counting: forgiven
    /// invalid moves do not count).
    pub turn_count: u32,
    /// Why the game ended (the same text for every player); `None` while
    /// the game runs.
    pub reason: Option<String>,
}

impl PlayerInfo {
    pub(crate) fn initial(player: usize) -> Self {
        Self {
            role: format!("Player {player}"),
            invalid_move: false,
            turn_count: 0,
            reason: None,
        }
    }
}

/// A turn-based text game, as TextArena's LLM-wrapped environments present
/// it. Object safe: services hold `Box<dyn TextGame>` from [`make`].
///
/// A new game is already reset with seed 0; [`TextGame::reset`] starts
/// another one.
pub trait TextGame: Send {
    /// The registry id, e.g. `"TicTacToe-v0"`.
    fn id(&self) -> &'static str;

    /// Number of players (seats `0..num_players()`).
    fn num_players(&self) -> usize;

    /// Starts a new game; `seed` drives any chance (cards, targets).
    fn reset(&mut self, seed: u64);

    /// The player who must act now (after the game ends: the last mover,
    /// or whoever the rules made current, as in TextArena).
    fn current_player(&self) -> usize;

    /// The game is over.
    fn is_done(&self) -> bool;

    /// Everything `player` has been shown since the reset, as TextArena's
    /// `get_observation()` returns it (see the module docs).
    ///
    /// # Panics
    /// If `player >= num_players()`.
    fn observation(&self, player: usize) -> String {
        self.observation_as(player, ObservationView::Full)
    }

    /// What `player` is shown, rendered as `view` (see [`ObservationView`]).
    ///
    /// # Panics
    /// If `player >= num_players()`.
    fn observation_as(&self, player: usize, view: ObservationView) -> String;

    /// The game's own [`ObservationView::Compact`] rendering for `player`;
    /// `None` for games without one (they show `first_last`).
    fn compact_observation(&self, _player: usize) -> Option<String> {
        None
    }

    /// The action strings that are valid now, in a fixed order (for bots
    /// and constrained decoding). Empty once the game is over.
    fn legal_moves(&self) -> Vec<String>;

    /// Submits the current player's action (raw model text).
    ///
    /// # Errors
    /// [`EnvError::GameOver`] if the game has already ended.
    fn step(&mut self, action: &str) -> Result<StepOutcome, EnvError>;

    /// Final reward per player; `None` until the game is over.
    fn rewards(&self) -> Option<Vec<f64>>;

    /// TextArena's `game_info`, one entry per player.
    fn game_info(&self) -> Vec<PlayerInfo>;

    /// TextArena's `state.turn`: moves that counted so far.
    fn turn(&self) -> u32;

    /// A compact canonical string of the full game state (board, cards,
    /// whose turn), equal for equal states: for counting distinct states.
    /// It does not encode transcripts or a pending invalid-move warning.
    fn state_key(&self) -> String;

    /// A boxed copy (for search, or to branch a game).
    fn clone_box(&self) -> Box<dyn TextGame>;

    /// The concrete game, for bots that need its typed state.
    fn as_any(&self) -> &dyn Any;
}

impl Clone for Box<dyn TextGame> {
    fn clone(&self) -> Self {
        self.clone_box()
    }
}

/// Implements the [`TextGame`] methods that only read the embedded
/// `arena: Arena` field and the game's `ID` / `Clone`.
macro_rules! arena_accessors {
    () => {
        fn id(&self) -> &'static str {
            Self::ID
        }

        fn num_players(&self) -> usize {
            self.arena.num_players()
        }

        fn current_player(&self) -> usize {
            self.arena.current_player()
        }

        fn is_done(&self) -> bool {
            self.arena.is_done()
        }

        fn observation_as(&self, player: usize, view: $crate::text::ObservationView) -> String {
            match view {
                $crate::text::ObservationView::Compact => {
                    self.compact_observation(player).unwrap_or_else(|| {
                        self.arena
                            .observation(player, $crate::text::ObservationView::FirstLast)
                    })
                }
                _ => self.arena.observation(player, view),
            }
        }

        fn rewards(&self) -> Option<Vec<f64>> {
            self.arena.rewards().map(<[f64]>::to_vec)
        }

        fn game_info(&self) -> Vec<$crate::text::PlayerInfo> {
            self.arena.info().to_vec()
        }

        fn turn(&self) -> u32 {
            self.arena.turn()
        }

        fn clone_box(&self) -> Box<dyn $crate::text::TextGame> {
            Box::new(self.clone())
        }

        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    };
}
pub(crate) use arena_accessors;

/// Fails with [`EnvError::GameOver`] once the game has ended.
pub(crate) fn ensure_running(id: &'static str, done: bool) -> Result<(), EnvError> {
    if done {
        Err(EnvError::GameOver { id })
    } else {
        Ok(())
    }
}
