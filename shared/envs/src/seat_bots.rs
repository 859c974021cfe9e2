//! Fixed opponents for multi-agent games played on observations (PettingZoo
//! games through the env bridge): [`SeatBot`]. The env-runner's self-play
//! games and the evaluator's vs-opponent games draw the same bots from
//! here, so a bot plays identically in training and in evaluation.
//!
//! A bot sees what the policy sees: the mover's observation and its action
//! mask. `random` plays any game with a mask; `minimax` is perfect
//! TicTacToe ([`MinimaxBot`]) read off `tictactoe_v3`'s observation, whose
//! `[3, 3, 2]` planes hold the mover's marks (plane 0) and the other
//! player's (plane 1) with cell `k` at `2k` and `2k + 1`, `k` also being
//! the action that marks it; `connect_four_bot` is the text games'
//! depth-4 ConnectFour search ([`ConnectFourBot`]) read off
//! `connect_four_v3`'s `[6, 7, 2]` planes (row 0 the top, cell `(r, c)` at
//! `2 (7r + c)`), its action the column. With `env.seat_feature` the
//! observation ends with the seat, which the bots do not read.

use rand::Rng;

use crate::text::connect_four::{Board, COLS, ROWS};
use crate::{ConnectFourBot, EnvError, EnvSpec, MinimaxBot};

/// Names of the fixed opponents, for configs and errors.
pub const SEAT_BOT_NAMES: [&str; 3] = ["random", "minimax", "connect_four_bot"];

/// PettingZoo's TicTacToe, the game `minimax` plays.
const TICTACTOE: &str = "tictactoe_v3";
/// PettingZoo's ConnectFour, the game `connect_four_bot` plays.
const CONNECT_FOUR: &str = "connect_four_v3";

/// A fixed opponent choosing one action from an observation and its mask.
#[derive(Debug, Clone)]
pub enum SeatBot {
    /// A uniformly random legal action.
    Random,
    /// Perfect TicTacToe play (fastest win, slowest loss, lowest cell).
    Minimax(MinimaxBot),
    /// ConnectFour by a depth-4 alpha-beta search (centre first).
    ConnectFour(ConnectFourBot),
}

impl SeatBot {
    /// The bot `name` for games of `spec`; an error names what it cannot
    /// play.
    pub fn new(name: &str, spec: &EnvSpec) -> Result<Self, EnvError> {
        let cannot = || EnvError::BotCannotPlay {
            bot: match name {
                "minimax" => "minimax",
                "connect_four_bot" => "connect_four_bot",
                _ => "random",
            },
            game: spec.id,
        };
        // The board's values, then with env.seat_feature the seats' one-hot.
        let board_of = |cells: usize| matches!(spec.obs_dim(), d if d == 2 * cells || d == 2 * cells + spec.agents.len());
        match name {
            "random" if spec.action_mask => Ok(Self::Random),
            "random" => Err(cannot()),
            "minimax" if spec.id == TICTACTOE && board_of(9) => {
                Ok(Self::Minimax(MinimaxBot::new()))
            }
            "minimax" => Err(cannot()),
            "connect_four_bot" if spec.id == CONNECT_FOUR && board_of(ROWS * COLS) => {
                Ok(Self::ConnectFour(ConnectFourBot::default()))
            }
            "connect_four_bot" => Err(cannot()),
            other => Err(EnvError::External {
                id: spec.id.to_string(),
                message: format!(
                    "unknown opponent {other:?}; known: {}",
                    SEAT_BOT_NAMES.join(", ")
                ),
            }),
        }
    }

    /// Whether `name` is a bot that plays games of `spec`.
    pub fn plays(name: &str, spec: &EnvSpec) -> bool {
        Self::new(name, spec).is_ok()
    }

    /// The action for the mover whose observation is `obs` and legal
    /// actions `mask` (at least one is legal).
    pub fn act(&mut self, obs: &[f32], mask: &[u8], rng: &mut impl Rng) -> i64 {
        match self {
            Self::Random => random_legal(mask, rng),
            Self::Minimax(bot) => {
                let mut board = [None; 9];
                for (cell, slot) in board.iter_mut().enumerate() {
                    if obs[2 * cell] > 0.5 {
                        *slot = Some(0);
                    } else if obs[2 * cell + 1] > 0.5 {
                        *slot = Some(1);
                    }
                }
                match bot.best_cell(&board, 0) {
                    Some(cell) if mask.get(cell) == Some(&1) => cell as i64,
                    // A board the mask disagrees with: play legally anyway.
                    _ => random_legal(mask, rng),
                }
            }
            Self::ConnectFour(bot) => {
                let mut board: Board = [[None; COLS]; ROWS];
                for (r, row) in board.iter_mut().enumerate() {
                    for (c, slot) in row.iter_mut().enumerate() {
                        let k = r * COLS + c;
                        if obs[2 * k] > 0.5 {
                            *slot = Some(0);
                        } else if obs[2 * k + 1] > 0.5 {
                            *slot = Some(1);
                        }
                    }
                }
                match bot.best_column(&board, 0) {
                    Some(col) if mask.get(col) == Some(&1) => col as i64,
                    _ => random_legal(mask, rng),
                }
            }
        }
    }
}

