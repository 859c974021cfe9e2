# Sourced (not run) by `just build-cuda` and `just check-cuda`: puts a CUDA
# compiler on PATH and sets what candle's and cudarc's build scripts read.
#
# - A system CUDA (nvcc on PATH, or CUDA_ROOT/CUDA_PATH set) is used as it is;
#   otherwise the toolkit `deploy/install.sh --cuda` put into
#   .relay/cuda-$RELAY_CUDA_VERSION (default 13.0; PyPI's nvidia-cuda-nvcc and
#   friends, with link stubs of the CUDA libraries in its lib/stubs).
# - CUDARC_CUDA_VERSION: the toolkit's version, or 13.4 for a newer 13.x
#   (the newest cudarc 0.19 knows; the driver API is backward compatible).
# - CUDA_COMPUTE_CAP: left as set; without a GPU to ask (nvidia-smi), 80
#   (A100; H100s run sm_80 PTX too, JIT-compiled by the driver).
# - Without an NVIDIA driver here, the stubs (and the toolkit's CUDA
#   runtime) go on LD_LIBRARY_PATH, so the
#   `cuda` binaries start and run on the CPU (a GPU asked for is refused
#   with CUDA_ERROR_STUB_LIBRARY).
relay_cuda_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.relay/cuda-${RELAY_CUDA_VERSION:-13.0}"
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
relay_cuda_stubs="${CUDA_ROOT:-}/lib/stubs"
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 ' && [ -e "$relay_cuda_stubs/libcuda.so.1" ]; then
  # The toolkit's lib holds the CUDA runtime the kernels link.
  export LD_LIBRARY_PATH="$relay_cuda_stubs:$CUDA_ROOT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  relay_cuda_driver="none (the stubs are on LD_LIBRARY_PATH)"
else
  relay_cuda_driver="the system's"
fi
echo "cuda-env: nvcc $relay_cuda_major.$relay_cuda_minor ($(command -v nvcc)), CUDARC_CUDA_VERSION=$CUDARC_CUDA_VERSION, CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-from nvidia-smi}, driver: $relay_cuda_driver" >&2
