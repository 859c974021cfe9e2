//! `relay`: the command line of the relay trainer.
//!
//! - `relay up`: start the local stack (NATS, Redis, Prometheus, every
//!   service) and train a config, with a progress display;
//! - `relay down`: stop a stack left running;
//! - `relay scale <service>=<n>...`: change the copies of a running stack's services;
//! - `relay runs ls|repair`: the run registry `runs/runs.json`;
//! - `relay plot <run|@last>`: a run's learning curves as PNG files;
//! - `relay checkpoints ls|pin <run|@last>`: a run's checkpoints;
//! - `relay eval use <name>`: switch the running evaluators' plugin;
//!   `relay eval checkpoint <run>[:which]`: play a saved checkpoint offline;
//! - `relay play <run|@last>`: an episode of a checkpoint's policy as text;
//! - `relay games <run|@last>`: a text run's training and evaluation games,
//!   as the tracker wrote them to `games.jsonl`;
//! - `relay model init tiny`: write a tiny random Qwen2 model folder;
//! - `relay bench-*`, `relay chaos`, `relay soak`, `relay sweep`: run by
//!   `relay-bench` (see its `--help`).

use std::ffi::OsString;
use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};

use relay::{up, UpArgs};

#[derive(Parser)]
#[command(
    name = "relay",
    version,
    about = "Distributed reinforcement learning over NATS and Redis",
    after_help = "Benchmarks, fault injection, soak and sweeps (`relay bench-learning`, `relay chaos`, ...) \
                  run through the relay-bench binary beside this one: `relay-bench --help` lists them."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start the local stack and train a config (`relay train` is the same).
    #[command(alias = "train")]
    Up(UpArgs),
    /// Stop a local stack left running.
    Down {
        /// Folder holding the stack's state.
        #[arg(long, default_value = ".relay")]
        state_dir: PathBuf,
    },
    /// Change the number of copies of services in a running `relay up` stack:
    /// `relay scale env-runner=3 inference-server=2`.
    Scale(relay::scale::ScaleArgs),
    /// The run registry: `runs ls` lists the runs, newest first; `runs repair` rebuilds it.
    Runs(relay::runs::RunsArgs),
    /// Draw a run's learning curves (return, losses, SPS) into runs/<id>/plots/*.png.
    Plot(relay::runs::PlotArgs),
    /// A live terminal overview of a run: progress, SPS, eval, losses, services, alerts.
    Top(relay::top::TopArgs),
    /// A run's checkpoints: `checkpoints ls <run>`, `checkpoints pin <run> <n>`.
    Checkpoints(relay::checkpoints::CheckpointsArgs),
    /// Switch the running evaluators (`eval use <name> [--set key=value]...`), or play a
    /// checkpoint offline (`eval checkpoint <run>[:best|last|solved|N] [--episodes 100] [--seed S]`).
    Eval(relay::eval::EvalArgs),
    /// Play episodes with a checkpoint's policy and print them as text frames.
    Play(relay::play::PlayArgs),
    /// A text run's games (runs/<id>/games.jsonl) for reading: what each player saw, the model's
    /// reply and the move; `--version N`, `--opponent NAME`, `--eval|--train`, `--last K`, `--full`.
    Games(relay::games::GamesArgs),
    /// LLM model folders: `model init tiny [--out DIR] [--seed N]`.
    Model(relay::model::ModelArgs),
    /// Supervised warm start of a text-game policy: learn moves from bot games or a JSONL file.
    Sft(relay::sft::SftArgs),
    /// The benchmarks, `chaos`, `soak` and `sweep`: run by the `relay-bench`
    /// binary beside this one (`relay-bench --help` lists them).
    #[command(external_subcommand)]
    Bench(Vec<OsString>),
}

fn main() -> Result<()> {
    // `relay sft`, `play` and the benchmarks run models in this process too.
    relay_kit::service::keep_freed_memory();
    relay_kit::service::calm_candle_pool();
    tracing_subscriber_init();
    let cli = Cli::parse();
    match cli.command {
        Command::Up(args) => up(args).map(|_| ()),
        Command::Down { state_dir } => relay::stack::down(&state_dir),
        Command::Scale(args) => relay::scale::scale(args),
        Command::Runs(args) => relay::runs::runs(args),
        Command::Plot(args) => relay::runs::plot(args),
        Command::Top(args) => relay::top::run(args),
        Command::Checkpoints(args) => relay::checkpoints::checkpoints(args),
        Command::Eval(args) => relay::eval::eval(args),
        Command::Play(args) => relay::play::play(args),
        Command::Games(args) => relay::games::games(args),
        Command::Model(args) => relay::model::model(args),
        Command::Sft(args) => relay::sft::sft(args),
        Command::Bench(args) => bench(args),
    }
}

/// Runs `relay-bench` (found beside this binary) with the subcommand and
/// its arguments: `relay bench-learning ...` is `relay-bench bench-learning ...`.
fn bench(args: Vec<OsString>) -> Result<()> {
    let name = args.first().map(|a| a.to_string_lossy().into_owned());
    if !name
        .as_deref()
        .is_some_and(|n| relay::BENCH_COMMANDS.contains(&n))
    {
        anyhow::bail!(
            "unknown command {:?}; see `relay --help` (benchmarks: {})",
            name.unwrap_or_default(),
            relay::BENCH_COMMANDS.join(", ")
        );
    }
    let bin = relay::stack::sibling_binary("relay-bench")?;
    let status = std::process::Command::new(&bin).args(&args).status()?;
    std::process::exit(status.code().unwrap_or(1));
}

fn tracing_subscriber_init() {
    // The command line prints its own progress; its logs are for problems.
    let _ = relay_kit::telemetry::init_with_default("warn");
}
