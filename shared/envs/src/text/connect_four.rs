//! ConnectFour-v0, ported from TextArena 0.7.4's `envs/ConnectFour/env.py`
//! (6 rows, 7 columns, open board).
//!
//! This module owns the board, its rendering and the move rule. Player 0
//! drops `X` and moves first; player 1 drops `O`. A move is a column in
//! brackets, `[col 3]` or `[3]` (case-insensitive `col`; of several, the
//! rightmost on the first line that has one counts). After a valid move that does not end the game, both players
//! are shown the board; an invalid move only earns the mover a warning.

use crate::text::arena::{format_action, Arena, Seats, Sender};
use crate::text::{arena_accessors, ensure_running, parse, StepOutcome, TextGame};
use crate::EnvError;

/// Registry id.
pub const ID: &str = "ConnectFour-v0";
/// Board rows (row 0 is the top).
pub const ROWS: usize = 6;
/// Board columns.
pub const COLS: usize = 7;

/// The disc of a player: `X` for player 0, `O` for player 1.
fn symbol(player: usize) -> char {
    if player == 0 {
        'X'
    } else {
        'O'
    }
}

/// A board: `board[row][col]` is the owner of that cell, row 0 on top.
pub type Board = [[Option<usize>; COLS]; ROWS];

/// The row a disc dropped into `col` lands in, if the column is not full.
pub(crate) fn landing_row(board: &Board, col: usize) -> Option<usize> {
    (0..ROWS).rev().find(|&r| board[r][col].is_none())
}

/// Whether the disc at (`row`, `col`) completes four in a row for its owner.
pub(crate) fn wins_at(board: &Board, row: usize, col: usize) -> bool {
    let Some(owner) = board[row][col] else {
        return false;
    };
    let run = |dr: isize, dc: isize| {
        let mut count = 0;
        let (mut r, mut c) = (row as isize + dr, col as isize + dc);
        while (0..ROWS as isize).contains(&r)
            && (0..COLS as isize).contains(&c)
            && board[r as usize][c as usize] == Some(owner)
        {
            count += 1;
            r += dr;
            c += dc;
        }
        count
    };
    [(0, 1), (1, 0), (1, 1), (1, -1)]
        .iter()
        .any(|&(dr, dc)| 1 + run(dr, dc) + run(-dr, -dc) >= 4)
}

/// TextArena's ConnectFour with its default wrappers.
#[derive(Debug, Clone)]
pub struct ConnectFour {
    arena: Arena,
    board: Board,
}

impl Default for ConnectFour {
    fn default() -> Self {
        Self::new()
    }
}

impl ConnectFour {
    /// Registry id.
    pub const ID: &'static str = ID;

    /// A game reset with seed 0 (ConnectFour has no chance).
    pub fn new() -> Self {
        let mut game = Self {
            arena: Arena::new(Seats::Two),
            board: [[None; COLS]; ROWS],
        };
        game.reset(0);
        game
    }

    /// The board: `board()[row][col]` is the owner, row 0 on top.
    pub fn board(&self) -> Board {
        self.board
    }

    fn prompt(player: usize) -> String {
        format!(
            "You are Player {player} in Connect Four.\nYour disc symbol: {}.\n\
             The game board has {ROWS} rows and {COLS} columns.\n\
             Players take turns dropping their disc into one of the columns (0 to {}).\n\
             The first to connect (their own) four discs vertically, horizontally, or diagonally wins.\n\
             On your turn, enter the column number in squared brackets to make your move.\n\
             For example: '[col 4]' or '[col 1]'.",
            symbol(player),
            COLS - 1
        )
    }

    fn render_board(&self) -> String {
        let numbers: Vec<String> = (0..COLS).map(|c| c.to_string()).collect();
        let separator = "-".repeat(COLS * 2 - 1);
        let rows: Vec<String> = self
            .board
            .iter()
            .map(|row| {
                let cells: Vec<String> = row
                    .iter()
                    .map(|cell| cell.map_or('.', symbol).to_string())
                    .collect();
                cells.join(" ")
            })
            .collect();
        format!("{}\n{separator}\n{}", numbers.join(" "), rows.join("\n"))
    }

