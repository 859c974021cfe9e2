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

# The release binaries with the `cuda` feature (candle on NVIDIA GPUs through cudarc), into target/cuda/release/ (the CPU build's caches stay). Builds without a GPU: installs a CUDA compiler from PyPI where none is installed, of the version RELAY_CUDA_VERSION names (default 13.0: at most the driver's CUDA version, which is 13.0 for driver 580), with link stubs of the CUDA libraries (deploy/install.sh --cuda; deploy/cuda-env.sh sets CUDA_COMPUTE_CAP and the CUDA version); running them on a GPU needs the NVIDIA driver, cuBLAS, cuRAND and NVRTC (PyTorch's nvidia/cu13/lib holds them). Serve on a GPU with `--set llm.device=cuda --set llm.dtype=bf16`.
build-cuda: install
    bash deploy/install.sh --cuda
    source deploy/cuda-env.sh && cargo build --release --workspace --bins --features cuda --target-dir target/cuda

# SmolLM2-135M generation tokens/s at B = 1, 8, 32, 64 on the CPU engine, the candle backend on the CPU and, with an NVIDIA GPU (the `cuda` build), on cuda:0 in bf16; LoRA training tokens/s and adapter load time: table + JSON line. Without a GPU it says so and measures the CPU backends.
bench-gpu *ARGS: install
    if nvidia-smi -L >/dev/null 2>&1; then just build-cuda && target/cuda/release/relay-bench bench-gpu {{ARGS}}; else cargo build --release --workspace --bins && {{release}}/relay-bench bench-gpu {{ARGS}}; fi

# The learner replicas' ring all-reduce: time and bus bandwidth for 10 KB to 100 MB of gradients with 2 and 4 members joined through nats-server (`--netns-rate 10gbit --members 2,4,8`: each member in its own network namespace, its link limited by tc; root): table + JSON line.
bench-allreduce *ARGS: install
    cargo build --release --workspace --bins
    {{release}}/relay-bench bench-allreduce {{ARGS}}

# Learner throughput with 1 and 2 data-parallel replicas (each a process of one thread, joined through nats-server) on the Atari NatureCNN PPO preset, SAC on Pendulum and LoRA GRPO on SmolLM2-135M (--workloads ppo-naturecnn,sac,grpo-smollm2): samples/s, speedup, all-reduce time per update: table + JSON line.
bench-learners *ARGS: install
    cargo build --release --workspace --bins
    {{release}}/relay-bench bench-learners {{ARGS}}

# One NatureCNN PPO train step at batch 256 (Atari's CnnPolicy) on the GPU when there is one (`--device cuda`), else on the CPU's fused kernels and on the GPU's code path run on the CPU (`--device composed-cpu`), checked against the fused CPU step and timed, beside PyTorch's same step where it imports: tables + JSON lines.
bench-cnn-step *ARGS: install
    if nvidia-smi -L >/dev/null 2>&1; then just build-cuda && target/cuda/release/relay-bench bench-cnn-step --device cuda {{ARGS}}; else cargo build --release --workspace --bins && {{release}}/relay-bench bench-cnn-step --device cpu {{ARGS}} && {{release}}/relay-bench bench-cnn-step --device composed-cpu {{ARGS}}; fi
    if [ -x .relay/sb3/bin/python ]; then .relay/sb3/bin/python services/bench/hf/cnn_step_anchor.py --device "$(nvidia-smi -L >/dev/null 2>&1 && echo cuda:0 || echo cpu)"; else echo "PyTorch anchor skipped: no .relay/sb3 (bash deploy/install.sh --transformers)"; fi

