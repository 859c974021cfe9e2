#!/usr/bin/env bash
# `just gpu-bundle`: builds, on a machine without a GPU, what the GPU check
# (deploy/gpu-check.sh) needs on one, into gpu-bundle/ (ignored by git):
#
#   bin/relay-bench.xz        the benchmarks, `cuda` feature, release
#   bin/reference_models.xz   the LLM reference tests, `cuda` feature, release
#   fixtures/tiny-{qwen2,qwen3,llama3}/   their reference data (from
#                             $RELAY_LLM_FIXTURES, default ../shared/fixtures)
#   manifest.json             commit, CUDA version, compute capability, sizes
#
# The binaries are stripped and xz-compressed: a GPU run carries at most
# 64 MiB, the bundle together with the repository's files that travel
# with it (tracked, and untracked ones git does not ignore), and no
# toolchain is there to build them; over that, this refuses, naming the
# sizes (RELAY_GPU_CARRY_MIB sets another limit). Their
# kernels are PTX for compute capability $CUDA_COMPUTE_CAP (default 8.0),
# which the driver compiles for the GPU it meets (sm_80 on an A100, sm_90 on
# an H100 or H200) when a module first loads; the CUDA version is
# RELAY_CUDA_VERSION's (default 13.0, for driver 580: deploy/install.sh says
# the rule). Carry it with the run: `carry: ["gpu-bundle"]`, command
# `bash deploy/gpu-check.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."

carry_limit=$((${RELAY_GPU_CARRY_MIB:-64} * 1024 * 1024))
fixtures=${RELAY_LLM_FIXTURES:-../shared/fixtures}
bundle=gpu-bundle
target=target/cuda

bash deploy/install.sh --cuda
# shellcheck source=deploy/cuda-env.sh
source deploy/cuda-env.sh
# One cargo invocation for both, so they share one feature resolution and
# one build of candle's kernels.
artifacts=$(cargo build --release -p relay-bench -p relay-llm --features relay-bench/cuda,relay-llm/cuda \
  --bin relay-bench --test reference_models --target-dir "$target" --message-format json-render-diagnostics |
  python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])')
relay_bench=$(awk '$1 == "relay-bench" {print $2}' <<<"$artifacts")
tests=$(awk '$1 == "reference_models" {print $2}' <<<"$artifacts")
[ -x "$relay_bench" ] || { echo "gpu-bundle: no relay-bench binary was built" >&2; exit 1; }
[ -x "$tests" ] || { echo "gpu-bundle: no reference_models test binary was built" >&2; exit 1; }

rm -rf "$bundle"
mkdir -p "$bundle/bin" "$bundle/fixtures"
for pair in "relay-bench:$relay_bench" "reference_models:$tests"; do
  name=${pair%%:*} path=${pair#*:}
  strip -o "$bundle/bin/$name" "$path"
  xz -T0 -6 "$bundle/bin/$name"
done
for f in tiny-qwen2 tiny-qwen3 tiny-llama3; do
  [ -f "$fixtures/$f/reference.json" ] || { echo "gpu-bundle: no $fixtures/$f (set RELAY_LLM_FIXTURES)" >&2; exit 1; }
  cp -r "$fixtures/$f" "$bundle/fixtures/"
done
chmod -R u+w "$bundle/fixtures"

# Plain files' bytes, as the carry counts them.
file_bytes() { awk '{s += $1} END {print s + 0}'; }
bytes=$(find "$bundle" -type f -printf '%s\n' | file_bytes)
# The working tree's files that travel with the bundle (a tracked file
# deleted here travels with neither).
tree_bytes=$(git ls-files -z --cached --others --exclude-standard |
  xargs -0 stat -c %s 2>/dev/null | file_bytes)
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
dirty=$(git status --porcelain 2>/dev/null | grep -v "^??" | head -1 || true)
cat > "$bundle/manifest.json" <<EOF
{"commit": "$commit${dirty:+-dirty}", "cuda": "$CUDARC_CUDA_VERSION", "compute_cap": "${CUDA_COMPUTE_CAP:-80}", "bytes": $bytes, "tree_bytes": $tree_bytes, "binaries": {$(for f in "$bundle"/bin/*.xz; do printf '"%s": %s,' "$(basename "$f")" "$(stat -c %s "$f")"; done | sed 's/,$//')}}
EOF
cat "$bundle/manifest.json"
carry=$((bytes + tree_bytes))
if [ "$carry" -gt "$carry_limit" ]; then
  echo "gpu-bundle: a GPU run would carry $(mib "$carry") ($carry bytes): $bundle $(mib "$bytes") (bin $(mib "$(find "$bundle/bin" -type f -printf '%s\n' | file_bytes)"), fixtures $(mib "$(find "$bundle/fixtures" -type f -printf '%s\n' | file_bytes)")) + the working tree's tracked and unignored files $(mib "$tree_bytes"), over the $(mib "$carry_limit") ($carry_limit bytes) it takes" >&2
  exit 1
fi
echo "gpu-bundle: $bundle ready, $(mib "$bytes"); with the working tree's files a GPU run carries $(mib "$carry") of its $(mib "$carry_limit"); there: bash deploy/gpu-check.sh"
