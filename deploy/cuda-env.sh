# Sourced (not run) by `just build-cuda` and `just check-cuda`: puts a CUDA
# compiler on PATH and sets what candle's and cudarc's build scripts read.
#
# - A system CUDA (nvcc on PATH, or CUDA_ROOT/CUDA_PATH set) is used as it is;
#   otherwise the toolkit `deploy/install.sh --cuda` put into .relay/cuda
#   (PyPI's nvidia-cuda-nvcc and friends).
# - CUDARC_CUDA_VERSION: the toolkit's version, or 13.4 for a newer 13.x
#   (the newest cudarc 0.19 knows; the driver API is backward compatible).
# - CUDA_COMPUTE_CAP: left as set; without a GPU to ask (nvidia-smi), 80
#   (A100; H100s run sm_80 PTX too, JIT-compiled by the driver).
relay_cuda_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.relay/cuda"
if ! command -v nvcc >/dev/null; then
  if [ -n "${CUDA_ROOT:-${CUDA_PATH:-}}" ] && [ -x "${CUDA_ROOT:-$CUDA_PATH}/bin/nvcc" ]; then
    export PATH="${CUDA_ROOT:-$CUDA_PATH}/bin:$PATH"
  else
    toolkit=$(ls -d "$relay_cuda_root"/lib/python3*/site-packages/nvidia/cu13 2>/dev/null | head -1)
    if [ -z "$toolkit" ]; then
      echo "cuda-env: no nvcc; run \`bash deploy/install.sh --cuda\` first" >&2
      return 1
    fi
    export CUDA_ROOT="$toolkit" CUDA_PATH="$toolkit" PATH="$toolkit/bin:$PATH"
  fi
fi
relay_cuda_release=$(nvcc --version | sed -n 's/.*release \([0-9]*\)\.\([0-9]*\).*/\1 \2/p')
read -r relay_cuda_major relay_cuda_minor <<<"$relay_cuda_release"
if [ -z "${CUDARC_CUDA_VERSION:-}" ]; then
  if [ "$relay_cuda_major" -eq 13 ] && [ "$relay_cuda_minor" -gt 4 ]; then relay_cuda_minor=4; fi
  export CUDARC_CUDA_VERSION="${relay_cuda_major}0${relay_cuda_minor}0"
fi
if [ -z "${CUDA_COMPUTE_CAP:-}" ] && ! nvidia-smi >/dev/null 2>&1; then
  export CUDA_COMPUTE_CAP=80
fi
echo "cuda-env: nvcc $relay_cuda_major.$relay_cuda_minor ($(command -v nvcc)), CUDARC_CUDA_VERSION=$CUDARC_CUDA_VERSION, CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-from nvidia-smi}" >&2
