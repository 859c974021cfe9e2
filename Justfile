# relay's commands. Every recipe installs what is missing first.

set shell := ["bash", "-euo", "pipefail", "-c"]

release := "target/release"

default:
    @just --list

# Install nats-server, redis-server, prometheus (and just) where missing.
install:
    bash deploy/install.sh

# Start the whole stack and train a config (default: configs/cartpole-ppo.yaml). Ctrl-C stops it.
# Flags: --until-solved, --config FILE, --set key=value, --env-runners N, --inference-servers N.
up *ARGS: install
    cargo build --release --workspace --bins
    {{release}}/relay up {{ARGS}}

# Stop a stack left running.
down:
    {{release}}/relay down

# The release binaries with the `cuda` feature (candle on NVIDIA GPUs through cudarc), into target/cuda/release/ (the CPU build's caches stay). Builds without a GPU: installs a CUDA compiler from PyPI where none is installed (deploy/install.sh --cuda; deploy/cuda-env.sh sets CUDA_COMPUTE_CAP and the CUDA version); running them needs the NVIDIA driver. Serve on a GPU with `--set llm.device=cuda --set llm.dtype=bf16`.
build-cuda: install
    bash deploy/install.sh --cuda
    source deploy/cuda-env.sh && cargo build --release --workspace --bins --features cuda --target-dir target/cuda

# SmolLM2-135M generation tokens/s at B = 1, 8, 32, 64 on the CPU engine, the candle backend on the CPU and, with an NVIDIA GPU (the `cuda` build), on cuda:0 in bf16; LoRA training tokens/s and adapter load time: table + JSON line. Without a GPU it says so and measures the CPU backends.
bench-gpu *ARGS: install
    if nvidia-smi -L >/dev/null 2>&1; then just build-cuda && target/cuda/release/relay-bench bench-gpu {{ARGS}}; else cargo build --release --workspace --bins && {{release}}/relay-bench bench-gpu {{ARGS}}; fi

# Type-check every crate and target with the `cuda` feature (what CI runs, so the CUDA path cannot rot); its own target folder keeps the CPU build's caches.
check-cuda: install
    bash deploy/install.sh --cuda
    source deploy/cuda-env.sh && cargo check --workspace --all-targets --features cuda --target-dir target/cuda

# Run every test (unit, fixtures, services against real NATS/Redis, end-to-end).
test: install
    cargo build --workspace --bins
    cargo test --workspace --no-fail-fast

# fmt and clippy, as CI checks them.
lint:
    cargo fmt --all -- --check
    cargo clippy --workspace --all-targets -- -D warnings

# Classic learners against their goals (PPO Acrobot-v1 >= -80 in 500k, DQN CartPole-v1 solved in 100k, DQN MountainCar-v0 >= -110 in 300k, SAC Pendulum-v1 >= -200 in 30k, A2C CartPole-v1 solved in 500k; through the env bridge PPO LunarLander-v3 >= 200 in 1M, PPO Taxi-v4 >= 7.5 in 1M), 3 seeds each: table + JSON line.
bench-learning *ARGS: install
    cargo build --release --workspace --bins
    {{release}}/relay-bench bench-learning {{ARGS}}

# Full stack on CartPole-v1 for 3 seeds, each until solved: table + JSON line.
bench-solve *ARGS: install
    cargo build --release --workspace --bins
    {{release}}/relay-bench bench-solve --seeds 3 {{ARGS}}

# Env steps/s with 1, 2, 4 env-runners x 1, 2 inference servers (one stack per config, scaled with `relay scale`), CPU per env step by process: tables + JSON line.
bench-scale *ARGS: install
    cargo build --release --workspace --bins
    {{release}}/relay-bench bench-scale {{ARGS}}

# Kill every service, restart Redis and NATS during a CartPole run, measure recovery, then solve: table + JSON line.
chaos *ARGS: install
    cargo build --release --workspace --bins
    {{release}}/relay-bench chaos {{ARGS}}

# The tiny model from scratch: SFT on random legal moves, then RL (configs/tictactoe-grpo.yaml: Dr. GRPO, compact observation, branched games) against the random bot with all six services: legal-move and non-loss rates against random and minimax over time, a table and a JSON line.
bench-tictactoe *ARGS: install
    cargo build --release --workspace --bins
    {{release}}/relay-bench bench-tictactoe {{ARGS}}

