//! Scripted opponents for the text games.
//!
//! This module owns the [`Bot`] trait and three bots: [`RandomBot`] (a
//! uniformly random legal move, any game), [`MinimaxBot`] (perfect
//! TicTacToe) and [`ConnectFourBot`] (depth-limited alpha-beta search).
//! Bots answer with one of [`TextGame::legal_moves`], so their moves are
//! always valid. They are deterministic given their seed.

use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::SeedableRng;

use crate::text::connect_four::{self, landing_row, wins_at, Board, COLS, ROWS};
use crate::text::tic_tac_toe::{self, has_line};
use crate::text::{ConnectFour, TextGame, TicTacToe};
use crate::EnvError;

/// A player that picks the current player's move in a [`TextGame`].
pub trait Bot: Send {
    /// Short name for logs and league tables.
    fn name(&self) -> &'static str;

    /// The move the current player should submit.
    ///
    /// # Errors
    /// [`EnvError::GameOver`] if the game has ended,
    /// [`EnvError::BotCannotPlay`] if the bot does not play this game.
    fn choose_move(&mut self, game: &dyn TextGame) -> Result<String, EnvError>;

    /// The moves this bot chooses among with equal probability in `game`'s
    /// current state, when it can say (`None` otherwise). Supervised
    /// learning from bot games uses it to learn the bot's whole
    /// distribution rather than the one move it sampled.
    fn move_support(&self, _game: &dyn TextGame) -> Option<Vec<String>> {
        None
    }
}

/// Plays a uniformly random legal move.
#[derive(Debug, Clone)]
pub struct RandomBot {
    rng: StdRng,
}

impl RandomBot {
    /// A bot whose choices are determined by `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            rng: StdRng::seed_from_u64(seed),
        }
    }
}

impl Bot for RandomBot {
    fn name(&self) -> &'static str {
        "random"
    }

    fn move_support(&self, game: &dyn TextGame) -> Option<Vec<String>> {
        Some(game.legal_moves())
    }

    fn choose_move(&mut self, game: &dyn TextGame) -> Result<String, EnvError> {
        if game.is_done() {
            return Err(EnvError::GameOver { id: game.id() });
        }
        game.legal_moves()
            .choose(&mut self.rng)
            .cloned()
            .ok_or_else(|| EnvError::External {
                id: game.id().to_string(),
                message: "the random bot needs the legal moves, and this game lists none in its observation".into(),
            })
    }
}

/// Perfect TicTacToe: full minimax (memoized), preferring the fastest win
/// and the slowest loss; ties go to the lowest cell number.
#[derive(Debug, Clone)]
pub struct MinimaxBot {
    /// Value for the player to move of each (board, mover), indexed by
    /// [`MinimaxBot::index`]; `None` until computed.
    memo: Vec<Option<i8>>,
}

impl Default for MinimaxBot {
    fn default() -> Self {
        Self::new()
    }
}

impl MinimaxBot {
    /// A bot with an empty memo (filled on first use).
    pub fn new() -> Self {
        Self {
            memo: vec![None; 3usize.pow(9) * 2],
        }
    }

    fn index(board: &[Option<usize>; 9], mover: usize) -> usize {
        let base3 = board
            .iter()
            .fold(0, |acc, cell| acc * 3 + cell.map_or(0, |p| p + 1));
        base3 * 2 + mover
    }

    /// Value of `board` for `mover`, who is about to play: `empty + 1` for
    /// a win reached with `empty` cells left, its negative for a loss, 0
    /// for a draw.
    fn value(&mut self, board: &mut [Option<usize>; 9], mover: usize) -> i8 {
        let key = Self::index(board, mover);
        if let Some(v) = self.memo[key] {
            return v;
        }
        let empty = board.iter().filter(|c| c.is_none()).count() as i8;
        let v = if has_line(board, 1 - mover) {
            -(empty + 1)
        } else if empty == 0 {
            0
        } else {
            let mut best = i8::MIN;
            for cell in 0..9 {
                if board[cell].is_none() {
                    board[cell] = Some(mover);
                    best = best.max(-self.value(board, 1 - mover));
                    board[cell] = None;
                }
            }
            best
        };
        self.memo[key] = Some(v);
        v
    }

    /// The best cell for `mover` on `board`, or `None` if the board is
    /// full.
    pub fn best_cell(&mut self, board: &[Option<usize>; 9], mover: usize) -> Option<usize> {
        let mut board = *board;
        let mut best: Option<(usize, i8)> = None;
        for cell in 0..9 {
            if board[cell].is_some() {
                continue;
            }
            board[cell] = Some(mover);
            let v = -self.value(&mut board, 1 - mover);
            board[cell] = None;
            if best.is_none_or(|(_, b)| v > b) {
                best = Some((cell, v));
            }
        }
        best.map(|(cell, _)| cell)
    }
}

