//! The id → text game registry (TextArena's `ta.make` for the default,
//! LLM-wrapped ids).

use crate::text::{connect_four, guess_the_number, kuhn_poker, tic_tac_toe};
use crate::text::{ConnectFour, GuessTheNumber, KuhnPoker, TextGame, TicTacToe};
use crate::EnvError;

/// Every text game id this crate provides.
pub const TEXT_GAME_IDS: &[&str] = &[
    tic_tac_toe::ID,
    connect_four::ID,
    kuhn_poker::ID,
    guess_the_number::ID,
];

/// Creates the text game registered under `id` (exact, case-sensitive
/// match), already reset with seed 0.
///
/// # Errors
/// [`EnvError::UnknownEnv`] listing [`TEXT_GAME_IDS`].
pub fn make(id: &str) -> Result<Box<dyn TextGame>, EnvError> {
    Ok(match id {
        tic_tac_toe::ID => Box::new(TicTacToe::new()),
        connect_four::ID => Box::new(ConnectFour::new()),
        kuhn_poker::ID => Box::new(KuhnPoker::new()),
        guess_the_number::ID => Box::new(GuessTheNumber::new()),
        _ => {
            return Err(EnvError::UnknownEnv {
                id: id.to_string(),
                known: TEXT_GAME_IDS.to_vec(),
            })
        }
    })
}
