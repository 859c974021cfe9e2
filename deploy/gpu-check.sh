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
#      engine's (losses, gradients, the step).
#   3. model: a random-weight checkpoint with Qwen3-0.6B's config, written by
#      transformers there (services/bench/hf/random_checkpoint.py; nothing
#      downloaded, a real model does not fit the carry).
#   4. relay: `relay-bench bench-gpu` on that model, candle on cuda:0 in
#      bf16: generation tokens/s at each batch size, LoRA training tokens/s
#      (B=8 x T=1024), and the longest T one step trains at B=4.
#   5. anchor: transformers' generate on the same model, prompts and lengths
#      (services/bench/hf/generate_anchor.py).
#   6. cnn: `relay-bench bench-cnn-step`, one PPO train step of NatureCNN
#      (Atari's CnnPolicy) at batch 256 on cuda:0, checked against the fused
#      CPU step (loss, gradient norm, parameters) and timed, beside the same
#      step in PyTorch on the same GPU (services/bench/hf/cnn_step_anchor.py).
#
# Prints a table and writes gpu-check.json (its last line) and every step's
# log under $OUT (default gpu-bundle/out). Exit status: 0 only if every step
# passed.
#
# --dry-run: the same steps on a machine without a GPU (CI runs it, so the
# script cannot rot between GPU checks): the CPU backends, the tiny Qwen3
# fixture as the model, small sizes, the CNN step on the GPU's code path
# run on the CPU (`composed-cpu`), and the anchors only where PyTorch and
# transformers import.
set -uo pipefail
cd "$(dirname "$0")/.."

dry_run=false
[ "${1:-}" = "--dry-run" ] && dry_run=true
bundle=${RELAY_GPU_BUNDLE:-gpu-bundle}
out=${OUT:-$bundle/out}
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python=${RELAY_GPU_PYTHON:-python3}
status=()
fail=0
record() { # name, rc
  if [ "$2" -eq 0 ]; then status+=("$1=ok"); else status+=("$1=failed($2)"); fail=1; fi
}
say() { printf 'gpu-check: %s\n' "$*"; }

if ! [ -f "$bundle/manifest.json" ]; then
  say "no $bundle/manifest.json: make the bundle with \`just gpu-bundle\` and carry $bundle"
  exit 2
