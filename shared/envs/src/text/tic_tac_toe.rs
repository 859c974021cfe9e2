//! TicTacToe-v0, ported from TextArena 0.7.4's `envs/TicTacToe/env.py`.
//!
//! This module owns the 3 x 3 board, its rendering and the move rule.
//! Player 0 plays `O` and moves first; player 1 plays `X`. A move is a cell
//! number `0..=8` in brackets (`[4]`, spaces allowed inside the brackets,
//! the first bracketed number of the text counts). After every move, valid
//! or not, both players are shown the board and the available moves.

use crate::text::arena::{format_action, Arena, Seats, Sender};
use crate::text::{arena_accessors, ensure_running, parse, StepOutcome, TextGame};
use crate::EnvError;

/// Registry id.
pub const ID: &str = "TicTacToe-v0";

/// Lines of three cells that win.
pub(crate) const LINES: [[usize; 3]; 8] = [
    [0, 1, 2],
    [3, 4, 5],
    [6, 7, 8],
    [0, 3, 6],
    [1, 4, 7],
    [2, 5, 8],
    [0, 4, 8],
    [2, 4, 6],
];

/// The mark of a player: `O` for player 0, `X` for player 1.
fn symbol(player: usize) -> char {
    if player == 1 {
        'X'
    } else {
        'O'
    }
}

/// Whether `player` owns a complete line of `board`.
pub(crate) fn has_line(board: &[Option<usize>; 9], player: usize) -> bool {
    LINES
        .iter()
        .any(|line| line.iter().all(|&cell| board[cell] == Some(player)))
}

/// The free cells of `board` that would complete a line of `player`'s:
/// where `player` wins at once, or where its opponent must move to block.
pub fn completing_cells(board: &[Option<usize>; 9], player: usize) -> Vec<usize> {
    (0..9)
        .filter(|&cell| {
            board[cell].is_none()
                && LINES.iter().any(|line| {
                    line.contains(&cell)
                        && line
                            .iter()
                            .all(|&other| other == cell || board[other] == Some(player))
                })
        })
        .collect()
}

/// TextArena's TicTacToe with its default wrappers.
#[derive(Debug, Clone)]
pub struct TicTacToe {
    arena: Arena,
    /// Owner (player id) of each cell, row-major.
    board: [Option<usize>; 9],
}

impl Default for TicTacToe {
    fn default() -> Self {
        Self::new()
    }
}

impl TicTacToe {
    /// Registry id.
    pub const ID: &'static str = ID;

    /// A game reset with seed 0 (TicTacToe has no chance).
    pub fn new() -> Self {
        let mut game = Self {
            arena: Arena::new(Seats::Two),
            board: [None; 9],
        };
        game.reset(0);
        game
    }

    /// Owner (player id) of each cell `0..9`, row-major.
    pub fn board(&self) -> [Option<usize>; 9] {
        self.board
    }

    fn prompt(player: usize) -> String {
        format!(
            "You are Player {player} in Tic Tac Toe.\n\
             Your goal is to win three in a row (horizontally, vertically, or diagonally) on the board.\n\
             On your turn, you should select the square number (0-8) you want to put your mark in next.\n\
             For example, '[4]' places your mark in the center cell of the board.\n\n\
             As Player {player}, you will be '{}', while your opponent is '{}'.\n",
            symbol(player),
            symbol(1 - player)
        )
    }

    fn render_board(&self) -> String {
        let rows: Vec<String> = (0..3)
            .map(|r| {
                let cells: Vec<String> = (0..3)
                    .map(|c| {
                        let cell = r * 3 + c;
                        match self.board[cell] {
                            Some(player) => format!(" {} ", symbol(player)),
                            None => format!(" {cell} "),
                        }
                    })
                    .collect();
                cells.join("|")
            })
            .collect();
        rows.join("\n---+---+---\n")
    }

    fn empty_cells(&self) -> impl Iterator<Item = usize> + '_ {
        (0..9).filter(|&cell| self.board[cell].is_none())
    }

    /// TextArena's `_observer_current_state`, broadcast after every move.
    fn show_board(&mut self) {
        let available: Vec<String> = self.empty_cells().map(|c| format!("'[{c}]'")).collect();
        let message = format!(
            "Current Board:\n\n{}\n\nAvailable Moves: {}",
            self.render_board(),
            available.join(", ")
        );
        self.arena.add_observation(Sender::Game, None, &message);
    }

    fn apply(&mut self, action: &str) {
        let player = self.arena.current_player();
        let Some(number) = parse::bracketed_number_with_spaces(action) else {
            self.arena
                .set_invalid_move("The submitted move does not follow the correct format.");
            return;
        };
        let Some(cell) = number.value().filter(|&c| c < 9) else {
            self.arena
                .set_invalid_move(&format!("{number}. Must be between 0 and 8."));
            return;
        };
        if self.board[cell].is_some() {
            self.arena
                .set_invalid_move(&format!("cell {cell} is already occupied."));
            return;
        }
        self.board[cell] = Some(player);
        self.arena.add_observation(
            Sender::Game,
            None,
            &format!(
                "Player {player} placed their symbol ({}) in cell {cell}.",
                symbol(player)
            ),
        );
        if has_line(&self.board, player) {
            self.arena
                .set_winner(player, &format!("Player {player} has won!"));
        } else if self.board.iter().all(Option::is_some) {
            self.arena.set_draw("The game is a draw!");
        }
    }
}

impl TextGame for TicTacToe {
    arena_accessors!();

    fn reset(&mut self, _seed: u64) {
        self.board = [None; 9];
        self.arena.reset(Self::prompt);
        self.show_board();
    }

    fn legal_moves(&self) -> Vec<String> {
        if self.arena.is_done() {
            return Vec::new();
        }
        self.empty_cells().map(|c| format!("[{c}]")).collect()
    }

    fn step(&mut self, action: &str) -> Result<StepOutcome, EnvError> {
        ensure_running(ID, self.arena.is_done())?;
        let player = self.arena.current_player();
        let action = format_action(action);
        self.arena.begin_step(&action);
        self.apply(&action);
        self.show_board();
        let done = self.arena.finish_step(true);
        Ok(StepOutcome {
            player,
            invalid_move: self.arena.step_was_invalid(),
            done,
        })
    }

    /// The player's cells, the opponent's and the free ones, e.g. for
    /// player 1 after `[4]` and `[0]`:
    /// `"Tic Tac Toe: ...\nYours: 0\nTheirs: 4\nFree: 1 2 3 5 6 7 8\n..."`.
    fn compact_observation(&self, player: usize) -> Option<String> {
        let cells = |owner: Option<usize>| -> String {
            (0..9)
                .filter(|&cell| self.board[cell] == owner)
                .map(|cell| format!(" {cell}"))
                .collect()
        };
        Some(format!(
            "Tic Tac Toe: cells 0-8 row by row, three in a row wins.\n\
             Yours:{}\nTheirs:{}\nFree:{}\n\
             Reply with a free cell as [cell].\n",
            cells(Some(player)),
            cells(Some(1 - player)),
            cells(None),
        ))
    }

    /// The nine cells row-major (`O`, `X` or `.`), `:`, the player to move;
    /// e.g. `"O...X....:0"`.
    fn state_key(&self) -> String {
        let mut key: String = self
            .board
            .iter()
            .map(|cell| cell.map_or('.', symbol))
            .collect();
        key.push(':');
        key.push_str(&self.arena.current_player().to_string());
        key
    }
}