impl Bot for MinimaxBot {
    fn name(&self) -> &'static str {
        "minimax"
    }

    fn choose_move(&mut self, game: &dyn TextGame) -> Result<String, EnvError> {
        let Some(ttt) = game.as_any().downcast_ref::<TicTacToe>() else {
            return Err(EnvError::BotCannotPlay {
                bot: self.name(),
                game: game.id(),
            });
        };
        if game.is_done() {
            return Err(EnvError::GameOver {
                id: tic_tac_toe::ID,
            });
        }
        self.best_cell(&ttt.board(), game.current_player())
            .map(|cell| format!("[{cell}]"))
            .ok_or(EnvError::GameOver {
                id: tic_tac_toe::ID,
            })
    }
}

/// ConnectFour by depth-limited negamax with alpha-beta pruning and a
/// window-counting evaluation. Columns are tried centre first, which is
/// also the tie-break. Always takes an immediate win and, from depth 2,
/// blocks an immediate loss.
#[derive(Debug, Clone)]
pub struct ConnectFourBot {
    depth: u32,
}

/// Column order for search and tie-breaks: centre first.
const COLUMN_ORDER: [usize; COLS] = [3, 2, 4, 1, 5, 0, 6];
/// Score of a won position (plus the remaining depth, to win sooner).
const WIN_SCORE: i32 = 1_000_000;

impl Default for ConnectFourBot {
    fn default() -> Self {
        Self::new(4)
    }
}

impl ConnectFourBot {
    /// A bot searching `depth` plies (at least 1).
    pub fn new(depth: u32) -> Self {
        Self {
            depth: depth.max(1),
        }
    }

    /// Static evaluation for `player`: for every line of four cells that
    /// holds discs of one side only, +/-2 for two and +/-5 for three of
    /// them, plus 3 per own disc in the centre column (minus the
    /// opponent's).
    fn evaluate(board: &Board, player: usize) -> i32 {
        let mut score = 0;
        for row in board {
            match row[COLS / 2] {
                Some(p) if p == player => score += 3,
                Some(_) => score -= 3,
                None => {}
            }
        }
        for (dr, dc) in [(0isize, 1isize), (1, 0), (1, 1), (1, -1)] {
            for r in 0..ROWS as isize {
                for c in 0..COLS as isize {
                    let (end_r, end_c) = (r + 3 * dr, c + 3 * dc);
                    if !(0..ROWS as isize).contains(&end_r) || !(0..COLS as isize).contains(&end_c)
                    {
                        continue;
                    }
                    let (mut mine, mut theirs) = (0, 0);
                    for k in 0..4 {
                        match board[(r + k * dr) as usize][(c + k * dc) as usize] {
                            Some(p) if p == player => mine += 1,
                            Some(_) => theirs += 1,
                            None => {}
                        }
                    }
                    let weight = |n: i32| match n {
                        3 => 5,
                        2 => 2,
                        _ => 0,
                    };
                    if theirs == 0 {
                        score += weight(mine);
                    } else if mine == 0 {
                        score -= weight(theirs);
                    }
                }
            }
        }
        score
    }

    /// Negamax value of `board` for `mover`, searching `depth` plies.
    fn negamax(board: &mut Board, mover: usize, depth: u32, mut alpha: i32, beta: i32) -> i32 {
        if depth == 0 {
            return Self::evaluate(board, mover);
        }
        let mut best = i32::MIN + 1;
        let mut any_move = false;
        for col in COLUMN_ORDER {
            let Some(row) = landing_row(board, col) else {
                continue;
            };
            any_move = true;
            board[row][col] = Some(mover);
            let v = if wins_at(board, row, col) {
                WIN_SCORE + depth as i32
            } else {
                -Self::negamax(board, 1 - mover, depth - 1, -beta, -alpha)
            };
            board[row][col] = None;
            best = best.max(v);
            alpha = alpha.max(v);
            if alpha >= beta {
                break;
            }
        }
        if any_move {
            best
        } else {
            0 // full board: draw
        }
    }

    /// The chosen column for `mover`, or `None` if the board is full.
    pub fn best_column(&self, board: &Board, mover: usize) -> Option<usize> {
        let mut board = *board;
        let mut best: Option<(usize, i32)> = None;
        for col in COLUMN_ORDER {
            let Some(row) = landing_row(&board, col) else {
                continue;
            };
            board[row][col] = Some(mover);
            let v = if wins_at(&board, row, col) {
                WIN_SCORE + self.depth as i32
            } else {
                -Self::negamax(&mut board, 1 - mover, self.depth - 1, -i32::MAX, i32::MAX)
            };
            board[row][col] = None;
            if best.is_none_or(|(_, b)| v > b) {
                best = Some((col, v));
            }
        }
        best.map(|(col, _)| col)
    }
}

impl Bot for ConnectFourBot {
    fn name(&self) -> &'static str {
        "connect-four-search"
    }

    fn choose_move(&mut self, game: &dyn TextGame) -> Result<String, EnvError> {
        let Some(c4) = game.as_any().downcast_ref::<ConnectFour>() else {
            return Err(EnvError::BotCannotPlay {
                bot: self.name(),
                game: game.id(),
            });
        };
        if game.is_done() {
            return Err(EnvError::GameOver {
                id: connect_four::ID,
            });
        }
        self.best_column(&c4.board(), game.current_player())
            .map(|col| format!("[col {col}]"))
            .ok_or(EnvError::GameOver {
                id: connect_four::ID,
            })
    }
}
