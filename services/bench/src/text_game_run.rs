//! A text-game run as the text-game benchmarks drive it (`bench-tictactoe`,
//! `bench-league`, `bench-smollm2`): the SFT warm start on random legal
//! moves, the RL run's `relay up` flags, and the evaluation rows followed
//! from the run's `eval.jsonl` as they arrive, printed as one table.

use std::io::{BufRead, BufReader, Seek, SeekFrom};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::{json, Value};

use relay::sft::{EvalResult, SftArgs};
use relay::UpArgs;

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
