//! `relay play` of a run on a multi-agent game played on observations
//! (PettingZoo's, `env.backend: pettingzoo`): the checkpoint's greedy
//! policy holds `--model-seat`, and `--opponent` the other seats: `human`
//! (you, typing moves at the terminal), `random`, `minimax`,
//! `connect_four_bot` or
//! `checkpoint:<folder>` (the fixed opponents of self-play and
//! `vs-opponent`, [`relay_policy::opponent::SeatOpponent`]).
//!
//! Each turn prints the mover and its move. On your turn the board is
//! printed from the observation, for the games whose observation is a
//! board of two planes (the mover's pieces, then the other player's):
//! TicTacToe shows each empty cell as the action that marks it,
//! ConnectFour numbers its columns; other games print the observation
//! values. You type one of the legal actions listed; anything else is
//! refused and asked again.

use std::io::{BufRead, Write};

use anyhow::{bail, Context, Result};
use rand::SeedableRng;
use relay_config::ExperimentConfig;
use relay_envs::VecActions;
use relay_nn::Actions;
use relay_policy::opponent::SeatOpponent;
use relay_policy::Act;

/// Who holds the seats the model does not.
enum Opponent {
    Human,
    Fixed(SeatOpponent),
}

/// One game's result.
#[derive(Debug, Clone, PartialEq)]
pub struct SeatGame {
    /// Every seat's return.
    pub returns: Vec<f64>,
    /// The model's moves.
    pub model_moves: u32,
}

/// Plays `games` games of the run `config` describes with the policy of
/// checkpoint folder `dir` at `model_seat` against `opponent`, game `g`
/// seeded `seed + g`; moves are read from `input` and everything written
/// to `out`. Returns each game's result.
#[allow(clippy::too_many_arguments)]
pub fn play_seat_games(
    config: &ExperimentConfig,
    dir: &std::path::Path,
    model_seat: usize,
    opponent: &str,
    games: usize,
    seed: u64,
    input: &mut impl BufRead,
    out: &mut impl Write,
) -> Result<Vec<SeatGame>> {
    let spec = config.env_spec()?;
    let seats = spec.agents.len();
    if model_seat >= seats {
        bail!(
            "--model-seat {model_seat}: {} has seats 0 to {} ({})",
            spec.id,
            seats - 1,
            spec.agents.join(", ")
        );
    }
    let (model, normalizer) = crate::play::load_policy(config, dir)?;
    let mut opponent = match opponent {
        "human" => Opponent::Human,
        name => Opponent::Fixed(
            SeatOpponent::new(name, &spec).with_context(|| format!("--opponent {name}"))?,
        ),
    };
    let human = matches!(opponent, Opponent::Human);
    let who = |seat: usize| match (seat == model_seat, human) {
        (true, _) => "model",
        (false, true) => "you",
        (false, false) => "opponent",
    };
    let d = spec.obs_dim();
    let width = spec.action_space.n().unwrap_or(0);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut results = Vec::new();
    for game in 0..games.max(1) {
        let game_seed = seed.wrapping_add(game as u64);
        writeln!(out, "game {game} (seed {game_seed})")?;
        let mut envs = relay_bridge::VecEnvs::new(spec.id, &config.env, 1, game_seed)?;
        let mut obs = envs.reset()?.to_vec();
        let mut model_moves = 0;
        loop {
            let mover = envs
                .movers()
                .context("a multi-agent game names its mover")?[0] as usize;
            let mask = envs
                .masks()
                .map_or_else(|| vec![1u8; width], <[u8]>::to_vec);
            let action = if mover == model_seat {
                model_moves += 1;
                let mut model_obs = obs.clone();
                if let Some(n) = &normalizer {
                    n.normalize_obs(&mut model_obs);
                }
                match model
                    .act(&model_obs, 1, &mut [], Some(&mask), true, &mut rng)?
                    .actions
                {
                    Actions::Discrete(a) => a[0],
                    Actions::Continuous(_) => bail!("a multi-agent game has discrete actions"),
                }
            } else {
                match &mut opponent {
                    Opponent::Human => {
                        write!(out, "{}", board(spec.id, &obs, mover, &spec.agents))?;
                        ask_move(&mask, input, out)?
                    }
                    Opponent::Fixed(fixed) => fixed
                        .act(&obs, &mask, 1, &mut rng)
                        .map_err(anyhow::Error::msg)?[0],
                }
            };
            writeln!(
                out,
                "player {mover} {} ({}): {action}",
                spec.agents[mover],
                who(mover)
            )?;
            let step = envs.step(VecActions::Discrete(&[action]))?;
            if let Some(returns) = step.seat_returns(0) {
                let returns = returns.to_vec();
                if let Some(last) = step.final_seat_obs(0, 0) {
                    write!(out, "{}", board(spec.id, last, 0, &spec.agents))?;
                }
                for (seat, r) in returns.iter().enumerate() {
                    writeln!(
                        out,
                        "player {seat} {} ({}): return {r}",
                        spec.agents[seat],
                        who(seat)
                    )?;
                }
                results.push(SeatGame {
                    returns,
                    model_moves,
                });
                break;
            }
            obs.copy_from_slice(&step.obs[..d]);
        }
    }
    Ok(results)
}