fi
say "bundle $(tr -d '\n' < "$bundle/manifest.json")"
for f in "$bundle"/bin/*.xz; do
  name=$(basename "${f%.xz}")
  xz -dc "$f" > "$work/$name" && chmod +x "$work/$name" || { say "unpacking $f failed"; exit 2; }
done

# 1. machine
if $dry_run; then
  gpu="none (dry run)"
  say "dry run: no GPU; the CPU backends only"
  # The binaries start against the link stubs where no driver is installed.
  # shellcheck source=deploy/cuda-env.sh
  source deploy/cuda-env.sh || exit 2
else
  gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1) || {
    say "nvidia-smi failed: $gpu"; exit 2; }
  say "GPU: $gpu"
  # cuBLAS, cuBLASLt, cuRAND, NVRTC and the runtime from PyTorch's CUDA wheels.
  libs=$("$python" - <<'EOF'
import glob, os
import nvidia
dirs = {os.path.dirname(p) for root in nvidia.__path__ for p in glob.glob(os.path.join(root, "**", "lib*.so*"), recursive=True)}
print(":".join(sorted(dirs)))
EOF
  ) || { say "$python cannot import PyTorch's nvidia packages, which hold the CUDA libraries"; exit 2; }
  export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
for bin in "$work"/*; do
  missing=$(ldd "$bin" 2>&1 | grep "not found")
  if [ -n "$missing" ]; then
    say "$(basename "$bin") links libraries this machine lacks: $missing"
    exit 2
  fi
done
ldd "$work/relay-bench" | grep -E "libcuda|libcublas|libcurand|libnvrtc|libcudart" > "$out/libraries.txt"
cat "$out/libraries.txt"

# 2. reference
say "reference tests (every backend against transformers)"
RELAY_LLM_FIXTURES="$bundle/fixtures" RUST_BACKTRACE=1 \
  "$work/reference_models" --test-threads 4 --nocapture > "$out/reference.log" 2>&1
rc=$?
grep -E "^test result|FAILED|panicked" "$out/reference.log" | head -20
# The half-precision and training checks' measured gaps, device by device
# (tolerances in shared/llm/tests/reference_models.rs), and the seed of
# their random batches (RELAY_CHECK_SEED=<it> repeats a run).
grep -E "^candle \(.*(gap|difference)" "$out/reference.log" | sort > "$out/gaps.txt"
awk '{v=$NF; $NF=""; if (!($0 in m) || v+0 > m[$0]+0) m[$0]=v} END {for (k in m) print "  " k "max " m[k]}' \
  "$out/gaps.txt" | sort
grep -o "RELAY_CHECK_SEED=[0-9]*" "$out/reference.log" | sort -u | tr '\n' ' '; echo
tested=$(grep -o "^backend .*" "$out/reference.log" | sort | uniq -c | tr -s ' ' | tr '\n' ';')
say "backends tested (checks each): $tested"
if ! $dry_run && ! grep -q "^backend candle (cuda" "$out/reference.log"; then
  say "no test ran on cuda:0"; grep "no CUDA device" "$out/reference.log" | head -3
  [ "$rc" -eq 0 ] && rc=1
fi
record reference "$rc"

# 3. model
if $dry_run; then
  model="$bundle/fixtures/tiny-qwen3"
  batches=1,2 new_tokens=4 train_batch=2 train_len=16 longest=32,64 backends=engine,candle-cpu
  record model 0
else
  model="$work/qwen3-0.6b-random"
  batches=1,8,32,64 new_tokens=32 train_batch=8 train_len=1024 backends=cuda
  longest=1024,2048,4096,8192,16384
  say "writing a random-weight Qwen3-0.6B with transformers"
  "$python" services/bench/hf/random_checkpoint.py --config services/bench/hf/qwen3-0.6b.json \
    --out "$model" > "$out/model.log" 2>&1
  rc=$?
  tail -1 "$out/model.log"
  record model "$rc"
fi

# 4. relay
say "relay-bench bench-gpu --model $(basename "$model") --backends $backends --batches $batches"
"$work/relay-bench" bench-gpu --model "$model" --backends "$backends" --batches "$batches" \
  --new-tokens "$new_tokens" --train-batch "$train_batch" --train-len "$train_len" \
  --longest "$longest" --longest-batch 4 > "$out/bench-gpu.log" 2>&1
rc=$?
grep -v "^{" "$out/bench-gpu.log" | tail -8
record relay "$rc"
relay_json=$(grep "^{" "$out/bench-gpu.log" | tail -1)

# 5. anchor
anchor_json=null
if $dry_run && ! "$python" -c "import torch, transformers" 2>/dev/null; then
  say "anchor skipped: no PyTorch with transformers here"
  status+=("anchor=skipped")
else
  device=cuda:0
  $dry_run && device=cpu
  say "transformers generate on $device"
  "$python" services/bench/hf/generate_anchor.py --model "$model" --batches "$batches" \
    --new-tokens "$new_tokens" --device "$device" > "$out/anchor.log" 2>&1
  rc=$?
  grep -v "^{" "$out/anchor.log" | tail -6
  record anchor "$rc"
  anchor_json=$(grep "^{" "$out/anchor.log" | tail -1)
fi

# 6. cnn
cnn_device=cuda cnn_batch=256 cnn_steps=20 torch_device=cuda:0
$dry_run && cnn_device=composed-cpu cnn_batch=16 cnn_steps=2 torch_device=cpu
say "relay-bench bench-cnn-step --device $cnn_device --batch $cnn_batch"
"$work/relay-bench" bench-cnn-step --device "$cnn_device" --batch "$cnn_batch" --steps "$cnn_steps" \
  > "$out/cnn-step.log" 2>&1
rc=$?
grep -v "^{" "$out/cnn-step.log" | tail -4
record cnn "$rc"
cnn_json=$(grep "^{" "$out/cnn-step.log" | tail -1)
cnn_anchor_json=null
if $dry_run && ! "$python" -c "import torch" 2>/dev/null; then
  say "cnn anchor skipped: no PyTorch here"
  status+=("cnn_anchor=skipped")
else
  "$python" services/bench/hf/cnn_step_anchor.py --device "$torch_device" --batch "$cnn_batch" \
    --steps "$cnn_steps" > "$out/cnn-anchor.log" 2>&1
  rc=$?
  grep -v "^{" "$out/cnn-anchor.log" | tail -3
  record cnn_anchor "$rc"
  cnn_anchor_json=$(grep "^{" "$out/cnn-anchor.log" | tail -1)
fi

# Side by side, and the JSON line.
RELAY_JSON="${relay_json:-null}" ANCHOR_JSON="${anchor_json:-null}" GPU="$gpu" \
  CNN_JSON="${cnn_json:-null}" CNN_ANCHOR_JSON="${cnn_anchor_json:-null}" \
  STATUS="${status[*]}" MANIFEST="$bundle/manifest.json" OUT_DIR="$out" "$python" - <<'EOF'
import json, os
relay = json.loads(os.environ["RELAY_JSON"] or "null")
anchor = json.loads(os.environ["ANCHOR_JSON"] or "null")
status = dict(s.split("=", 1) for s in os.environ["STATUS"].split())
with open(os.environ["MANIFEST"]) as f:
    manifest = json.load(f)
rows = []
if relay:
    for backend in relay["backends"]:
        theirs = {r["batch"]: r["tokens_per_s"] for r in (anchor or {}).get("generate_tokens_per_s", [])}
        for r in backend["generate_tokens_per_s"]:
            t = theirs.get(r["batch"])
            rows.append({"backend": backend["backend"], "batch": r["batch"], "relay_tokens_per_s": r["tokens_per_s"],
                         "transformers_tokens_per_s": t, "ratio": round(r["tokens_per_s"] / t, 2) if t else None})
print("| backend | B | relay tok/s | transformers tok/s | relay / transformers |")
print("|---|---:|---:|---:|---:|")
for r in rows:
    print(f"| {r['backend']} | {r['batch']} | {r['relay_tokens_per_s']} | {r['transformers_tokens_per_s'] or '-'} | {r['ratio'] or '-'} |")
cnn = json.loads(os.environ["CNN_JSON"] or "null")
cnn_anchor = json.loads(os.environ["CNN_ANCHOR_JSON"] or "null")
if cnn:
    theirs = (cnn_anchor or {}).get("samples_per_s")
    ratio = round(cnn["samples_per_s"] / theirs, 2) if theirs else None
    print()
    print("| NatureCNN PPO step | batch | check (largest gap) | relay samples/s | PyTorch samples/s | relay / PyTorch |")
    print("|---|---:|---|---:|---:|---:|")
    gap = max(cnn["loss_gap"], cnn["grad_norm_gap"], cnn["parameter_gap"])
    print(f"| {cnn['device']} | {cnn['batch']} | {cnn['check']} ({gap:.1e}) | {cnn['samples_per_s']:.0f} | "
          f"{f'{theirs:.0f}' if theirs else '-'} | {ratio or '-'} |")
summary = {"check": "gpu", "gpu": os.environ["GPU"], "bundle": manifest, "steps": status,
           "generate": rows, "relay": relay, "anchor": anchor, "cnn_step": cnn, "cnn_anchor": cnn_anchor}
line = json.dumps(summary)
with open(os.path.join(os.environ["OUT_DIR"], "gpu-check.json"), "w") as f:
    f.write(line + "\n")
print(line)
EOF
say "steps: ${status[*]}"
exit $fail
