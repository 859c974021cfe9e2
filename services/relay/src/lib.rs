//! The `relay` command line: the local stack supervisor (`up`, `down`,
//! `scale`, `top`), runs, checkpoints, plots, offline evaluation, play,
//! a text run's games, models and SFT. See `main.rs` for the commands; the benchmarks, chaos,
//! soak and sweeps are `relay-bench`'s.

pub mod checkpoints;
pub mod eval;
pub mod games;
pub mod model;
pub mod play;
pub mod play_seats;
pub mod play_text;
pub mod runs;
pub mod scale;
pub mod sft;
pub mod stack;
pub mod summary;
pub mod top;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use relay_config::ExperimentConfig;
use relay_proto::{EvalReport, MetricsReport, RunStatus, RunStatusUpdate, Subjects};
use tokio::signal::unix::{signal, SignalKind};

use stack::{last_error_line, Copies, Stack, SERVICES};

/// The subcommands `relay` runs through the `relay-bench` binary beside it
/// (relay-bench's own tests check that they are exactly its subcommands).
pub const BENCH_COMMANDS: [&str; 20] = [
    "bench-scale",
    "soak",
    "bench-tracker",
    "bench-solve",
    "bench-learning",
    "sweep",
    "chaos",
    "bench-tictactoe",
    "bench-smollm2",
    "bench-league",
    "bench-generate",
    "bench-gpu",
    "bench-cnn-step",
    "bench-allreduce",
    "bench-learners",
    "bench-hub-model",
    "bench-llamacpp",
    "bench-bridge",
    "bench-envs",
    "bench-weights",
];

/// Flags of `relay up`.
#[derive(Debug, Clone, clap::Args)]
pub struct UpArgs {
    /// Experiment config.
    #[arg(long, default_value = "configs/cartpole-ppo.yaml")]
    pub config: PathBuf,
    /// Override config fields: `--set ppo.learning_rate=0.0003` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Run id; defaults to `<env>-<algo>-<yyyymmdd-hhmmss>`.
    #[arg(long)]
    pub run_id: Option<String>,
    /// Stop the whole stack once the run is solved (or its budget is spent).
    #[arg(long)]
    pub until_solved: bool,
    /// Copies of the env-runner.
    #[arg(long, default_value_t = 1)]
    pub env_runners: usize,
    /// Copies of the inference server.
    #[arg(long, default_value_t = 1)]
    pub inference_servers: usize,
    /// Learner replicas (synchronous data parallelism: each takes a share
    /// of every batch and the gradients are summed; every algorithm,
    /// text runs included); defaults to the config's `learner.replicas`.
    #[arg(long)]
    pub learners: Option<usize>,
    /// Folder for the stack's state (NATS, Redis, Prometheus data, process logs).
    #[arg(long, default_value = ".relay")]
    pub state_dir: PathBuf,
    /// Print no progress lines.
    #[arg(long)]
    pub quiet: bool,
    /// Do not start this service (repeatable), e.g. to run it elsewhere or
    /// to measure the stack without the tracker.
    #[arg(long, value_name = "SERVICE")]
    pub without: Vec<String>,
    /// Stop the stack after this many seconds of training.
    #[arg(long, value_name = "SECONDS")]
    pub for_seconds: Option<u64>,
    /// With `--until-solved`: once the learner has stopped, how long to wait
    /// for the evaluation of its last version (text-game evaluations play
    /// whole games, so they can take minutes).
    #[arg(long, value_name = "SECONDS", default_value_t = 2)]
    pub final_eval_wait: u64,
    /// Fail the run (stop the stack, exit non-zero) when neither an env
    /// step nor a learner update happened for this many seconds while it
    /// trains, naming what each service last reported (0: never).
    #[arg(long, value_name = "SECONDS", default_value_t = 300)]
    pub stall_timeout: u64,
    /// Continue a run (`<run-id>` or `@last`) from a checkpoint: same run id,
    /// the run's own config (from the checkpoint; `--set` still applies), the
    /// learner loads model, optimizer, counters and RNG.
    #[arg(long, value_name = "RUN")]
    pub resume: Option<String>,
    /// With `--resume` or `--init-from`: which checkpoint (`last`, `best` or a number).
    #[arg(long, default_value = "last")]
    pub checkpoint: String,
    /// Start a new run from the weights of `<run>[:best|last|N]` (shape-checked).
    #[arg(long, value_name = "RUN[:CHECKPOINT]", conflicts_with = "resume")]
    pub init_from: Option<String>,
    /// With `--resume` or `--init-from`: start Adam afresh.
    #[arg(long)]
    pub reset_optimizer: bool,
    /// Set from another thread to stop the stack (e.g. `relay sweep`
    /// stopping a hopeless trial).
    #[arg(skip)]
    pub stop: Option<StopFlag>,
    /// Use this running nats-server (e.g. another machine's) instead of
    /// starting one: the services started here connect to it, and copies
    /// started by hand anywhere else that reaches it join the run.
    #[arg(long, value_name = "URL")]
    pub nats_url: Option<String>,
    /// Use this running redis-server instead of starting one (replay
    /// buffers and league pools of copies on several machines must share it).
    #[arg(long, value_name = "URL")]
    pub redis_url: Option<String>,
}

