#!/usr/bin/env bash
# Build llama.cpp's tools from the vendored tree of the peers archive (llama-cpp-python 0.3.36's vendor/llama.cpp)
# into DIR/bin: llama-batched-bench for bench/batched_compare.py, and in the thin mode llama-server too, for
# bench/http_bench.py.
#
#   scripts/build_llamacpp_tools.sh DIR                       # llama-batched-bench, with llama.cpp and ggml (CPU)
#   scripts/build_llamacpp_tools.sh DIR --cuda                # the same with CUDA, sm_90 (H200): many minutes
#   scripts/build_llamacpp_tools.sh DIR --shared-libs LIBDIR  # thin: llama-batched-bench and llama-server only
#
# The thin mode (scripts/llamacpp_thin/CMakeLists.txt) compiles only the tools' own code (common, mtmd,
# cpp-httplib, the server; generic x86-64, no CUDA) and links it against an existing build of llama.cpp's shared
# libraries: LIBDIR is a folder with libllama.so and libggml*.so, e.g. llama-cpp-python's llama_cpp/lib, or an
# install holding one (/tmp/llama_cpp_cuda, as bench/device_compare.sh unpacks the carried CUDA build). The tools
# then run on whatever backends those libraries hold (the CUDA build's: the GPU), found through the RUNPATH
# (LIBDIR, or LLAMA_RUNPATH when they will run against libraries elsewhere) or LD_LIBRARY_PATH. llama-server is
# built with a stand-in for tools/ui (not in the trimmed archive): one empty page, the whole API. About 125
# files, some 7 CPU-minutes: 3.7 min with JOBS=2 on a quiet dev machine.
#
# Environment: TARBALL (default: the archive in shared/peers or .peers/), SRC_CACHE, JOBS (default: the CPUs),
# LLAMA_CMAKE_EXTRA (more CMake options, e.g. -DGGML_CUDA_FA=OFF: no FlashAttention kernels, a shorter build;
# llama.cpp's CLI tools turn flash attention on by default for CUDA, so a comparison of long contexts needs them
# built). The full builds use the same options as scripts/build_llamacpp.sh's library (GGML_NATIVE, no AMX on the
# CPU, see there); the thin mode's flash attention is the given libraries' (the carried CUDA build has none).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
[[ $# -ge 1 ]] || { sed -n '2,22p' "$0"; exit 2; }
target="$1"
cuda=0 libdir=""
case "${2:-}" in
  --cuda) cuda=1 ;;
  --shared-libs)
    libdir="${3:?--shared-libs needs a folder}"
    [[ -f "$libdir/llama_cpp/lib/libllama.so" ]] && libdir="$libdir/llama_cpp/lib"
    [[ -f "$libdir/libllama.so" ]] || { echo "no libllama.so in $libdir (nor in $libdir/llama_cpp/lib)" >&2; exit 1; }
    libdir="$(cd "$libdir" && pwd)" ;;
  "") ;;
  *) echo "unknown option $2" >&2; exit 2 ;;
esac

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

mkdir -p "$target/bin"
target="$(cd "$target" && pwd)"
build="$target/build"
start=$(date +%s)
if [[ -n "$libdir" ]]; then
  runpath="${LLAMA_RUNPATH:-$libdir}"
  # CMAKE_CXX_FLAGS: generic x86-64, whatever the environment's CXXFLAGS say (the tools may run on another host)
  cmake -S "$here/llamacpp_thin" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_FLAGS= -DCMAKE_CXX_FLAGS= \
    -DLLAMA_SRC="$src" -DLLAMA_LIBDIR="$libdir" -DLLAMA_RUNPATH="$runpath" >"$target/configure.log" 2>&1 ||
    { tail -30 "$target/configure.log" >&2; exit 1; }
  cmake --build "$build" -j "${JOBS:-$(nproc)}" --target llama-batched-bench llama-server >"$target/build.log" 2>&1 ||
    { tail -30 "$target/build.log" >&2; exit 1; }
  cp "$build/bin/llama-batched-bench" "$build/bin/llama-server" "$target/bin/"
  echo "llama-batched-bench and llama-server (thin, against $libdir; runpath $runpath) built in" \
    "$(( $(date +%s) - start )) s -> $target/bin"
  exit 0
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
cmake -S "$src" -B "$build" -G Ninja "${args[@]}" >"$target/configure.log" 2>&1 ||
  { tail -30 "$target/configure.log" >&2; exit 1; }
cmake --build "$build" -j "${JOBS:-$(nproc)}" --target llama-batched-bench >"$target/build.log" 2>&1 ||
  { tail -30 "$target/build.log" >&2; exit 1; }
cp "$build/bin/llama-batched-bench" "$target/bin/"
echo "llama-batched-bench built in $(( $(date +%s) - start )) s -> $target/bin"
