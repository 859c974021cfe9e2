//! `relay bench-tictactoe`: the proof that play improves a policy.
//!
//! 1. `relay model init tiny`: a random tiny Qwen2 (`<work>/tiny`).
//! 2. `relay sft --full` on games of random legal moves: the model learns
//!    the format (legal moves), not the strategy; its greedy games against
//!    the random bot and minimax are printed as "SFT greedy".
//! 3. RL with all six services (`relay up` on `--config`, by default
//!    `configs/tictactoe-grpo.yaml`, with `llm.model` set to the SFT model)
//!    for `--minutes`; the `vs-opponent` evaluator plays the current
//!    version against random and minimax every `--eval-every-s` seconds,
//!    and each evaluation prints a row as it arrives (from the run's
//!    `eval.jsonl`). Decoding is not constrained to legal moves
//!    (`text.constrained=false`), so the legal-move rate is the model's.
//!
//! The first evaluation is of version 0, the zero adapter over the SFT
//! model: the SFT-only starting point under the same conditions as every
//! RL evaluation (the config's `eval.options`: greedy moves in
//! `configs/tictactoe-grpo.yaml`).
//!
//! Ends with a table (SFT greedy, SFT only, last RL evaluation: legal-move
//! rate and non-loss rate against each opponent) and a JSON line.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};

use crate::text_game_run::{
    bench_up_args, follow_evals, header, rl_overrides, sft_warm_start, Row,
};
use serde_json::json;

/// Flags of `relay bench-tictactoe`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchTicTacToeArgs {
    /// Minutes of RL after the SFT warm start.
    #[arg(long, default_value_t = 15.0)]
    pub minutes: f64,
    /// The RL config.
    #[arg(long, default_value = "configs/tictactoe-grpo.yaml")]
    pub config: PathBuf,
    /// Override config fields of the RL run (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Folder for the tiny model, the SFT output and the runs.
    #[arg(long, default_value = "bench/tictactoe")]
    pub work_dir: PathBuf,
    /// Games of random legal moves the SFT data comes from.
    #[arg(long, default_value_t = 1000)]
    pub sft_games: usize,
    /// Passes of SFT over those moves.
    #[arg(long, default_value_t = 4)]
    pub sft_epochs: usize,
    /// Games per opponent and seat in each evaluation (the random bot's
    /// games differ a lot: 10 per seat miss the policy's rate by 20 points).
    #[arg(long, default_value_t = 100)]
    pub eval_games: usize,
    /// Seconds between evaluations of the RL run.
    #[arg(long, default_value_t = 120)]
    pub eval_every_s: u64,
    /// Folder for the stack's state.
    #[arg(long, default_value = ".relay")]
    pub state_dir: PathBuf,
}

/// `relay bench-tictactoe`.
pub fn bench_tictactoe(args: BenchTicTacToeArgs) -> Result<()> {
    let started = Instant::now();
    std::fs::create_dir_all(&args.work_dir)
        .with_context(|| format!("creating {}", args.work_dir.display()))?;
    let work = std::fs::canonicalize(&args.work_dir)?;
    let config = relay_config::ExperimentConfig::load(&args.config, &args.overrides)?;
    let (sft_model, sft_row) = sft_warm_start(
        &work,
        args.sft_games,
        args.sft_epochs,
        args.eval_games,
        &config,
        started,
    )?;
    let sft_minutes = sft_row.minutes;

    println!("== RL for {} minutes", args.minutes);
    let run_id = format!("{}-bench", relay::make_run_id(&config));
    let runs_dir = work.join("runs");
    let overrides = rl_overrides(
        &args.overrides,
        &sft_model,
        &runs_dir,
        args.eval_every_s,
        args.eval_games,
    );
    let up = bench_up_args(
        &args.config,
        overrides,
        &run_id,
        &args.state_dir,
        Some((args.minutes * 60.0).round().max(1.0) as u64),
    );
    header();
    sft_row.print();
    let stop = Arc::new(AtomicBool::new(false));
    let follower = {
        let (path, stop) = (runs_dir.join(&run_id).join("eval.jsonl"), stop.clone());
        // Version 0, the zero adapter over the SFT model, is the SFT-only starting point.
        std::thread::spawn(move || follow_evals(path, started, "SFT only", stop, |_| {}))
    };
    let outcome = relay::up(up);
    stop.store(true, Ordering::Relaxed);
    let rows = follower
        .join()
        .map_err(|_| anyhow::anyhow!("the eval follower panicked"))?;
    outcome?;

    println!();
    header();
    sft_row.print();
    if let Some(first) = rows.first() {
        first.print();
    }
    if rows.len() > 1 {
        rows.last().expect("non-empty").print();
    }
    let (first, last) = (rows.first(), rows.last());
    let non_loss = |row: Option<&Row>| row.and_then(|r| r.non_loss("random"));
    let rl_gain = non_loss(last).zip(non_loss(first)).map(|(l, f)| l - f);
    println!(
        "{}",
        json!({
            "env": "TicTacToe-v0",
            "run_id": run_id,
            "rl_minutes": args.minutes,
            "sft_minutes": (sft_minutes * 100.0).round() / 100.0,
            "evaluations": rows.len(),
            "sft_greedy": sft_row.json(),
            "sft_only": first.map(Row::json),
            "last_rl": last.map(Row::json),
            "rl_gain_non_loss_vs_random": rl_gain,
            "targets_met": last.map(|r| r.legal_move_rate() >= 0.98
                && r.non_loss("random").unwrap_or(0.0) >= 0.90
                && rl_gain.is_some_and(|g| g > 0.0)),
        })
    );
    Ok(())
}