# SmolLM2-135M-Instruct learns TicTacToe against the random bot from both seats (--seed 1; run again with --seed 2): a LoRA SFT warm start on random legal moves, then 60 minutes of GRPO with LoRA; greedy evaluation games every 10 minutes (200 at the start and the end, 50 between): legal-move, win and non-loss rates, games/min and learner tokens/s; then the saved best checkpoint and the SFT start replayed on 200 fresh games each; whether non-loss rose 15 points in both; tables and a JSON line.
bench-smollm2 *ARGS: install
    cargo build --release --workspace --bins
    {{release}}/relay-bench bench-smollm2 {{ARGS}}

# TicTacToe by self-play: the warm start of bench-tictactoe, then 3 seeds of 15 minutes of league training against past versions and the random bot (configs/tictactoe-league.yaml): TrueSkill mu/sigma of each version over time, the first version against the newest (mu +/- 2 sigma), each seed's evaluations against random and minimax, tables and a JSON line.
bench-league *ARGS: install
    cargo build --release --workspace --bins
    {{release}}/relay-bench bench-league {{ARGS}}

# Env steps/s of Gymnasium's CartPole-v1 through the env bridge vs Gymnasium's own SyncVectorEnv (1, 8, 64 envs; medians of 9 alternating rounds) and relay's built-in CartPole: table + JSON line.
bench-bridge *ARGS: install
    cargo build --release --workspace --bins
    {{release}}/relay-bench bench-bridge {{ARGS}}

# Raw env steps/s on one core: relay's built-in envs (VecEnv, 1 and 16 envs) against Gymnasium's SyncVectorEnv and EnvPool (installed into .relay/envpool on first use): table + JSON line.
bench-envs *ARGS: install
    bash deploy/install.sh --envpool
    cargo build --release --workspace --bins
    {{release}}/relay-bench bench-envs {{ARGS}}

# Publish-to-serving latency and MB/s of weights versions (classic policy, LoRA adapter over SmolLM2-135M, a 135M full model from the publisher's direct transfer server and through the object store) for 1, 2 and 4 inference servers: table + JSON line.
bench-weights *ARGS: install
    cargo build --release --workspace --bins
    {{release}}/relay-bench bench-weights {{ARGS}}

# Model and optimizer micro-benchmarks (act latency, PPO train step).
bench-nn:
    cargo bench -p relay-nn

# Fuzz every wire message decoder (100,000 cases per type): table + JSON line.
bench-fuzz:
    cargo bench -p relay-proto --bench fuzz

# Tracker overhead: CartPole training SPS with the tracker on and off (metrics dropped).
bench-tracker *ARGS: install
    cargo build --release --workspace --bins
    {{release}}/relay-bench bench-tracker {{ARGS}}

# Memory soak: 8 env-runners training CartPole for 10 minutes; RSS of every process after warm-up and at the end.
soak *ARGS: install
    cargo build --release --workspace --bins
    {{release}}/relay-bench soak --env-runners 8 --minutes 10 --state-dir .relay/soak {{ARGS}}

# A checkpoint of a real model's size as the Hub holds it: transformers writes a random Qwen3-1.7B-Base (its exact config, bf16 shards) into .relay/models on first use (deploy/install.sh --transformers); load time, resident memory, generation tokens/s at B = 1 and 8 on the CPU: table + JSON line.
bench-hub-model *ARGS: install
    bash deploy/install.sh --transformers
    cargo build --release -p relay-bench
    {{release}}/relay-bench bench-hub-model {{ARGS}}

# relay's CPU engine against llama.cpp (llama-cpp-python, installed into .relay/llama-cpp on first use: deploy/install.sh --llama-cpp) on the same SmolLM2-135M-Instruct GGUF and threads (default every core; --threads N): prompt tokens/s of a 200-token prompt and generation tokens/s at B = 1, medians of alternating rounds, ratios: table + JSON line.
bench-llamacpp *ARGS: install
    bash deploy/install.sh --llama-cpp
    cargo build --release -p relay-bench
    {{release}}/relay-bench bench-llamacpp {{ARGS}}

# LLM generation: tokens/s and p50/p95 request latency of the inference server for the tiny model and SmolLM2-135M (GGUF) at 1, 8, 32 concurrent requesters: table + JSON line.
bench-generate *ARGS: install
    cargo build --release -p relay -p relay-inference-server
    {{release}}/relay-bench bench-generate {{ARGS}}
