//! `relay up`: starts the local stack, watches the run train and stops the
//! stack cleanly; its flags ([`UpArgs`]) and how the run ended
//! ([`Outcome`]).
//!
//! This file: the flags, the checks that refuse a run before anything
//! starts, and starting the stack ([`up`]). [`watch`]: following the run
//! over NATS while it trains, until it ends. The stack itself (processes,
//! ports, the record `relay down` reads) is [`crate::stack`]'s.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use relay_config::ExperimentConfig;

use crate::stack::{self, Copies, Stack, SERVICES};
use crate::{checkpoints, scale, summary};

mod watch;

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
///
/// In order: what the run starts from (`start_from`), the checks that
/// refuse a run before anything starts (`check_env`, `check_evaluator`),
/// the stack's infrastructure and then its services (`start_services`),
/// the run watched until it ends (`train`).
pub fn up(mut args: UpArgs) -> Result<Outcome> {
    let (mut overrides, resumed_id) = start_from(&mut args)?;
    let mut config = ExperimentConfig::load(&args.config, &overrides)?;
    let messages = check_env(&args, &mut overrides, &mut config)?;
    check_evaluator(&config)?;
    if args.without.iter().any(|s| s == "evaluator") {
        println!("relay: the evaluator is not started here (--without evaluator): no evaluation unless one runs elsewhere");
    }
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
    let mut stack = Stack::start_infra(&state_dir, &run_id, &external, messages.nats_max_payload)?;
    println!(
        "relay: run {run_id}  nats {}  redis {}  prometheus {}",
        stack.nats_url,
        stack.redis_url,
        stack.prometheus_url.as_deref().unwrap_or("(not installed)")
    );
    if let Some(largest) = messages.largest {
        report_message_limit(&stack, &external, largest, messages.nats_max_payload)?;
    }
    if let Some(unknown) = args
        .without
        .iter()
        .find(|w| !SERVICES.contains(&w.as_str()))
    {
        bail!("--without {unknown}: not a service; the services are {SERVICES:?}");
    }
    if let Err(e) = start_services(&mut stack, &args.without, &copies, &config_path, &overrides) {
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
    let mut outcome = train(&mut stack, &run_id, &config, &args)?;
    outcome.startup_s = startup_s;
    Ok(outcome)
}

/// What the run starts from, as overrides of the config: `--resume` (the
/// run's own config, copied into the state folder, and its checkpoint;
/// `args.config` then names that copy), `--init-from` (the weights of
/// another run's checkpoint) and `--reset-optimizer`. With the resumed
/// run's id.
fn start_from(args: &mut UpArgs) -> Result<(Vec<String>, Option<String>)> {
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
    Ok((overrides, resumed_id))
}

/// The sizes of the run's messages ([`check_env`]).
struct MessageSizes {
    /// What relay's own nats-server carries: the largest message of the run.
    nats_max_payload: usize,
    /// The run's largest message, known for an env (not for text games).
    largest: Option<usize>,
}

/// Makes the run's env (or each text game) once, so that an unknown id, a
/// missing package, a policy that does not fit the observations or
/// observations too large to send are reported before any service starts,
/// saying where the env was found. A parallel game's `num_envs` is
/// rounded up to whole games (an override, and `config` loaded again).
fn check_env(
    args: &UpArgs,
    overrides: &mut Vec<String>,
    config: &mut ExperimentConfig,
) -> Result<MessageSizes> {
    let mut sizes = MessageSizes {
        nats_max_payload: relay_proto::DEFAULT_MAX_PAYLOAD,
        largest: None,
    };
    if !config.is_text_game() {
        let spec = config.env_spec().context("run.env_id")?;
        // First: where the id was found (what `env.backend: auto` picked).
        println!("relay: {} {}", config.run.env_id, env_source(config, &spec));
        if let Some(whole) = whole_games(config, &spec) {
            println!(
                "relay: {} has {} agents sharing one policy, each one env of a runner's vector: env_runner.num_envs {} -> {whole} ({} game(s) a runner)",
                spec.id,
                spec.team.len(),
                config.env_runner.num_envs,
                whole / spec.team.len()
            );
            overrides.push(format!("env_runner.num_envs={whole}"));
            *config = ExperimentConfig::load(&args.config, overrides)?;
        }
        config.check_env(&spec)?;
        if let Some(cnn) = config
            .policy_cnn(&spec)
            .filter(|_| config.policy.cnn.is_none())
        {
            println!("relay: {}", chosen_cnn(&cnn));
        }
        if let Some(ratio) = config.replay_ratio_summary() {
            println!("relay: {ratio}");
        }
        sizes.nats_max_payload = config.nats_max_payload(&spec);
        sizes.largest = Some(config.largest_message_bytes(&spec));
    } else if config.env.text_uses_python() {
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
    Ok(sizes)
}

/// Which evaluation the run gets, said; a plugin that cannot evaluate this
/// run is refused before any service starts.
fn check_evaluator(config: &ExperimentConfig) -> Result<()> {
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
        evaluator.describe(config)
    );
    Ok(())
}

/// Starts the services but those `without`, `copies` of each scalable one,
/// and waits until all are healthy: the tracker first (it must hear the
/// others' first log lines), the learner last (training starts once
/// everything else listens).
fn start_services(
    stack: &mut Stack,
    without: &[String],
    copies: &Copies,
    config_path: &Path,
    overrides: &[String],
) -> Result<()> {
    for service in SERVICES {
        let n = match service {
            _ if without.iter().any(|w| w == service) => 0,
            "env-runner" => copies.env_runners,
            "inference-server" => copies.inference_servers,
            "learner" => copies.learners,
            _ => 1,
        };
        for _ in 0..n {
            stack.spawn_service(service, config_path, overrides)?;
        }
        if matches!(service, "tracker" | "env-runner") {
            stack.wait_healthy(Duration::from_secs(60))?;
        }
    }
    stack.wait_healthy(Duration::from_secs(60))
}

/// Watches the run ([`watch::watch`]) until it ends, stops the stack and
/// prints the run's summary (unless printed while the stack stayed up);
/// a failed run is an error.
fn train(
    stack: &mut Stack,
    run_id: &str,
    config: &ExperimentConfig,
    args: &UpArgs,
) -> Result<Outcome> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let threshold = config.solved_threshold();
    let run_dir = config.run.runs_dir.join(run_id);
    let outcome = runtime.block_on(watch::watch(stack, run_id, threshold, &run_dir, args));
    stack.stop(Duration::from_secs(15));
    let outcome = outcome?;
    println!("relay: stack stopped");
    if !outcome.summarized {
        // After the stop: the tracker has drawn the plots.
        println!("{}", run_end(stack, &outcome, run_dir).render());
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

/// What `relay up` says of the CNN it chose for image observations when
/// the config names none.
fn chosen_cnn(cnn: &relay_config::hyper::policy::CnnSpec) -> String {
    let body = match &cnn.arch {
        relay_config::hyper::policy::CnnArch::Nature { conv } => conv
            .iter()
            .map(|c| format!("{} {k}x{k}/{}", c.channels, c.stride, k = c.kernel))
            .collect::<Vec<_>>()
            .join(", "),
        relay_config::hyper::policy::CnnArch::Impala { channels, blocks } => {
            format!("IMPALA stacks {channels:?}, {blocks} blocks each")
        }
    };
    let [c, h, w] = cnn.input;
    format!(
        "policy: a CNN for the {c}x{h}x{w} images ({body}, dense {}), chosen by their size; `policy.cnn` sets another",
        cnn.features_dim
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
