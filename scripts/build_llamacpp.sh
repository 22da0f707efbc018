#!/usr/bin/env bash
# Build llama.cpp through llama-cpp-python 0.3.36 (the trimmed sdist in shared/peers)
# into a --target directory, for side-by-side measurement and fixture recording.
#
#   scripts/build_llamacpp.sh                 # CPU build -> $HOME/.cache/tandem/peers/llama_cpp_cpu
#   scripts/build_llamacpp.sh --cuda          # CUDA (sm_90, H200) -> .../llama_cpp_cuda, 12 jobs
#   scripts/build_llamacpp.sh --target DIR    # install somewhere else
#   scripts/build_llamacpp.sh --force         # rebuild even if the target already imports
#   scripts/build_llamacpp.sh --amx|--no-amx  # keep / drop AMX code (default: dropped for CPU, kept for --cuda)
#
# AMX: with -DGGML_NATIVE=on on the dev machines (Xeon, AMX advertised) ggml's AMX matmul path dies
# with SIGILL (tilezero, "invalid opcode" in libggml-cpu.so) on the first prompt, so CPU builds add
# -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 (they win over -march=native whatever the order).
#
# Environment: PYTHON (default: the repo venv's python, else python3), TARBALL, SRC_CACHE, JOBS, LLAMA_CMAKE_EXTRA.
# Use the result with PYTHONPATH=DIR (or sys.path.insert(0, DIR)), and import llama_cpp
# BEFORE numpy (numpy first made the loader segfault in print_info, see shared/peers/README.md).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"

cuda=0
force=0
amx=""
target=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cuda) cuda=1 ;;
    --force) force=1 ;;
    --amx) amx=1 ;;
    --no-amx) amx=0 ;;
    --target) target="$2"; shift ;;
    --target=*) target="${1#--target=}" ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$repo/.venv/bin/python" ]]; then PYTHON="$repo/.venv/bin/python"; else PYTHON="$(command -v python3)"; fi
fi

# shared/ sits beside the repo on the dev machines (/work/shared) and inside it on the device.
if [[ -z "${TARBALL:-}" ]]; then
  for cand in "$repo/shared/peers" "$repo/../shared/peers" /work/shared/peers; do
    if [[ -f "$cand/llama_cpp_python-0.3.36-trim.tar.xz" ]]; then
      TARBALL="$cand/llama_cpp_python-0.3.36-trim.tar.xz"; break
    fi
  done
fi
[[ -n "${TARBALL:-}" && -f "$TARBALL" ]] || { echo "llama_cpp_python-0.3.36-trim.tar.xz not found (set TARBALL)" >&2; exit 1; }

cache="$HOME/.cache/tandem/peers"
SRC_CACHE="${SRC_CACHE:-$cache/src}"
if [[ -z "$target" ]]; then
  if [[ $cuda == 1 ]]; then target="$cache/llama_cpp_cuda"; else target="$cache/llama_cpp_cpu"; fi
fi

[[ -n "$amx" ]] || amx=$cuda
jobs="${JOBS:-2}"
cmake_args="-DGGML_NATIVE=on -DLLAVA_BUILD=off"
if [[ $cuda == 1 ]]; then
  cmake_args="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 $cmake_args"
  jobs="${JOBS:-12}"
fi
# Extra CMake options, e.g. LLAMA_CMAKE_EXTRA=-DGGML_CUDA_FA=OFF: the comparison runs llama.cpp with flash
# attention off (llama-cpp-python's default), so its ~80 FlashAttention kernel files are never used, and
# skipping them shortens the CUDA build.
[[ -n "${LLAMA_CMAKE_EXTRA:-}" ]] && cmake_args="$cmake_args $LLAMA_CMAKE_EXTRA"
if [[ $amx == 0 ]]; then
  noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  cmake_args="$cmake_args '-DCMAKE_C_FLAGS=$noamx' '-DCMAKE_CXX_FLAGS=$noamx'"
fi
marker="$target/.tandem_build"

# Skip when the target already imports and was built with the same flags.
if [[ $force == 0 && -f "$marker" && "$(cat "$marker")" == "$cmake_args" ]] && \
   PYTHONPATH="$target" "$PYTHON" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__, 'already in', '$target')" 2>/dev/null; then
  exit 0
fi

# Build requirements (no build isolation) and diskcache (needed by llama_cpp at import).
if ! "$PYTHON" -c "import scikit_build_core, cmake, ninja" 2>/dev/null; then
  "$PYTHON" -m pip install scikit-build-core cmake ninja
fi
if ! "$PYTHON" -c "import diskcache" 2>/dev/null; then
  "$PYTHON" -m pip install diskcache || true
fi

srcdir="$SRC_CACHE/llama_cpp_python-0.3.36"
if [[ ! -f "$srcdir/pyproject.toml" ]]; then
  mkdir -p "$SRC_CACHE"
  tar -xJf "$TARBALL" -C "$SRC_CACHE"
fi
[[ -f "$srcdir/pyproject.toml" ]] || { echo "unpacked tree has no $srcdir/pyproject.toml" >&2; ls "$SRC_CACHE" >&2; exit 1; }

mkdir -p "$target"
rm -f "$marker"
start=$(date +%s)
echo "building llama-cpp-python ($([[ $cuda == 1 ]] && echo CUDA || echo CPU), $jobs jobs) into $target"
echo "CMAKE_ARGS=$cmake_args"
CMAKE_BUILD_PARALLEL_LEVEL="$jobs" CMAKE_ARGS="$cmake_args" \
  "$PYTHON" -m pip install --no-index --no-deps --no-build-isolation --upgrade --target "$target" "$srcdir"

# diskcache inside the target too, so the target works with a python that lacks it.
if [[ ! -d "$target/diskcache" ]]; then
  "$PYTHON" -m pip install --no-deps --target "$target" diskcache >/dev/null 2>&1 || \
    echo "note: could not put diskcache into $target (the python running llama_cpp needs it)" >&2
fi

echo "$cmake_args" > "$marker"
PYTHONPATH="$target" "$PYTHON" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__, 'built in', $(( $(date +%s) - start )), 's ->', '$target')"
