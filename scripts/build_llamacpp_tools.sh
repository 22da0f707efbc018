#!/usr/bin/env bash
# Build llama.cpp's llama-batched-bench from the vendored tree of the peers archive (llama-cpp-python 0.3.36's
# vendor/llama.cpp), for the batched comparison of `bench/batched_compare.py`, into DIR/bin. (llama-server does not
# build from the trimmed archive: its web UI sources, tools/ui, are not in it.)
#
#   scripts/build_llamacpp_tools.sh DIR            # CPU build
#   scripts/build_llamacpp_tools.sh DIR --cuda     # CUDA, sm_90 (H200)
#
# Environment: TARBALL (default: the archive in shared/peers or .peers/), SRC_CACHE, JOBS (default: the CPUs),
# LLAMA_CMAKE_EXTRA (more CMake options, e.g. -DGGML_CUDA_FA=OFF: no FlashAttention kernels, a shorter build;
# llama.cpp's CLI tools turn flash attention on by default for CUDA, so a comparison of long contexts needs them
# built). The tools are built with the same options as scripts/build_llamacpp.sh's library (GGML_NATIVE, no AMX
# on the CPU, see there).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
[[ $# -ge 1 ]] || { sed -n '2,13p' "$0"; exit 2; }
target="$1"
cuda=0
[[ "${2:-}" == "--cuda" ]] && cuda=1

if [[ -z "${TARBALL:-}" ]]; then
  for cand in "$repo/.peers" "$repo/shared/peers" "$repo/../shared/peers" /work/shared/peers; do
    if [[ -f "$cand/llama_cpp_python-0.3.36-trim.tar.xz" ]]; then
      TARBALL="$cand/llama_cpp_python-0.3.36-trim.tar.xz"; break
    fi
  done
fi
[[ -n "${TARBALL:-}" && -f "$TARBALL" ]] || { echo "llama_cpp_python-0.3.36-trim.tar.xz not found (set TARBALL)" >&2; exit 1; }
SRC_CACHE="${SRC_CACHE:-$HOME/.cache/tandem/peers/src}"
src="$SRC_CACHE/llama_cpp_python-0.3.36/vendor/llama.cpp"
if [[ ! -f "$src/CMakeLists.txt" ]]; then
  mkdir -p "$SRC_CACHE"
  tar -xJf "$TARBALL" -C "$SRC_CACHE"
fi

args=(-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON
      -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF -DCMAKE_BUILD_TYPE=Release)
if [[ $cuda == 1 ]]; then
  args+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90)
else
  args+=("-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
fi
# shellcheck disable=SC2206
[[ -n "${LLAMA_CMAKE_EXTRA:-}" ]] && args+=(${LLAMA_CMAKE_EXTRA})
build="$target/build"
mkdir -p "$target/bin"
start=$(date +%s)
cmake -S "$src" -B "$build" -G Ninja "${args[@]}" >"$target/configure.log" 2>&1 ||
  { tail -30 "$target/configure.log" >&2; exit 1; }
cmake --build "$build" -j "${JOBS:-$(nproc)}" --target llama-batched-bench >"$target/build.log" 2>&1 ||
  { tail -30 "$target/build.log" >&2; exit 1; }
cp "$build/bin/llama-batched-bench" "$target/bin/"
echo "llama-batched-bench built in $(( $(date +%s) - start )) s -> $target/bin"
