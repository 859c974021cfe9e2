//! `relay`: the command line of the relay trainer.
//!
//! - `relay up`: start the local stack (NATS, Redis, Prometheus, every
//!   service) and train a config, with a progress display;
//! - `relay down`: stop a stack left running;
//! - `relay scale <service>=<n>...`: change the copies of a running stack's services;
//! - `relay bench-scale`: env steps per second for several env-runner and inference-server counts;
//! - `relay bench-solve`: time the stack solving an env for several seeds;
//! - `relay runs ls|repair`: the run registry `runs/runs.json`;
//! - `relay plot <run|@last>`: a run's learning curves as PNG files;
//! - `relay checkpoints ls|pin <run|@last>`: a run's checkpoints;
//! - `relay eval use <name>`: switch the running evaluators' plugin;
//!   `relay eval checkpoint <run>[:which]`: play a saved checkpoint offline;
//! - `relay chaos`: fault injection (kill and restart every process) during a run;
//! - `relay play <run|@last>`: an episode of a checkpoint's policy as text;
//! - `relay model init tiny`: write a tiny random Qwen2 model folder;
//! - `relay bench-generate`: LLM generation throughput and latency per batch size;
//! - `relay bench-league`: TicTacToe by self-play against past versions, with
//!   the TrueSkill ratings of every version over time.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};

use relay::{bench_solve, up, UpArgs};

#[derive(Parser)]
#[command(
    name = "relay",
    version,
    about = "Distributed reinforcement learning over NATS and Redis"
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
    /// Env steps per second with 1, 2, 4 env-runners and 1, 2 inference servers; print a table and JSON.
    BenchScale(relay::scale::BenchScaleArgs),
    /// Train for a while with many copies and report each process's memory at start and end.
    Soak {
        #[command(flatten)]
        up: UpArgs,
        /// How long to train.
        #[arg(long, default_value_t = 10.0)]
        minutes: f64,
    },
    /// Training SPS with and without the tracker; print a table and JSON.
    BenchTracker {
        #[command(flatten)]
        up: UpArgs,
        /// Runs of each kind.
        #[arg(long, default_value_t = 3)]
        rounds: u64,
        /// Env-step budget of each run.
        #[arg(long, default_value_t = 60_000)]
        env_steps: u64,
    },
    /// Run the stack on a config for several seeds, each until solved; print a table and JSON.
    BenchSolve {
        #[command(flatten)]
        up: UpArgs,
        /// Number of seeds (1, 2, ...).
        #[arg(long, default_value_t = 3)]
        seeds: u64,
    },
    /// Classic learners against their goals (PPO Acrobot, DQN CartPole and
    /// MountainCar, SAC Pendulum, A2C CartPole) for several seeds; print a table and JSON.
    BenchLearning {
        #[command(flatten)]
        up: UpArgs,
        #[command(flatten)]
        bench: relay::bench_learning::BenchLearningArgs,
    },
    /// Hyperparameter search: one run per trial (grid or random), hopeless
    /// trials stopped by the median rule; print a ranked table and JSON.
    Sweep {
        #[command(flatten)]
        up: UpArgs,
        #[command(flatten)]
        sweep: relay::sweep::SweepArgs,
    },
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
    /// Kill each service, NATS and Redis in turn during a CartPole run, restart
    /// them, measure recovery, then train until solved; print a table and JSON.
    Chaos(UpArgs),
    /// Play episodes with a checkpoint's policy and print them as text frames.
    Play(relay::play::PlayArgs),
    /// LLM model folders: `model init tiny [--out DIR] [--seed N]`.
    Model(relay::model::ModelArgs),
    /// Supervised warm start of a text-game policy: learn moves from bot games or a JSONL file.
    Sft(relay::sft::SftArgs),
    /// The tiny model from scratch: SFT on random legal moves, then RL against the random bot; legal-move and win rates over time.
    BenchTictactoe(relay::bench_tictactoe::BenchTicTacToeArgs),
    /// SmolLM2-135M-Instruct with a LoRA adapter learns TicTacToe against the random bot for a fixed number of RL updates; tokens/s, games/min, legal-move and win rates at start and end.
    #[command(name = "bench-smollm2")]
    BenchSmolLm2(relay::bench_smollm2::BenchSmolLm2Args),
    /// TicTacToe by self-play against past versions: SFT warm start, then league training; TrueSkill ratings of every version over time and the newest one's results against random and minimax.
    BenchLeague(relay::bench_league::BenchLeagueArgs),
    /// Generation tokens/s and request latency of the inference server for
    /// several models and batch sizes; print a table and JSON.
    BenchGenerate(relay::bench_generate::BenchGenerateArgs),
    /// SmolLM2-135M generation tokens/s at B = 1, 8, 32, 64 on the CPU engine, the candle backend on the CPU and, in a `cuda` build with a GPU, on cuda:0 in bf16; LoRA training tokens/s and adapter load time; a table and JSON.
    BenchGpu(relay::bench_gpu::BenchGpuArgs),
    /// Env steps/s of Gymnasium's CartPole through relay's env bridge against Gymnasium's own SyncVectorEnv (and relay's built-in CartPole); print a table and JSON.
    BenchBridge(relay::bench_bridge::BenchBridgeArgs),
    /// Raw env steps/s on one core of relay's built-in envs against Gymnasium's SyncVectorEnv and EnvPool; print a table and JSON.
    BenchEnvs(relay::bench_envs::BenchEnvsArgs),
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
        Command::BenchScale(args) => relay::scale::bench_scale(args),
        Command::Soak { up, minutes } => relay::soak(up, minutes),
        Command::BenchTracker {
            up,
            rounds,
            env_steps,
        } => relay::bench_tracker(up, rounds, env_steps),
        Command::BenchSolve { up, seeds } => bench_solve(up, seeds),
        Command::Sweep { up, sweep } => relay::sweep::sweep(up, sweep),
        Command::BenchLearning { up, bench } => relay::bench_learning::bench_learning(up, bench),
        Command::Runs(args) => relay::runs::runs(args),
        Command::Plot(args) => relay::runs::plot(args),
        Command::Top(args) => relay::top::run(args),
        Command::Checkpoints(args) => relay::checkpoints::checkpoints(args),
        Command::Eval(args) => relay::eval::eval(args),
        Command::Chaos(args) => relay::chaos::chaos(args),
        Command::Play(args) => relay::play::play(args),
        Command::Model(args) => relay::model::model(args),
        Command::Sft(args) => relay::sft::sft(args),
        Command::BenchBridge(args) => relay::bench_bridge::bench_bridge(args),
        Command::BenchEnvs(args) => relay::bench_envs::bench_envs(args),
        Command::BenchTictactoe(args) => relay::bench_tictactoe::bench_tictactoe(args),
        Command::BenchSmolLm2(args) => relay::bench_smollm2::bench_smollm2(args),
        Command::BenchLeague(args) => relay::bench_league::bench_league(args),
        Command::BenchGenerate(args) => relay::bench_generate::bench_generate(args),
        Command::BenchGpu(args) => relay::bench_gpu::bench_gpu(args),
    }
}

fn tracing_subscriber_init() {
    // The command line prints its own progress; its logs are for problems.
    let _ = relay_kit::telemetry::init_with_default("warn");
}