/// A uniformly random action among those `mask` allows (action 0 when it
/// allows none, which the env-runner refuses before asking).
pub fn random_legal(mask: &[u8], rng: &mut impl Rng) -> i64 {
    let legal = mask.iter().filter(|&&m| m == 1).count();
    if legal == 0 {
        return 0;
    }
    let pick = rng.random_range(0..legal);
    mask.iter()
        .enumerate()
        .filter(|(_, &m)| m == 1)
        .nth(pick)
        .map_or(0, |(a, _)| a as i64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ActionSpace, BoxSpace};
    use rand::SeedableRng;

    fn tictactoe() -> EnvSpec {
        EnvSpec {
            id: TICTACTOE,
            observation_space: BoxSpace {
                low: vec![0.0; 18],
                high: vec![1.0; 18],
            },
            action_space: ActionSpace::Discrete { n: 9 },
            max_episode_steps: 9,
            reward_threshold: None,
            image: None,
            action_mask: true,
            agents: vec!["player_1".into(), "player_2".into()],
            team: Vec::new(),
        }
    }

    #[test]
    fn connect_four_bot_wins_and_blocks_on_the_observation_planes() {
        let spec = EnvSpec {
            id: CONNECT_FOUR,
            observation_space: BoxSpace {
                low: vec![0.0; 86],
                high: vec![1.0; 86],
            },
            action_space: ActionSpace::Discrete { n: 7 },
            ..tictactoe()
        };
        let mut bot = SeatBot::new("connect_four_bot", &spec).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        let cell = |r: usize, c: usize| 2 * (r * COLS + c);
        // The mover has three in the bottom row (columns 0-2), the other
        // player three in column 6: column 3 wins.
        let mut obs = [0f32; 86];
        for c in 0..3 {
            obs[cell(5, c)] = 1.0;
        }
        for r in 3..6 {
            obs[cell(r, 6) + 1] = 1.0;
        }
        let mask = [1u8; 7];
        assert_eq!(bot.act(&obs, &mask, &mut rng), 3);
        // Without the mover's three, the other player's column must be
        // blocked.
        for c in 0..3 {
            obs[cell(5, c)] = 0.0;
        }
        obs[cell(5, 3)] = 1.0;
        assert_eq!(bot.act(&obs, &mask, &mut rng), 6);
    }

    #[test]
    fn random_draws_only_legal_actions() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let mask = [0, 1, 0, 0, 1, 0, 0, 0, 0];
        let mut seen = [0; 9];
        for _ in 0..200 {
            seen[random_legal(&mask, &mut rng) as usize] += 1;
        }
        assert_eq!(seen[1] + seen[4], 200);
        assert!(seen[1] > 50 && seen[4] > 50, "{seen:?}");
    }

    #[test]
    fn minimax_wins_blocks_and_refuses_other_games() {
        let mut bot = SeatBot::new("minimax", &tictactoe()).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        // Mover holds cells 0 and 1, the other player 3 and 4: cell 2 wins.
        let mut obs = [0f32; 18];
        for cell in [0, 1] {
            obs[2 * cell] = 1.0;
        }
        for cell in [3, 4] {
            obs[2 * cell + 1] = 1.0;
        }
        let mask: Vec<u8> = (0..9)
            .map(|c| u8::from(obs[2 * c] + obs[2 * c + 1] == 0.0))
            .collect();
        assert_eq!(bot.act(&obs, &mask, &mut rng), 2);
        // The other player holds 0 and 1, the mover 4: cell 2 blocks.
        let mut obs = [0f32; 18];
        obs[1] = 1.0;
        obs[3] = 1.0;
        obs[8] = 1.0;
        let mask: Vec<u8> = (0..9)
            .map(|c| u8::from(obs[2 * c] + obs[2 * c + 1] == 0.0))
            .collect();
        assert_eq!(bot.act(&obs, &mask, &mut rng), 2);

        let mut other = tictactoe();
        other.id = "connect_four_v3";
        assert!(SeatBot::new("minimax", &other).is_err());
        assert!(SeatBot::new("connect_four_bot", &tictactoe()).is_err());
        assert!(SeatBot::new("alphazero", &other).is_err());
        other.action_mask = false;
        assert!(!SeatBot::plays("random", &other));
    }
}