/// Reads a legal action from `input`, asking again after anything else.
fn ask_move(mask: &[u8], input: &mut impl BufRead, out: &mut impl Write) -> Result<i64> {
    let legal: Vec<String> = (0..mask.len())
        .filter(|&a| mask[a] == 1)
        .map(|a| a.to_string())
        .collect();
    loop {
        write!(out, "your move ({}): ", legal.join(" "))?;
        out.flush()?;
        let mut line = String::new();
        if input.read_line(&mut line)? == 0 {
            bail!("standard input ended before the game did");
        }
        match line.trim().parse::<usize>() {
            Ok(a) if mask.get(a) == Some(&1) => return Ok(a as i64),
            _ => writeln!(
                out,
                "{:?} is not a legal move; type one of: {}",
                line.trim(),
                legal.join(" ")
            )?,
        }
    }
}

/// The board of `obs` as the seat `mover` sees it, one mark per seat
/// (`X` seat 0, `O` seat 1): TicTacToe (`[3, 3, 2]`, empty cells show the
/// action that marks them, cell `k` at values `2k` and `2k + 1`) and
/// ConnectFour (`[6, 7, 2]`, columns numbered); other games: the values.
pub fn board(env_id: &str, obs: &[f32], mover: usize, agents: &[String]) -> String {
    // The board's values, then with env.seat_feature the seat's one-hot.
    let (rows, cols) = match (env_id, obs.len()) {
        (id, 18 | 20) if id.starts_with("tictactoe") => (3, 3),
        (id, 84 | 86) if id.starts_with("connect_four") => (6, 7),
        _ => return format!("observation {obs:?}\n"),
    };
    let marks = ['X', 'O'];
    let (own, other) = (marks[mover % 2], marks[(mover + 1) % 2]);
    let mut text = String::new();
    for r in 0..rows {
        for c in 0..cols {
            let k = r * cols + c;
            let cell = if obs[2 * k] > 0.5 {
                own.to_string()
            } else if obs[2 * k + 1] > 0.5 {
                other.to_string()
            } else if rows == 3 {
                k.to_string()
            } else {
                ".".to_string()
            };
            text.push_str(&format!(" {cell}"));
        }
        text.push('\n');
    }
    if rows == 6 {
        let columns: Vec<String> = (0..cols).map(|c| c.to_string()).collect();
        text.push_str(&format!(" {}\n", columns.join(" ")));
    }
    let names: Vec<String> = agents
        .iter()
        .zip(marks)
        .map(|(agent, mark)| format!("{mark} {agent}"))
        .collect();
    text.push_str(&format!(" ({})\n", names.join(", ")));
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boards_show_each_seat_s_mark_and_the_actions() {
        let agents = vec!["player_1".to_string(), "player_2".to_string()];
        // player_2 to move: its own mark (O) on cell 4, player_1's (X) on 0.
        let mut obs = vec![0.0; 18];
        obs[2 * 4] = 1.0;
        obs[1] = 1.0;
        assert_eq!(
            board("tictactoe_v3", &obs, 1, &agents),
            " X 1 2\n 3 O 5\n 6 7 8\n (X player_1, O player_2)\n"
        );
        let mut obs = vec![0.0; 84];
        obs[2 * (5 * 7 + 3)] = 1.0;
        let text = board("connect_four_v3", &obs, 0, &agents);
        assert!(text.contains(" . . . X . . .\n 0 1 2 3 4 5 6\n"), "{text}");
        assert!(board("leduc_holdem_v4", &[0.5], 0, &agents).contains("0.5"));
    }
}