/// A request to stop a running `relay up` from another thread.
#[derive(Debug, Clone, Default)]
pub struct StopFlag(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl StopFlag {
    /// Asks the stack to stop (at its next one-second tick).
    pub fn stop(&self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether a stop was asked for.
    pub fn is_set(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// How a run ended, as seen by the supervisor.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub run_id: String,
    /// Solved: a version passed the screening and its confirmation on
    /// fresh episodes.
    pub solved: bool,
    /// Start-up of the stack (infrastructure and services) until all were healthy.
    pub startup_s: f64,
    /// From every service ready to the solving eval (or the end).
    pub wall_s: f64,
    /// Env steps the learner had consumed at the solving eval (or the end).
    pub env_steps: u64,
    /// Env steps the learner consumed in all: a run with
    /// `run.stop_when_solved: false` trains on after it is solved.
    pub trained_env_steps: u64,
    /// From every service ready until the learner stopped (or the end).
    pub trained_s: f64,
    /// The solving eval's screening mean (or the last eval's).
    pub eval_return: Option<f64>,
    /// The solving eval's confirmation mean.
    pub confirmed_return: Option<f64>,
    /// The first eval whose screening mean reached the threshold (what
    /// was called solved before confirmations), confirmed or not.
    pub first_pass: Option<FirstPass>,
    /// How the run ended (the summary's first line).
    pub how: String,
    /// The best evaluation.
    pub best: Option<summary::BestEval>,
    /// The summary was printed while the stack stayed up.
    pub summarized: bool,
    /// Why the run failed: a service reported it could not do its part,
    /// exited, or the run stalled.
    pub failure: Option<String>,
}

/// The first screening pass of a run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FirstPass {
    pub wall_s: f64,
    pub env_steps: u64,
}

/// Makes a run id `<env>-<algo>-<yyyymmdd-hhmmss>` (characters a run id
/// cannot hold, such as the `/` of `ALE/Pong-v5`, become `-`).
pub fn make_run_id(config: &ExperimentConfig) -> String {
    let env: String = config
        .run
        .env_id
        .chars()
        .map(|c| match c {
            'a'..='z' | 'A'..='Z' | '0'..='9' | '-' | '_' => c,
            _ => '-',
        })
        .collect();
    format!(
        "{}-{}-{}",
        env,
        config.algo_name(),
        chrono::Local::now().format("%Y%m%d-%H%M%S")
    )
}

/// `relay up`: start everything, train, display progress, stop cleanly.
pub fn up(mut args: UpArgs) -> Result<Outcome> {
    let mut overrides = args.overrides.clone();
    let mut resumed_id = None;
    if let Some(run) = &args.resume {
        // The runs folder of the run: from the given config and overrides.
        let base = ExperimentConfig::load(&args.config, &overrides)?;
        let (id, _, dir) =
            checkpoints::resolve(&base.run.runs_dir, run, &args.checkpoint).context("--resume")?;
        println!("relay: resuming run {id} from {}", dir.display());
        // A copy: the learner soon rotates that checkpoint away, and copies
        // added later by `relay scale` read the config path again.
        std::fs::create_dir_all(&args.state_dir)?;
        let config = args.state_dir.join(format!("{id}.resumed.yaml"));
        std::fs::copy(dir.join("config.yaml"), &config)
            .with_context(|| format!("copying {}", dir.join("config.yaml").display()))?;
        args.config = config;
        overrides.insert(0, format!("run.resume_from={}", dir.display()));
        overrides.insert(0, "run.init_from=null".into());
        overrides.insert(0, format!("run.runs_dir={}", base.run.runs_dir.display()));
        resumed_id = Some(id);
    } else if let Some(spec) = &args.init_from {
        let base = ExperimentConfig::load(&args.config, &overrides)?;
        let (run, which) = spec.split_once(':').unwrap_or((spec, &args.checkpoint));
        let (id, _, dir) =
            checkpoints::resolve(&base.run.runs_dir, run, which).context("--init-from")?;
        println!(
            "relay: new run from the weights of {id} ({})",
            dir.display()
        );
        overrides.push(format!("run.init_from={}", dir.display()));
    }
    if args.reset_optimizer {
        if args.resume.is_none() && args.init_from.is_none() {
            bail!("--reset-optimizer needs --resume or --init-from");
        }
        overrides.push("run.reset_optimizer=true".into());
    }
    let mut config = ExperimentConfig::load(&args.config, &overrides)?;
    // What relay's own nats-server carries: the largest message of the run.
    let mut nats_max_payload = relay_proto::DEFAULT_MAX_PAYLOAD;
    let mut largest_message = None;
    if !config.is_text_game() {
        // Made once here, so that an unknown id, a missing package, a policy
        // that does not fit the observations or observations too large to
        // send are reported before any service starts.
        let spec = config.env_spec().context("run.env_id")?;
        // First: where the id was found (what `env.backend: auto` picked).
        println!(
            "relay: {} {}",
            config.run.env_id,
            env_source(&config, &spec)
        );
        if let Some(whole) = whole_games(&config, &spec) {
            println!(
                "relay: {} has {} agents sharing one policy, each one env of a runner's vector: env_runner.num_envs {} -> {whole} ({} game(s) a runner)",
                spec.id,
                spec.team.len(),
                config.env_runner.num_envs,
                whole / spec.team.len()
            );
            overrides.push(format!("env_runner.num_envs={whole}"));
            config = ExperimentConfig::load(&args.config, &overrides)?;
        }
        config.check_env(&spec)?;
        nats_max_payload = config.nats_max_payload(&spec);
        largest_message = Some(config.largest_message_bytes(&spec));
    } else if config.env.text_uses_python() {
        // Each game made once here: an unknown id or a missing package is
        // reported before any service starts.
        for (game, _) in config.text.game_weights(&config.run.env_id) {
            let made = relay_bridge::make_text_game(&game, &config.env)
                .with_context(|| format!("text game {game}"))?;
            println!(
                "relay: {game} from TextArena (Python {}): {} player(s), {}",
                config.env.interpreter().display(),
                made.num_players(),
                match made.legal_moves().len() {
                    0 => "no legal moves listed (no constrained decoding, no random bot)".into(),
                    n => format!("{n} legal moves listed at the start"),
                }
            );
        }
    }
    // Which evaluation the run gets, and a plugin that cannot evaluate
    // this run refused before any service starts.
    let evaluator = relay_eval::plugins::build(&config.eval.evaluator, &config.eval.option_pairs())
        .map_err(anyhow::Error::msg)
        .context("eval.evaluator")?;
    evaluator
        .check_env(&config.run.env_id, &config.env)
        .map_err(anyhow::Error::msg)
        .context("eval.evaluator")?;
    println!(
        "relay: evaluation every {} version(s){}: {}",
        config.eval.every_versions,
        config
            .eval
            .every_seconds
            .map_or(String::new(), |s| format!(" or {s} s")),
        evaluator.describe(&config)
    );
    if let Some(path) = stack::ensure_tiny_model(&config)? {
        println!(
            "relay: wrote the tiny model to {} (llm.model)",
            path.display()
        );
    }
    let run_id = match resumed_id.or(args.run_id.clone()).or(config.run.id.clone()) {
        Some(id) => id,
        None => make_run_id(&config),
    };
    relay_proto::validate_run_id(&run_id).map_err(anyhow::Error::msg)?;
    overrides.retain(|o| !o.starts_with("run.id="));
    let learners = args.learners.unwrap_or(config.learner.replicas);
    scale::check("learner", learners as u32).map_err(anyhow::Error::msg)?;
    let copies = Copies {
        env_runners: args.env_runners,
        inference_servers: args.inference_servers,
        learners,
    };
    std::fs::create_dir_all(&args.state_dir)?;
    let state_dir = args.state_dir.canonicalize()?;
    let config_path = args
        .config
        .canonicalize()
        .with_context(|| format!("config {}", args.config.display()))?;

    let started = Instant::now();
    let external = stack::ExternalInfra {
        nats_url: args.nats_url.clone(),
        redis_url: args.redis_url.clone(),
    };
    let mut stack = Stack::start_infra(&state_dir, &run_id, &external, nats_max_payload)?;
    println!(
        "relay: run {run_id}  nats {}  redis {}  prometheus {}",
        stack.nats_url,
        stack.redis_url,
        stack.prometheus_url.as_deref().unwrap_or("(not installed)")
    );
    if let Some(largest) = largest_message {
        report_message_limit(&stack, &external, largest, nats_max_payload)?;
    }
    // The tracker first (it must hear the others' first log lines), the
    // learner last (training starts once everything else listens).
    if let Some(unknown) = args
        .without
        .iter()
        .find(|w| !SERVICES.contains(&w.as_str()))
    {
        bail!("--without {unknown}: not a service; the services are {SERVICES:?}");
    }
    let start_services = |stack: &mut Stack| -> Result<()> {
        for service in SERVICES {
            let n = match service {
                _ if args.without.iter().any(|w| w == service) => 0,
                "env-runner" => copies.env_runners,
                "inference-server" => copies.inference_servers,
                "learner" => copies.learners,
                _ => 1,
            };
            for _ in 0..n {
                stack.spawn_service(service, &config_path, &overrides)?;
            }
            if matches!(service, "tracker" | "env-runner") {
                stack.wait_healthy(Duration::from_secs(60))?;
            }
        }
        stack.wait_healthy(Duration::from_secs(60))
    };
    if let Err(e) = start_services(&mut stack) {
        // Said on stdout with the progress lines, and the stack stopped,
        // before the error ends the command.
        println!("relay: {e:#}");
        stack.stop(Duration::from_secs(15));
        println!("relay: stack stopped");
        return Err(e.context(format!("run {run_id} failed to start")));
    }
    let startup_s = started.elapsed().as_secs_f64();
    println!(
        "relay: {} services ready in {startup_s:.1}s; run directory {}/{run_id}; logs in {}/logs",
        stack.services.len(),
        config.run.runs_dir.display(),
        state_dir.display()
    );

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let threshold = config.solved_threshold();
    let run_dir = config.run.runs_dir.join(&run_id);
    let outcome = runtime.block_on(watch(&mut stack, &run_id, threshold, &run_dir, &args));
    stack.stop(Duration::from_secs(15));
    let mut outcome = outcome?;
    outcome.startup_s = startup_s;
    println!("relay: stack stopped");
    if !outcome.summarized {
        // After the stop: the tracker has drawn the plots.
        println!("{}", run_end(&stack, &outcome, run_dir).render());
    }
    if let Some(failure) = outcome.failure {
        bail!("run {run_id} failed: {failure}");
    }
    Ok(outcome)
}

/// Where `run.env_id` was found and what it is, as `relay up` says it
/// first: relay's built-in env, Gymnasium's, or PettingZoo's game (in
/// turns, or parallel with one shared policy), its observations and actions.
fn env_source(config: &ExperimentConfig, spec: &relay_envs::EnvSpec) -> String {
    let python = config.env.uses_python(&config.run.env_id);
    let source = if !python {
        "relay's built-in env".to_string()
    } else if !spec.agents.is_empty() {
        format!(
            "PettingZoo, a game of {} agents taking turns ({}), by self-play",
            spec.agents.len(),
            spec.agents.join(", ")
        )
    } else if !spec.team.is_empty() {
        format!(
            "PettingZoo, a parallel game of {} agents ({}{}) sharing one policy",
            spec.team.len(),
            spec.team[..spec.team.len().min(3)].join(", "),
            if spec.team.len() > 3 { ", ..." } else { "" }
        )
    } else {
        "Gymnasium".to_string()
    };
    let interpreter = if python {
        format!(" (Python {})", config.env.interpreter().display())
    } else {
        String::new()
    };
    format!(
        "from {source}{interpreter}: {} observations, {} actions",
        spec.image
            .map_or(spec.obs_dim().to_string(), |[c, h, w]| format!(
                "{c}x{h}x{w} image (uint8)"
            )),
        spec.action_space
            .n()
            .map_or("continuous".to_string(), |n| format!("{n} discrete"))
    )
}

/// `env_runner.num_envs` rounded up to whole games, for a parallel game
/// played by one shared policy whose agents (each one env of the vector)
/// it does not divide into; `None` when it does.
fn whole_games(config: &ExperimentConfig, spec: &relay_envs::EnvSpec) -> Option<usize> {
    let agents = spec.team.len();
    let n = config.env_runner.num_envs;
    (agents > 0 && !n.is_multiple_of(agents)).then(|| n.div_ceil(agents) * agents)
}

/// Says what limits the run's messages: relay's own nats-server sized to
/// about the largest one, or an external server's `max_payload`, below
/// which messages are divided.
fn report_message_limit(
    stack: &Stack,
    external: &stack::ExternalInfra,
    largest: usize,
    own: usize,
) -> Result<()> {
    const MB: f64 = 1e6;
    if external.nats_url.is_none() {
        if own > relay_proto::DEFAULT_MAX_PAYLOAD {
            println!(
                "relay: nats-server carries messages of up to {:.1} MB (max_payload), about this run's largest ({:.1} MB); anything larger is divided to fit",
                own as f64 / MB,
                largest as f64 / MB
            );
        }
        return Ok(());
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let limit = runtime.block_on(async {
        let client = async_nats::connect(&stack.nats_url).await?;
        client.flush().await?;
        Ok::<_, anyhow::Error>(client.max_payload())
    })?;
    if limit < largest {
        println!(
            "relay: {} carries messages of at most {:.1} MB (max_payload); this run's largest are about {:.1} MB, so fragments, act requests and batches are divided to fit (set max_payload to at least {} on that server for fewer, larger messages)",
            stack.nats_url,
            limit as f64 / MB,
            largest as f64 / MB,
            largest
        );
    }
    Ok(())
}

/// What a metrics report says of progress, for the stall report: its
/// counters and step, version and update gauges.
fn report_summary(report: &MetricsReport) -> String {
    let shown: Vec<String> = report
        .values
        .iter()
        .filter(|v| {
            v.name.ends_with("_total")
                || ["env_steps", "version", "updates", "sps"]
                    .iter()
                    .any(|k| v.name.ends_with(k))
        })
        .take(6)
        .map(|v| format!("{} {}", v.name, v.value))
        .collect();
    if shown.is_empty() {
        format!("{} values", report.values.len())
    } else {
        shown.join(", ")
    }
}

/// The failure of a run with no env step and no update for `stalled`:
/// what every service instance last reported, and when, and which of the
/// stack's `instances` never did.
fn stall_report(
    stalled: Duration,
    last_reports: &std::collections::BTreeMap<String, (Instant, String)>,
    instances: &[String],
) -> String {
    let mut report = format!(
        "stalled: no env step and no learner update for {:.0} s (--stall-timeout);",
        stalled.as_secs_f64()
    );
    for silent in instances.iter().filter(|i| !last_reports.contains_key(*i)) {
        report.push_str(&format!(" {silent} never reported;"));
    }
    for (instance, (at, summary)) in last_reports {
        report.push_str(&format!(
            " {instance} last reported {:.0} s ago ({summary});",
            at.elapsed().as_secs_f64()
        ));
    }
    report.trim_end_matches(';').to_string()
}

/// The summary of `outcome`.
fn run_end<'a>(stack: &'a Stack, outcome: &'a Outcome, run_dir: PathBuf) -> summary::RunEnd<'a> {
    summary::RunEnd {
        run_id: &outcome.run_id,
        how: outcome.how.clone(),
        env_steps: outcome.trained_env_steps.max(outcome.env_steps),
        wall_s: outcome.trained_s.max(outcome.wall_s),
        best: outcome.best,
        run_dir,
        prometheus_url: stack.prometheus_url.as_deref(),
        grafana_url: stack.grafana_url.as_deref(),
    }
}

/// Follows the run over NATS, printing a progress line each second, until
/// Ctrl-C, or (with `--until-solved`) the run is solved or the learner stops.
/// When training ends with the stack left up, prints the run's summary
/// once (after the last evaluation and the tracker's plots, or a few
/// seconds) and no more progress lines.
async fn watch(
    stack: &mut Stack,
    run_id: &str,
    threshold: Option<f64>,
    run_dir: &Path,
    args: &UpArgs,
) -> Result<Outcome> {
    let client = async_nats::connect(&stack.nats_url).await?;
    let subjects = Subjects::new(run_id);
    let mut metrics = client.subscribe(subjects.metrics()).await?;
    let mut evals = client.subscribe(subjects.eval()).await?;
    let mut statuses = client.subscribe(subjects.status()).await?;
    // Training return from the episodes themselves: an env-runner's
    // once-a-second metrics miss a run shorter than that.
    let mut episodes = client.subscribe(subjects.episodes()).await?;
    let mut recent_returns: std::collections::VecDeque<f64> =
        std::collections::VecDeque::with_capacity(100);
    // `relay scale` requests (see scale.rs).
    let mut scales = client.subscribe(subjects.supervisor_scale()).await?;
    let ready = Instant::now();
    let mut outcome = Outcome {
        run_id: run_id.to_string(),
        solved: false,
        startup_s: 0.0,
        wall_s: 0.0,
        env_steps: 0,
        trained_env_steps: 0,
        trained_s: 0.0,
        eval_return: None,
        confirmed_return: None,
        first_pass: None,
        how: String::new(),
        best: None,
        summarized: false,
        failure: None,
    };
    let mut learner_end: Option<String> = None;
    let mut stopped_by = "stopped";
    let mut last_eval: Option<EvalReport> = None;
    let (mut updates, mut version, mut episode_return) = (0.0, 0.0, f64::NAN);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut learner_done: Option<Instant> = None;
    // Env steps arrive an update at a time (1,024 every few seconds on
    // Atari): the rate is taken over the last `SPS_WINDOW`, not one tick.
    const SPS_WINDOW: Duration = Duration::from_secs(20);
    let mut recent_steps: std::collections::VecDeque<(Instant, u64)> = [(Instant::now(), 0)].into();
    // The stall watchdog: when an env step or an update last happened, and
    // what each service instance last reported.
    let mut last_progress = Instant::now();
    let mut last_reports = std::collections::BTreeMap::<String, (Instant, String)>::new();
    // Installed once: a `ctrl_c()` future made anew each turn of the loop
    // misses a SIGINT that arrives while the loop handles something else.
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    loop {
        tokio::select! {
            _ = interrupt.recv() => {
                println!("\nrelay: Ctrl-C; stopping the stack");
                stopped_by = "stopped by Ctrl-C";
                break;
            }
            _ = terminate.recv() => {
                println!("\nrelay: SIGTERM; stopping the stack");
                stopped_by = "stopped by SIGTERM";
                break;
            }
            Some(m) = metrics.next() => {
                if let Ok(report) = relay_proto::decode::<MetricsReport>(&m.payload) {
                    let before = (outcome.trained_env_steps, updates);
                    last_reports.insert(report.instance.clone(), (Instant::now(), report_summary(&report)));
                    if report.values.iter().any(|v| v.name == "env_steps_total" && v.value > 0.0) {
                        last_progress = Instant::now();
                    }
                    for v in &report.values {
                        match v.name.as_str() {
                            "learner_env_steps" => {
                                outcome.trained_env_steps = v.value as u64;
                                // Frozen at the solving evaluation once solved.
                                if !outcome.solved {
                                    outcome.env_steps = outcome.trained_env_steps;
                                }
                            }
                            "learner_updates" => updates = v.value,
                            "learner_policy_version" => version = v.value,
                            _ => {}
                        }
                    }
                    if (outcome.trained_env_steps, updates) != before {
                        last_progress = Instant::now();
                    }
                }
            }
            Some(m) = episodes.next() => {
                if let Ok(report) = relay_proto::decode::<relay_proto::EpisodeReport>(&m.payload) {
                    for e in report.episodes.iter().filter(|e| e.episode_return.is_finite()) {
                        if recent_returns.len() == 100 {
                            recent_returns.pop_front();
                        }
                        recent_returns.push_back(e.episode_return);
                    }
                    if !recent_returns.is_empty() {
                        episode_return = recent_returns.iter().sum::<f64>() / recent_returns.len() as f64;
                    }
                }
            }
            Some(m) = evals.next() => {
                if let Ok(report) = relay_proto::decode::<EvalReport>(&m.payload) {
                    if report.mean_return >= report.threshold && outcome.first_pass.is_none() {
                        outcome.first_pass = Some(FirstPass {
                            wall_s: ready.elapsed().as_secs_f64(),
                            env_steps: report.learner_env_steps,
                        });
                    }
                    if let Some(c) = report.confirmation.as_ref().filter(|_| !outcome.solved) {
                        println!("relay: {} version {}: eval mean {} over {} screening episodes, {} ± {} over {} fresh episodes (seed {}), threshold {}",
                            if c.passed { "solved by" } else { "not confirmed:" },
                            report.policy_version, summary::figure(report.mean_return), report.returns.len(),
                            summary::figure(c.mean_return), summary::figure(c.std_return), c.episodes, c.seed, report.threshold);
                    }
                    outcome.best = summary::BestEval::update(outcome.best, &report);
                    if report.solved && !outcome.solved {
                        outcome.solved = true;
                        outcome.wall_s = ready.elapsed().as_secs_f64();
                        outcome.env_steps = report.learner_env_steps;
                        outcome.eval_return = Some(report.mean_return);
                        outcome.confirmed_return = report.confirmation.as_ref().map(|c| c.mean_return);
                        println!("relay: solved at version {} ({} env steps, {:.1}s)",
                            report.policy_version, report.learner_env_steps, outcome.wall_s);
                        if args.until_solved {
                            stopped_by = "solved (--until-solved stopped the stack)";
                            // The learner stops on the same news and saves
                            // its checkpoints: stop the stack once it says so.
                            if learner_done.is_some() {
                                break;
                            }
                        }
                    }
                    last_eval = Some(report);
                }
            }
            Some(m) = scales.next() => {
                let reply = match relay_proto::decode::<relay_proto::ScaleRequest>(&m.payload) {
                    Ok(req) => {
                        let reply = scale::handle(stack, req).await;
                        if !args.quiet || reply.error.is_some() {
                            println!("relay: scale {}: {} copies{}", reply.service, reply.copies,
                                reply.error.as_ref().map_or(String::new(), |e| format!(" ({e})")));
                        }
                        reply
                    }
                    Err(e) => relay_proto::ScaleReply {
                        schema: relay_proto::SCHEMA_VERSION,
                        service: String::new(),
                        copies: 0,
                        instances: Vec::new(),
                        started: Vec::new(),
                        stopped: Vec::new(),
                        error: Some(format!("bad scale request: {e}")),
                    },
                };
                if let Some(to) = m.reply {
                    let _ = client.publish(to, relay_proto::encode(&reply).into()).await;
                }
            }
            Some(m) = statuses.next() => {
                if let Ok(status) = relay_proto::decode::<RunStatusUpdate>(&m.payload) {
                    if status.status == RunStatus::Failed {
                        println!("relay: {} failed: {}", status.service, status.detail);
                        outcome.failure = Some(format!("{} failed: {}", status.service, status.detail));
                        break;
                    }
                    if status.service == "learner" && matches!(status.status, RunStatus::Stopped | RunStatus::Solved) {
                        learner_done.get_or_insert_with(Instant::now);
                        println!("relay: learner finished: {:?} ({})", status.status, status.detail);
                        learner_end.get_or_insert(match status.status {
                            RunStatus::Solved => format!("solved ({})", status.detail),
                            _ => format!("stopped: {}", status.detail),
                        });
                        if args.until_solved && outcome.solved {
                            break;
                        }
                    }
                }
            }
            _ = tick.tick() => {
                let now = Instant::now();
                recent_steps.push_back((now, outcome.trained_env_steps));
                while recent_steps.len() > 2 && now - recent_steps[1].0 >= SPS_WINDOW {
                    recent_steps.pop_front();
                }
                let (since, steps_then) = recent_steps[0];
                let sps = outcome.trained_env_steps.saturating_sub(steps_then) as f64
                    / (now - since).as_secs_f64().max(1e-3);
                if !args.quiet && !outcome.summarized {
                    let eval = last_eval.as_ref().map_or("-".to_string(), |e| format!("{}@v{}{}", summary::figure(e.mean_return), e.policy_version,
                        e.confirmation.as_ref().map_or(String::new(), |c| format!(" (confirmed {})", summary::figure(c.mean_return)))));
                    // "-": no episode has finished yet.
                    let train_return = if episode_return.is_finite() { format!("{episode_return:.1}") } else { "-".into() };
                    println!(
                        "[{:>6.1}s] env_steps {:>8}  sps {:>7.0}  updates {:>5}  version {:>5}  train_return {:>7}  eval {}{}",
                        ready.elapsed().as_secs_f64(), outcome.trained_env_steps, sps, updates, version, train_return, eval,
                        threshold.map_or(String::new(), |t| format!(" / {t}")),
                    );
                }
                // A service that exits on its own cannot do its part of the
                // run, except a learner replica whose peers go on without it.
                let mut failed = None;
                for (name, status) in stack.exited() {
                    let log = stack.state_dir.join("logs").join(format!("{name}.log"));
                    let why = last_error_line(&log).unwrap_or_else(|| format!("see {}", log.display()));
                    let learners = stack.copies_of("learner").len();
                    if stack::service_of(&name) == "learner" && learners > 1 {
                        println!("relay: learner replica {name} exited with {status}: {why}; {} learner replicas go on", learners - 1);
                        stack.kill_service(&name)?;
                        continue;
                    }
                    println!("relay: {name} exited with {status}: {why}");
                    failed = Some(format!("{name} exited with {status}: {why}"));
                    break;
                }
                if let Some(failure) = failed {
                    outcome.failure = Some(failure);
                    break;
                }
                let stalled = last_progress.elapsed();
                if args.stall_timeout > 0 && learner_done.is_none() && stalled >= Duration::from_secs(args.stall_timeout) {
                    let instances: Vec<String> = stack.services.iter().map(|p| p.name.clone()).collect();
                    let failure = stall_report(stalled, &last_reports, &instances);
                    println!("relay: {failure}");
                    outcome.failure = Some(failure);
                    break;
                }
                if args.for_seconds.is_some_and(|limit| ready.elapsed() >= Duration::from_secs(limit)) {
                    stopped_by = "stopped (--for-seconds)";
                    break;
                }
                if args.stop.as_ref().is_some_and(StopFlag::is_set) {
                    break;
                }
                // The learner has stopped training: give the eval of its last version time to arrive.
                // By env steps: a text evaluation reports the version its games were
                // served with, which can trail the one it was started for.
                let final_evaluated = last_eval.as_ref().is_some_and(|e| e.learner_env_steps >= outcome.trained_env_steps);
                let wait = Duration::from_secs(args.final_eval_wait);
                let training_over = learner_done.is_some_and(|t| final_evaluated || t.elapsed() > wait);
                // Solved, and the learner did not stop within the wait
                // (`run.stop_when_solved: false`).
                let solved_long_ago = outcome.solved && ready.elapsed().as_secs_f64() > outcome.wall_s + wait.as_secs_f64();
                if args.until_solved && (training_over || solved_long_ago) {
                    break;
                }
                // The stack stays up: the summary once the tracker has drawn
                // the plots of the finished run (or a few seconds on).
                let plots_drawn = || {
                    let drawn = std::fs::metadata(run_dir.join("plots").join("return.png")).and_then(|m| m.modified());
                    // When the learner finished, by the clock files are dated with.
                    let done = learner_done.and_then(|t| std::time::SystemTime::now().checked_sub(t.elapsed()));
                    matches!((drawn, done), (Ok(drawn), Some(done)) if drawn >= done)
                };
                if training_over && !outcome.summarized
                    && (plots_drawn() || learner_done.is_some_and(|t| t.elapsed() > wait + Duration::from_secs(5)))
                {
                    outcome.summarized = true;
                    outcome.how = learner_end.clone().unwrap_or_default();
                    let end = learner_done.unwrap_or_else(Instant::now);
                    outcome.trained_s = end.duration_since(ready).as_secs_f64();
                    if !outcome.solved {
                        outcome.wall_s = outcome.trained_s;
                    }
                    println!("{}", run_end(stack, &outcome, run_dir.to_path_buf()).render());
                    println!("relay: training is over; the stack stays up for inspection (relay top, Prometheus, Grafana, relay eval switch); Ctrl-C stops it");
                }
            }
        }
    }
    if let Some(failure) = &outcome.failure {
        outcome.how = format!("failed: {failure}");
    }
    if outcome.how.is_empty() {
        outcome.how = learner_end.unwrap_or_else(|| stopped_by.to_string());
    }
    // Until training ended, not until the supervisor stopped watching.
    let end = learner_done.unwrap_or_else(Instant::now);
    outcome.trained_s = end.duration_since(ready).as_secs_f64();
    if !outcome.solved {
        outcome.wall_s = outcome.trained_s;
        outcome.eval_return = last_eval.map(|e| e.mean_return);
    }
    Ok(outcome)
}
