//! `relay-bench`: relay's benchmarks, fault injection, memory soak and
//! sweeps. Each prints a table and a last JSON line; `relay <subcommand>`
//! runs the same thing through this binary.

use anyhow::Result;
use clap::{Parser, Subcommand};

use relay::UpArgs;

#[derive(Parser)]
#[command(
    name = "relay-bench",
    version,
    about = "relay's benchmarks, chaos, soak and sweeps"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Env steps per second with 1, 2, 4 env-runners and 1, 2 inference servers; print a table and JSON.
    BenchScale(relay_bench::bench_scale::BenchScaleArgs),
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
        bench: relay_bench::bench_learning::BenchLearningArgs,
    },
    /// relay's learning curves beside Stable-Baselines3's at equal env steps
    /// (rl-zoo's hyperparameters, checkpoints evaluated on fresh episodes,
    /// IQM and bootstrap intervals over seeds); print a table, plots and JSON.
    BenchParity {
        #[command(flatten)]
        up: UpArgs,
        #[command(flatten)]
        bench: relay_bench::bench_parity::BenchParityArgs,
    },
    /// Hyperparameter search: one run per trial (grid or random), hopeless
    /// trials stopped by the median rule; print a ranked table and JSON.
    Sweep {
        #[command(flatten)]
        up: UpArgs,
        #[command(flatten)]
        sweep: relay_bench::sweep::SweepArgs,
    },
    /// Kill each service, NATS and Redis in turn during a CartPole run, restart
    /// them, measure recovery, then train until solved; print a table and JSON.
    Chaos(UpArgs),
    /// The tiny model from scratch: SFT on random legal moves, then RL against the random bot; legal-move and win rates over time.
    BenchTictactoe(relay_bench::bench_tictactoe::BenchTicTacToeArgs),
    /// SmolLM2-135M-Instruct with a LoRA adapter learns TicTacToe against the random bot for a fixed number of RL updates; tokens/s, games/min, legal-move and win rates at start and end.
    #[command(name = "bench-smollm2")]
    BenchSmolLm2(relay_bench::bench_smollm2::BenchSmolLm2Args),
    /// TicTacToe by self-play against past versions: SFT warm start, then league training; TrueSkill ratings of every version over time and the newest one's results against random and minimax.
    BenchLeague(relay_bench::bench_league::BenchLeagueArgs),
    /// Generation tokens/s and request latency of the inference server for
    /// several models and batch sizes; print a table and JSON.
    BenchGenerate(relay_bench::bench_generate::BenchGenerateArgs),
    /// SmolLM2-135M generation tokens/s at B = 1, 8, 32, 64 on the CPU engine, the candle backend on the CPU and, in a `cuda` build with a GPU, on cuda:0 in bf16; LoRA training tokens/s and adapter load time; a table and JSON.
    BenchGpu(relay_bench::bench_gpu::BenchGpuArgs),
    /// One PPO train step of NatureCNN (Atari's CnnPolicy) at batch 256 on a device (`cuda`, `cpu`, or `composed-cpu`: the GPU's code path on the CPU), checked against the fused CPU step and timed; a table and JSON.
    BenchCnnStep(relay_bench::bench_cnn_step::BenchCnnStepArgs),
    /// The learner replicas' ring all-reduce: time and bus bandwidth for 10 KB to 100 MB of gradients with 2 and 4 members joined through nats-server; a table and JSON.
    BenchAllreduce(relay_bench::bench_allreduce::BenchAllreduceArgs),
    /// Learner throughput with 1 and 2 data-parallel replicas (each a process of one thread, joined through nats-server) on the Atari NatureCNN PPO preset: samples/s, speedup, all-reduce time per update; a table and JSON.
    BenchLearners(relay_bench::bench_learners::BenchLearnersArgs),
    /// A checkpoint of a real model's size as the Hub holds it (by default a random Qwen3-1.7B-Base written by transformers, bf16 shards): load time, resident memory and generation tokens/s at B = 1 and 8 on the CPU engine; a table and JSON.
    BenchHubModel(relay_bench::bench_hub_model::BenchHubModelArgs),
    /// relay's CPU engine against llama.cpp (llama-cpp-python) on the same SmolLM2-135M-Instruct GGUF and threads: prompt tokens/s of a 200-token prompt and generation tokens/s at B = 1, side by side with ratios; a table and JSON.
    #[command(name = "bench-llamacpp")]
    BenchLlamaCpp(relay_bench::bench_llamacpp::BenchLlamaCppArgs),
    /// Env steps/s of Gymnasium's CartPole through relay's env bridge against Gymnasium's own SyncVectorEnv (and relay's built-in CartPole); print a table and JSON.
    BenchBridge(relay_bench::bench_bridge::BenchBridgeArgs),
    /// Raw env steps/s on one core of relay's built-in envs against Gymnasium's SyncVectorEnv and EnvPool; print a table and JSON.
    BenchEnvs(relay_bench::bench_envs::BenchEnvsArgs),
    /// Publish-to-serving latency and MB/s of weights versions (a classic policy, a LoRA adapter, a full model through the object store) for 1, 2 and 4 inference servers; print a table and JSON.
    BenchWeights(relay_bench::bench_weights::BenchWeightsArgs),
}