# Build and link with the `cuda` feature (the GPU check's bundle: relay-bench and the LLM reference tests, release; where there is no NVIDIA driver, against the link stubs deploy/install.sh --cuda writes), run the bundle's check on the CPU (deploy/gpu-check.sh --dry-run), and, without a GPU, check that a GPU asked for is refused, saying cuda:0 does not open. What CI runs, so the CUDA path cannot rot although CI has no GPU; its own target folder keeps the CPU build's caches.
check-cuda: gpu-check-dry-run
    #!/usr/bin/env bash
    set -euo pipefail
    source deploy/cuda-env.sh
    if nvidia-smi -L >/dev/null 2>&1; then exit 0; fi
    err=target/cuda/gpu.err
    if target/cuda/release/relay-bench bench-gpu --model gpu-bundle/fixtures/tiny-qwen3 --backends cuda 2>"$err"; then
        echo "check-cuda: --backends cuda ran on a machine without a GPU" >&2; exit 1
    fi
    grep -q "cuda:0 does not open" "$err" || { echo "check-cuda: --backends cuda failed without saying why:" >&2; cat "$err" >&2; exit 1; }
    echo "check-cuda: linked; the GPU check ran on the CPU; a GPU asked for is refused here: $(grep "does not open" "$err" | tail -1)"

# The GPU check's bundle, built here without a GPU: relay-bench and the LLM reference tests with the `cuda` feature (release, stripped, xz), the tiny LLM fixtures and a manifest, into gpu-bundle/ (refused when it and the repository's tracked and unignored files come to over 64 MiB, what a GPU run carries). On a GPU machine (no Rust there): carry gpu-bundle and run `bash deploy/gpu-check.sh` (each step under its own timeout: GPU, reference tests on cuda:0, a random-weight Qwen3-0.6B's generation and LoRA training against transformers' generate on the same GPU, the NatureCNN step against PyTorch's; tables, and 7 files under $OUT, gpu-check.json among them).
gpu-bundle: install
    bash deploy/gpu-bundle.sh

# The GPU check's dry run on this machine's CPU (what CI runs, so the script cannot rot between GPU checks): the bundle, then every step of deploy/gpu-check.sh on the CPU backends with the tiny Qwen3 fixture.
gpu-check-dry-run: gpu-bundle
    bash deploy/gpu-check.sh --dry-run

# Run every test (unit, fixtures, services against real NATS/Redis, end-to-end).
test: install
    cargo build --workspace --bins
    cargo test --workspace --no-fail-fast

# fmt and clippy, as CI checks them.
lint:
    cargo fmt --all -- --check
    cargo clippy --workspace --all-targets -- -D warnings

# Classic learners against their goals (PPO Acrobot-v1 >= -80 in 500k, DQN CartPole-v1 solved in 100k, DQN MountainCar-v0 >= -110 in 300k, SAC Pendulum-v1 >= -200 in 30k, A2C CartPole-v1 solved in 500k; through the env bridge PPO LunarLander-v3 >= 200 in 1M, PPO Taxi-v4 >= 7.5 in 1M with its action mask and without; by self-play on PettingZoo, PPO connect_four_v3 >= 90 % wins against random from both seats in 30 min, rated above its first version, and PPO tictactoe_v3 >= 95 % non-loss against random, beside minimax), 3 seeds each: table + JSON line.
bench-learning *ARGS: install
    cargo build --release --workspace --bins
    {{release}}/relay-bench bench-learning {{ARGS}}

# relay's learning curves beside Stable-Baselines3's at equal env steps (rl-zoo's hyperparameters; PPO CartPole, Acrobot, LunarLander, Hopper, HalfCheetah and Walker2d, DQN CartPole and MountainCar, SAC Pendulum and Hopper, recurrent PPO CartPoleNoVel and PendulumNoVel, PPO and DQN on the five MinAtar games; checkpoints evaluated on fresh episodes; IQM and 95 % bootstrap intervals over seeds, a verdict, a plot per task under bench/): table + JSON line. `--only ppo-cartpole,sac-pendulum` picks tasks.
bench-parity *ARGS: install
    bash deploy/install.sh --sb3
    cargo build --release --workspace --bins
    {{release}}/relay-bench bench-parity {{ARGS}}

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
