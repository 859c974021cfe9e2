#!/usr/bin/env bash
# The GPU check: run from the repository root on a machine with an NVIDIA
# GPU and the folder `just gpu-bundle` made (gpu-bundle/, carried there).
# It needs only what such a machine has: the driver, and a python3 with
# PyTorch and transformers (whose CUDA wheels hold cuBLAS, cuRAND and
# NVRTC). No Rust toolchain, no network.
#
#   1. machine: the GPU and driver (nvidia-smi), the CUDA libraries the
#      binaries link, found in PyTorch's nvidia wheels.
#   2. reference: the LLM reference tests (shared/llm/tests/reference_models.rs,
#      the bundle's test binary) on every backend, cuda:0 included (its
#      memory pool poisoned with NaN first), against transformers' logits,
#      greedy continuations and PEFT adapters of the tiny Qwen2, Qwen3 and
#      Llama 3 fixtures the bundle carries, in f32, f16 and bf16; and one
#      RL update and one SFT step on fresh random batches against the CPU
#      engine's (losses, gradients, the step). The suite's reruns on
#      fixtures with config.json in the other transformers form
#      (`*_other_config_form`) are skipped: they check config reading,
#      which no device changes, and CI runs them.
#   3. model: a random-weight checkpoint with Qwen3-0.6B's config, written by
#      transformers there (services/bench/hf/random_checkpoint.py; nothing
#      downloaded, a real model does not fit the carry).
#   4. relay: `relay-bench bench-gpu` on that model, candle on cuda:0 in
#      bf16, after one untimed warm-up generate: generation tokens/s at
#      each batch size, LoRA training tokens/s (B=8 x T=1024), and the
#      longest T one step trains at B=4 (a search bounded in time).
#   5. anchor: transformers' generate on the same model, prompts and lengths
#      (services/bench/hf/generate_anchor.py), after its own warm-up.
#   6. cnn: `relay-bench bench-cnn-step`, one PPO train step of NatureCNN
#      (Atari's CnnPolicy) at batch 256 on cuda:0, checked against the fused
#      CPU step (loss, gradient norm, parameters) and timed; then
#      (cnn_anchor) the same step in PyTorch on the same GPU
#      (services/bench/hf/cnn_step_anchor.py) done as relay does it (f32
#      frames uploaded every step, TF32 off) and with PyTorch's defaults
#      (uint8 frames on the device, cuDNN's TF32 on): both rows.
#
# Every step runs under its own timeout (STEP_SECONDS below: 495 s in all,
# the machine step's two commands counted apart; with each step's 5 s of
# grace before SIGKILL and the unpacking, about 530 s, well inside the GPU
# machines' 10-minute call); a step that times out is named, and the steps
# after it still run.
#
# Prints tables and a JSON line, and leaves 7 files under $OUT (default
# gpu-bundle/out), fewer where a step is skipped: gpu-check.log (all of
# this script's output), gpu-check.json (the JSON line), setup.log
# (machine, libraries, the model's writing), reference.log, bench-gpu.log,
# anchor.log, cnn.log (relay's step, then PyTorch's). Exit status: 0 only
# if every step passed.
#
# --dry-run: the same steps on a machine without a GPU (CI runs it, so the
# script cannot rot between GPU checks): the CPU backends, the tiny Qwen3
# fixture as the model, small sizes, the CNN step on the GPU's code path
# run on the CPU (`composed-cpu`), and the anchors only where PyTorch and
# transformers import (RELAY_GPU_PYTHON names the python).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

# Seconds each step may take. A step's command is sent SIGTERM at its
# limit and SIGKILL 5 s later.
declare -A STEP_SECONDS=(
  [machine]=15     # nvidia-smi, then the library lookup: each
  [reference]=110  # the reference tests (CUDA modules JIT-compiled on first use)
  [model]=70       # transformers writes a random 0.6B checkpoint
  [relay]=140      # bench-gpu; its longest-T search gets 60 of them
  [anchor]=50      # transformers' generate
  [cnn]=60         # relay's CNN step: the CPU reference, then the device
  [cnn_anchor]=35  # PyTorch's CNN step, both settings
)
LONGEST_SEARCH_SECONDS=60
# RELAY_GPU_STEP_SECONDS="reference=200 relay=100" changes some of them.
for pair in ${RELAY_GPU_STEP_SECONDS:-}; do
  [[ "$pair" =~ ^([a-z_]+)=([0-9]+)$ && -n "${STEP_SECONDS[${BASH_REMATCH[1]}]:-}" ]] || {
    echo "gpu-check: RELAY_GPU_STEP_SECONDS: $pair is not <step>=<seconds> for a step of: ${!STEP_SECONDS[*]}" >&2
    exit 2
  }
  STEP_SECONDS[${BASH_REMATCH[1]}]=${BASH_REMATCH[2]}
done

dry_run=false
[ "${1:-}" = "--dry-run" ] && dry_run=true
bundle=${RELAY_GPU_BUNDLE:-gpu-bundle}
if [ -n "${OUT:-}" ]; then
  out=$OUT