fn main() -> Result<()> {
    // The benchmarks run models in this process too.
    relay_kit::service::keep_freed_memory();
    relay_kit::service::calm_candle_pool();
    // The benchmarks print their own tables; logs are for problems.
    let _ = relay_kit::telemetry::init_with_default("warn");
    let cli = Cli::parse();
    match cli.command {
        Command::BenchScale(args) => relay_bench::bench_scale::bench_scale(args),
        Command::Soak { up, minutes } => relay_bench::soak::soak(up, minutes),
        Command::BenchTracker {
            up,
            rounds,
            env_steps,
        } => relay_bench::bench_tracker::bench_tracker(up, rounds, env_steps),
        Command::BenchSolve { up, seeds } => relay_bench::bench_solve::bench_solve(up, seeds),
        Command::Sweep { up, sweep } => relay_bench::sweep::sweep(up, sweep),
        Command::BenchLearning { up, bench } => {
            relay_bench::bench_learning::bench_learning(up, bench)
        }
        Command::BenchParity { up, bench } => relay_bench::bench_parity::bench_parity(up, bench),
        Command::Chaos(args) => relay_bench::chaos::chaos(args),
        Command::BenchBridge(args) => relay_bench::bench_bridge::bench_bridge(args),
        Command::BenchEnvs(args) => relay_bench::bench_envs::bench_envs(args),
        Command::BenchTictactoe(args) => relay_bench::bench_tictactoe::bench_tictactoe(args),
        Command::BenchSmolLm2(args) => relay_bench::bench_smollm2::bench_smollm2(args),
        Command::BenchLeague(args) => relay_bench::bench_league::bench_league(args),
        Command::BenchGenerate(args) => relay_bench::bench_generate::bench_generate(args),
        Command::BenchGpu(args) => relay_bench::bench_gpu::bench_gpu(args),
        Command::BenchCnnStep(args) => relay_bench::bench_cnn_step::bench_cnn_step(args),
        Command::BenchAllreduce(args) => relay_bench::bench_allreduce::bench_allreduce(args),
        Command::BenchLearners(args) => relay_bench::bench_learners::bench_learners(args),
        Command::BenchHubModel(args) => relay_bench::bench_hub_model::bench_hub_model(args),
        Command::BenchLlamaCpp(args) => relay_bench::bench_llamacpp::bench_llamacpp(args),
        Command::BenchWeights(args) => relay_bench::bench_weights::bench_weights(args),
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn relay_forwards_exactly_these_subcommands() {
        let mut ours: Vec<String> = super::Cli::command()
            .get_subcommands()
            .map(|c| c.get_name().to_string())
            .collect();
        let mut forwarded: Vec<String> = relay::BENCH_COMMANDS.map(String::from).to_vec();
        ours.sort();
        forwarded.sort();
        assert_eq!(ours, forwarded);
    }
}
