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

use std::io::{BufRead, BufReader, Seek, SeekFrom};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::{json, Value};

use relay::sft::{EvalResult, SftArgs};
use relay::UpArgs;

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

/// Legal-move rate and non-loss rates of one evaluation.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Row {
    pub(crate) stage: String,
    pub(crate) minutes: f64,
    pub(crate) version: Option<u64>,
    pub(crate) results: Vec<EvalResult>,
    /// Games the evaluator gave up on (no usable reply for the version it
    /// plays): the rates are over the games played, so a row with
    /// abandoned games measures fewer games than asked, maybe one seat only.
    pub(crate) abandoned: u32,
}

impl Row {
    pub(crate) fn legal_move_rate(&self) -> f64 {
        let moves: u32 = self.results.iter().map(|r| r.moves).sum();
        let invalid: u32 = self.results.iter().map(|r| r.invalid_moves).sum();
        if moves == 0 {
            1.0
        } else {
            1.0 - invalid as f64 / moves as f64
        }
    }

    pub(crate) fn non_loss(&self, opponent: &str) -> Option<f64> {
        self.results
            .iter()
            .find(|r| r.opponent == opponent)
            .map(EvalResult::non_loss_rate)
    }

    pub(crate) fn print(&self) {
        let cell = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{:.1}%", 100.0 * v));
        let wdl = |opponent: &str| {
            self.results
                .iter()
                .find(|r| r.opponent == opponent)
                .map_or("-".to_string(), |r| {
                    format!("{}/{}/{}", r.wins, r.draws, r.losses)
                })
        };
        println!(
            "| {} | {:.1} | {} | {:.1}% | {} | {} | {} | {} | {} |",
            self.stage,
            self.minutes,
            self.version.map_or("-".to_string(), |v| v.to_string()),
            100.0 * self.legal_move_rate(),
            cell(self.non_loss("random")),
            wdl("random"),
            cell(self.non_loss("minimax")),
            wdl("minimax"),
            self.abandoned,
        );
    }

    pub(crate) fn json(&self) -> Value {
        json!({
            "stage": self.stage,
            "minutes": (self.minutes * 100.0).round() / 100.0,
            "version": self.version,
            "legal_move_rate": self.legal_move_rate(),
            "non_loss_vs_random": self.non_loss("random"),
            "non_loss_vs_minimax": self.non_loss("minimax"),
            "abandoned": self.abandoned,
        })
    }
}