    fn show_board(&mut self) {
        let message = format!("Board state:\n{}", self.render_board());
        self.arena.add_observation(Sender::Game, None, &message);
    }

    fn apply(&mut self, action: &str) {
        let player = self.arena.current_player();
        let Some(number) = parse::connect_four_column(action) else {
            self.arena.set_invalid_move(&format!(
                "Player {player}, Invalid action format. Expected format: '[col x]'."
            ));
            return;
        };
        let Some(col) = number.value().filter(|&c| c < COLS) else {
            self.arena.set_invalid_move(&format!(
                "Player {player}, Invalid action. Column {number} is out of bounds."
            ));
            return;
        };
        let Some(row) = landing_row(&self.board, col) else {
            self.arena.set_invalid_move(&format!(
                "Player {player}, Invalid action. Column {col} is full."
            ));
            return;
        };
        self.arena.add_observation(
            Sender::Game,
            None,
            &format!(
                "Player {player} dropped their disk ({}) into column {col}.",
                symbol(player)
            ),
        );
        self.board[row][col] = Some(player);
        if wins_at(&self.board, row, col) {
            self.arena
                .set_winner(player, &format!("Player {player} wins by connecting four!"));
        } else if self.board[0].iter().all(Option::is_some) {
            self.arena.set_draw("Game ended in a draw.");
        } else {
            self.show_board();
        }
    }
}

impl TextGame for ConnectFour {
    arena_accessors!();

    fn reset(&mut self, _seed: u64) {
        self.board = [[None; COLS]; ROWS];
        self.arena.reset(Self::prompt);
        self.show_board();
    }

    fn legal_moves(&self) -> Vec<String> {
        if self.arena.is_done() {
            return Vec::new();
        }
        (0..COLS)
            .filter(|&c| self.board[0][c].is_none())
            .map(|c| format!("[col {c}]"))
            .collect()
    }

    fn step(&mut self, action: &str) -> Result<StepOutcome, EnvError> {
        ensure_running(ID, self.arena.is_done())?;
        let player = self.arena.current_player();
        let action = format_action(action);
        self.arena.begin_step(&action);
        self.apply(&action);
        let done = self.arena.finish_step(true);
        Ok(StepOutcome {
            player,
            invalid_move: self.arena.step_was_invalid(),
            done,
        })
    }

    /// Each column bottom to top, `y` for the player's pieces and `t` for
    /// the opponent's, then the open columns.
    fn compact_observation(&self, player: usize) -> Option<String> {
        let mut text = format!(
            "Connect Four: columns 0-{}, pieces fall to the bottom, four in a row wins.\n\
             Columns bottom to top (y yours, t theirs):\n",
            COLS - 1
        );
        for col in 0..COLS {
            text.push_str(&format!("{col}:"));
            for row in (0..ROWS).rev() {
                match self.board[row][col] {
                    Some(owner) if owner == player => text.push_str(" y"),
                    Some(_) => text.push_str(" t"),
                    None => break,
                }
            }
            text.push('\n');
        }
        text.push_str("Open:");
        for col in (0..COLS).filter(|&c| self.board[0][c].is_none()) {
            text.push_str(&format!(" {col}"));
        }
        text.push_str("\nReply with an open column as [column].\n");
        Some(text)
    }

    /// The rows top to bottom (`X`, `O` or `.`) separated by `/`, `:`, the
    /// player to move.
    fn state_key(&self) -> String {
        let rows: Vec<String> = self
            .board
            .iter()
            .map(|row| row.iter().map(|cell| cell.map_or('.', symbol)).collect())
            .collect();
        format!("{}:{}", rows.join("/"), self.arena.current_player())
    }
}