else
  out=$bundle/out
  rm -rf "$out" # a previous run's files would pass for this one's
fi
mkdir -p "$out"
python=${RELAY_GPU_PYTHON:-python3}

say() { printf 'gpu-check: %s\n' "$*"; }

main() {
  local started=$SECONDS
  local work
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  status=()
  fail=0

  if ! [ -f "$bundle/manifest.json" ]; then
    say "no $bundle/manifest.json: make the bundle with \`just gpu-bundle\` and carry $bundle"
    exit 2
  fi
  say "bundle $(tr -d '\n' < "$bundle/manifest.json")"
  for f in "$bundle"/bin/*.xz; do
    name=$(basename "${f%.xz}")
    if ! timeout 30 xz -dc "$f" > "$work/$name"; then
      say "unpacking $f failed"; exit 2
    fi
    chmod +x "$work/$name"
  done

  # 1. machine
  : > "$out/setup.log"
  if $dry_run; then
    gpu="none (dry run)"
    say "dry run: no GPU; the CPU backends only"
    # The binaries start against the link stubs where no driver is installed.
    # shellcheck source=deploy/cuda-env.sh
    source deploy/cuda-env.sh 2>> "$out/setup.log" || exit 2
  else
    gpu=$(timeout "${STEP_SECONDS[machine]}" nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1) || {
      say "nvidia-smi failed or took over ${STEP_SECONDS[machine]} s: $gpu"; exit 2; }
    say "GPU: $gpu"
    # cuBLAS, cuBLASLt, cuRAND, NVRTC and the runtime from PyTorch's CUDA wheels.
    libs=$(timeout "${STEP_SECONDS[machine]}" "$python" - <<'EOF'
import glob, os
import nvidia
dirs = {os.path.dirname(p) for root in nvidia.__path__ for p in glob.glob(os.path.join(root, "**", "lib*.so*"), recursive=True)}
print(":".join(sorted(dirs)))
EOF
    ) || { say "$python cannot import PyTorch's nvidia packages, which hold the CUDA libraries"; exit 2; }
    export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
  echo "gpu: $gpu" >> "$out/setup.log"
  for bin in "$work"/*; do
    missing=$(ldd "$bin" 2>&1 | grep "not found")
    if [ -n "$missing" ]; then
      say "$(basename "$bin") links libraries this machine lacks: $missing"
      exit 2
    fi
  done
  ldd "$work/relay-bench" | grep -E "libcuda|libcublas|libcurand|libnvrtc|libcudart" | tee -a "$out/setup.log"
  status+=("machine=ok")

  # 2. reference
  say "reference tests (every backend against transformers)"
  run_step reference "$out/reference.log" \
    env RELAY_LLM_FIXTURES="$bundle/fixtures" RUST_BACKTRACE=1 \
    "$work/reference_models" --test-threads 4 --nocapture --skip other_config_form
  local rc=$?
  grep -E "^test result|FAILED|panicked|has been running for over" "$out/reference.log" | head -20
  if [[ "${status[*]}" == *reference=timeout* ]]; then
    # Running or never started: the hang is among the first of them.
    unfinished=$("$work/reference_models" --list --skip other_config_form 2>/dev/null |
      sed -n 's/: test$//p' | grep -vxFf <(sed -n 's/^test \(.*\) \.\.\. .*/\1/p' "$out/reference.log"))
    say "reference: $(wc -l <<<"$unfinished") tests did not finish: $(head -8 <<<"$unfinished" | tr '\n' ' ')"
  fi
  # The half-precision and training checks' largest measured gaps, device
  # by device (tolerances in shared/llm/tests/reference_models.rs), and the
  # seed of their random batches (RELAY_CHECK_SEED=<it> repeats a run).
  reference_gaps=$(grep -E "^candle \(.*(gap|difference)" "$out/reference.log" |
    awk '{v=$NF; $NF=""; if (!($0 in m) || v+0 > m[$0]+0) m[$0]=v} END {for (k in m) print k "max " m[k]}' | sort)
  [ -n "$reference_gaps" ] && sed 's/^/  /' <<<"$reference_gaps"
  grep -o "RELAY_CHECK_SEED=[0-9]*" "$out/reference.log" | sort -u | tr '\n' ' '; echo
  tested=$(grep -o "^backend .*" "$out/reference.log" | sort | uniq -c | tr -s ' ' | tr '\n' ';')
  say "backends tested (checks each): $tested"
  if [ "$rc" -eq 0 ] && ! $dry_run && ! grep -q "^backend candle (cuda" "$out/reference.log"; then
    say "no test ran on cuda:0"; grep "no CUDA device" "$out/reference.log" | head -3
    mark_failed reference 1
  fi

  # 3. model
  if $dry_run; then
    model="$bundle/fixtures/tiny-qwen3"
    batches=1,2 new_tokens=4 train_batch=2 train_len=16 longest=32,64 backends=engine,candle-cpu
    status+=("model=fixture")
  else
    model="$work/qwen3-0.6b-random"
    batches=1,8,32,64 new_tokens=32 train_batch=8 train_len=1024 backends=cuda
    longest=1024,2048,4096,8192,16384
    say "writing a random-weight Qwen3-0.6B with transformers"
    run_step model "$out/setup.log" \
      "$python" services/bench/hf/random_checkpoint.py --config services/bench/hf/qwen3-0.6b.json \
      --out "$model"
    tail -1 "$out/setup.log"
  fi

  # 4. relay
  say "relay-bench bench-gpu --model $(basename "$model") --backends $backends --batches $batches"
  run_step relay "$out/bench-gpu.log" \
    "$work/relay-bench" bench-gpu --model "$model" --backends "$backends" --batches "$batches" \
    --new-tokens "$new_tokens" --train-batch "$train_batch" --train-len "$train_len" \
    --longest "$longest" --longest-batch 4 --longest-seconds "$LONGEST_SEARCH_SECONDS"
  grep -v "^{" "$out/bench-gpu.log" | tail -8
  relay_json=$(grep "^{" "$out/bench-gpu.log" | tail -1)

  # 5. anchor
  anchor_json=null
  if $dry_run && ! "$python" -c "import torch, transformers" 2>/dev/null; then
    say "anchor skipped: no PyTorch with transformers here"
    status+=("anchor=skipped")
  else
    local device=cuda:0
    $dry_run && device=cpu
    say "transformers generate on $device"
    run_step anchor "$out/anchor.log" \
      "$python" services/bench/hf/generate_anchor.py --model "$model" --batches "$batches" \
      --new-tokens "$new_tokens" --device "$device"
    grep -v "^{" "$out/anchor.log" | tail -6
    anchor_json=$(grep "^{" "$out/anchor.log" | tail -1)
  fi

  # 6. cnn
  local cnn_device=cuda cnn_batch=256 cnn_steps=20 torch_device=cuda:0
  $dry_run && cnn_device=composed-cpu cnn_batch=16 cnn_steps=2 torch_device=cpu
  say "relay-bench bench-cnn-step --device $cnn_device --batch $cnn_batch"
  : > "$out/cnn.log"
  run_step cnn "$out/cnn.log" \
    "$work/relay-bench" bench-cnn-step --device "$cnn_device" --batch "$cnn_batch" --steps "$cnn_steps"
  grep -v "^{" "$out/cnn.log" | tail -4
  cnn_json=$(grep '^{.*"bench":"cnn-step"' "$out/cnn.log" | tail -1)
  cnn_anchor_json=null
  if $dry_run && ! "$python" -c "import torch" 2>/dev/null; then
    say "cnn anchor skipped: no PyTorch here"
    status+=("cnn_anchor=skipped")
  else
    say "PyTorch's CNN step on $torch_device"
    run_step cnn_anchor "$out/cnn.log" \
      "$python" services/bench/hf/cnn_step_anchor.py --device "$torch_device" --batch "$cnn_batch" \
      --steps "$cnn_steps"
    grep "^PyTorch" "$out/cnn.log" | tail -2
    cnn_anchor_json=$(grep '^{.*"bench": "cnn-step-anchor"' "$out/cnn.log" | tail -1)
  fi

  # Side by side, and the JSON line.
  echo
  RELAY_JSON="${relay_json:-null}" ANCHOR_JSON="${anchor_json:-null}" GPU="$gpu" \
    CNN_JSON="${cnn_json:-null}" CNN_ANCHOR_JSON="${cnn_anchor_json:-null}" \
    REFERENCE_GAPS="$reference_gaps" STATUS="${status[*]}" MANIFEST="$bundle/manifest.json" \
    OUT_DIR="$out" "$python" services/bench/hf/gpu_check_summary.py || fail=1
  say "steps: ${status[*]}"
  say "done in $((SECONDS - started)) s; files under $out: $(cd "$out" && ls | tr '\n' ' ')"
  exit $fail
}