pub(crate) fn header() {
    println!("| stage | minutes | version | legal moves | non-loss vs random | W/D/L random | non-loss vs minimax | W/D/L minimax | abandoned |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
}

/// One `eval.jsonl` line with matchups as a row (both seats summed per
/// opponent); version 0 gets the stage `start`, later ones `RL`.
fn eval_row(line: &Value, started: Instant, start: &str) -> Option<Row> {
    let matchups = line["matchups"].as_array().filter(|m| !m.is_empty())?;
    let mut results: Vec<EvalResult> = Vec::new();
    let mut abandoned = 0;
    for m in matchups {
        abandoned += m["abandoned"].as_u64().unwrap_or(0) as u32;
        let opponent = m["opponent"].as_str()?.to_string();
        let index = match results.iter().position(|r| r.opponent == opponent) {
            Some(i) => i,
            None => {
                results.push(EvalResult {
                    opponent,
                    ..Default::default()
                });
                results.len() - 1
            }
        };
        let r = &mut results[index];
        let n = |k: &str| m[k].as_u64().unwrap_or(0) as u32;
        r.games += n("games");
        r.wins += n("wins");
        r.draws += n("draws");
        r.losses += n("losses");
        r.moves += n("moves");
        r.invalid_moves += n("invalid_moves");
    }
    let version = line["policy_version"].as_u64();
    Some(Row {
        stage: if version == Some(0) { start } else { "RL" }.into(),
        minutes: started.elapsed().as_secs_f64() / 60.0,
        version,
        results,
        abandoned,
    })
}

/// Prints each evaluation of `eval.jsonl` as it is appended and hands it
/// to `on_row` with the rows before it, until `stop`; version 0 (the
/// starting adapter) is labelled `start`.
pub(crate) fn follow_evals(
    path: PathBuf,
    started: Instant,
    start: &'static str,
    stop: Arc<AtomicBool>,
    mut on_row: impl FnMut(&[Row]),
) -> Vec<Row> {
    let mut rows = Vec::new();
    let mut offset = 0u64;
    let mut pending = String::new();
    loop {
        let stopping = stop.load(Ordering::Relaxed);
        if let Ok(mut file) = std::fs::File::open(&path) {
            if file.seek(SeekFrom::Start(offset)).is_ok() {
                let mut reader = BufReader::new(file);
                let mut line = String::new();
                while let Ok(n) = reader.read_line(&mut line) {
                    if n == 0 {
                        break;
                    }
                    offset += n as u64;
                    pending.push_str(&line);
                    line.clear();
                    if pending.ends_with('\n') {
                        if let Some(row) = serde_json::from_str::<Value>(pending.trim())
                            .ok()
                            .and_then(|v| eval_row(&v, started, start))
                        {
                            row.print();
                            rows.push(row);
                            on_row(&rows);
                        }
                        pending.clear();
                    }
                }
            }
        }
        if stopping {
            return rows;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// `relay sft` on TicTacToe games of random legal moves (both seats),
/// prompted as the RL run's `text` section prompts (system prompt,
/// observation view, chat template variables): full fine-tuning of
/// `model` into `<out>/model`; callers change what differs (a LoRA adapter
/// with `full: false`, the seed, the learning rate).
pub(crate) fn random_move_sft(
    model: String,
    out: PathBuf,
    games: usize,
    epochs: usize,
    eval_games: usize,
    text: &relay_config::TextConfig,
    llm: &relay_config::LlmConfig,
) -> SftArgs {
    SftArgs {
        env: "TicTacToe-v0".into(),
        model,
        out,
        data: None,
        games,
        bots: "random,random".into(),
        write_data: None,
        full: true,
        backend: Default::default(),
        device: Default::default(),
        dtype: Default::default(),
        rank: 8,
        alpha: 16.0,
        epochs,
        batch_size: 32,
        minibatch_size: 8,
        lr: 1e-3,
        max_seq_len: None,
        system_prompt: text.system_prompt.clone(),
        observation: text.observation,
        answer: text.answer.clone(),
        chat_template_kwargs: (!llm.chat_template_kwargs.is_empty())
            .then(|| llm.chat_template_kwargs.clone()),
        holdout: 0.05,
        eval_games,
        eval_opponents: "random,minimax".into(),
        max_tokens: 8,
        seed: 0,
        textarena: false,
        replicas: Default::default(),
    }
}

/// The warm start of the tiny-model TicTacToe benchmarks: `relay model
/// init tiny` into `<work>/tiny`, then full SFT on games of random legal
/// moves into `<work>/sft` ([`random_move_sft`]); returns the SFT model's
/// folder and its evaluation against random and minimax.
pub(crate) fn sft_warm_start(
    work: &std::path::Path,
    sft_games: usize,
    sft_epochs: usize,
    eval_games: usize,
    config: &relay_config::ExperimentConfig,
    started: Instant,
) -> Result<(PathBuf, Row)> {
    let tiny = work.join("tiny");
    relay::model::init_tiny(&tiny, 0)?;

    println!("== SFT on {sft_games} games of random legal moves");
    let sft_out = work.join("sft");
    let summary = relay::sft::run_sft(random_move_sft(
        tiny.display().to_string(),
        sft_out.clone(),
        sft_games,
        sft_epochs,
        eval_games,
        &config.text,
        &config.llm,
    ))?
    .context("relay sft ran as a replica other than rank 0")?;
    let row = Row {
        stage: "SFT greedy".into(),
        minutes: started.elapsed().as_secs_f64() / 60.0,
        version: None,
        results: summary.after.clone(),
        abandoned: 0,
    };
    Ok((sft_out.join("model"), row))
}

/// The overrides of the benchmarks' RL run after the warm start: the SFT
/// model as the base, runs under `runs_dir`, no stop when solved, moves
/// not constrained to legal ones (the legal-move rate is the model's), no
/// budget, and an evaluation every `eval_every_s` seconds (only then: a
/// big evaluation every few versions would take the learner's cores) of
/// `eval_games` games per opponent and seat.
pub(crate) fn rl_overrides(
    user: &[String],
    sft_model: &std::path::Path,
    runs_dir: &std::path::Path,
    eval_every_s: u64,
    eval_games: usize,
) -> Vec<String> {
    let mut overrides = user.to_vec();
    overrides.extend([
        format!("llm.model={}", sft_model.display()),
        format!("run.runs_dir={}", runs_dir.display()),
        "run.stop_when_solved=false".into(),
        "text.constrained=false".into(),
        "run.total_env_steps=1000000000".into(),
        format!("eval.every_seconds={eval_every_s}"),
        format!("eval.every_versions={}", u32::MAX),
        // vs-opponent's `games` counts both seats.
        format!("eval.options.games={}", 2 * eval_games),
    ]);
    overrides
}

/// `relay up` as the text benchmarks run it: one copy of each service,
/// quiet, a fresh run `run_id` of `config` with `overrides`, stopping
/// after `for_seconds` when given.
pub(crate) fn bench_up_args(
    config: &std::path::Path,
    overrides: Vec<String>,
    run_id: &str,
    state_dir: &std::path::Path,
    for_seconds: Option<u64>,
) -> UpArgs {
    UpArgs {
        config: config.to_path_buf(),
        overrides,
        run_id: Some(run_id.to_string()),
        until_solved: false,
        env_runners: 1,
        inference_servers: 1,
        learners: None,
        state_dir: state_dir.to_path_buf(),
        quiet: true,
        without: Vec::new(),
        for_seconds,
        final_eval_wait: 2,
        stall_timeout: 300,
        resume: None,
        checkpoint: "last".into(),
        init_from: None,
        reset_optimizer: false,
        stop: None,
        nats_url: None,
        redis_url: None,
    }
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