# mark_failed NAME RC: NAME's outcome becomes a failure.
mark_failed() {
  local kept=()
  for s in "${status[@]}"; do [ "${s%%=*}" = "$1" ] || kept+=("$s"); done
  status=("${kept[@]}" "$1=failed($2)")
  fail=1
}

# run_step NAME LOG COMMAND...: COMMAND under NAME's timeout
# (STEP_SECONDS), its output appended to LOG; records NAME's outcome
# (ok, failed(rc) or timeout(N s)) and returns the command's status.
run_step() {
  local name=$1 log=$2 limit=${STEP_SECONDS[$1]}
  shift 2
  local began=$SECONDS
  timeout --kill-after=5 "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  if { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && [ $((SECONDS - began)) -ge "$limit" ]; then
    say "$name: timed out after $limit s (its output so far is in $(basename "$log")); the steps after it still run"
    echo "gpu-check: $name timed out after $limit s" >> "$log"
    status+=("$name=timeout(${limit}s)")
    fail=1
  elif [ "$rc" -eq 0 ]; then
    status+=("$name=ok")
  else
    status+=("$name=failed($rc)")
    fail=1
  fi
  return "$rc"
}

main "$@" 2>&1 | tee "$out/gpu-check.log"
exit "${PIPESTATUS[0]}"
