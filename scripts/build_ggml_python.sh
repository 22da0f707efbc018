#!/usr/bin/env bash
# Build ggml-python (tandem's CPU kernels) around the ggml that llama.cpp runs, and install it:
#
#   scripts/build_ggml_python.sh [--target DIR] [--own-ggml] [--ggml-from LLAMA_CPP_PYTHON_ARCHIVE]
#
# ggml-python 0.0.45 (the ctypes bindings tandem calls) vendors ggml 0.15.3; llama-cpp-python 0.3.36, the
# llama.cpp tandem is compared with and checked against, vendors ggml 0.25.3, whose mul_mat_id and tiled Q6_K and
# AVX-512 kernels are the faster ones on the GPU machine's CPU. So ggml-python's source is built with its
# vendor/ggml swapped for llama-cpp-python's vendor/llama.cpp/ggml (the bindings call nothing 0.25.3 changed;
# the whole test suite runs on it). --own-ggml keeps ggml-python's own 0.15.3, for A/B runs.
#
# Sources: SDIST (default .whl/ggml_python-0.0.45.tar.gz) and --ggml-from (default the first
# .peers/llama_cpp_python-0.3.36*.tar.*); where absent, `pip download` fetches them into build/sdists from the
# package index (76 MB for llama-cpp-python). With --target DIR (the GPU machine: no network) it installs into
# that folder offline, else into PYTHON's environment (default python3). JOBS: parallel compiles (default: the
# CPU count). llamafile's batched kernels (tinyBLAS) are on, as in llama.cpp's build (ggml's own leaves them off).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
py=${PYTHON:-python3}
target="" ggml_from="" own=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --target) target=$2; shift 2 ;;
    --ggml-from) ggml_from=$2; shift 2 ;;
    --own-ggml) own=1; shift ;;
    *) sed -n '2,17p' "$0" >&2; exit 2 ;;
  esac
done

fetch() {  # fetch NAME==VERSION GLOB: the source archive, carried or downloaded
  local found
  found=$(ls $2 build/sdists/$(basename "$2") 2>/dev/null | head -1 || true)
  if [[ -z "$found" ]]; then
    mkdir -p build/sdists
    "$py" -m pip download -q --no-deps --no-binary :all: -d build/sdists "$1" >&2
    found=$(ls build/sdists/$(basename "$2") | head -1)
  fi
  echo "$found"
}

sdist=${SDIST:-$(fetch ggml-python==0.0.45 ".whl/ggml_python-0.0.45.tar.gz")}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar -xzf "$sdist" -C "$work"
src=$(echo "$work"/ggml_python-*)
if [[ $own == 0 ]]; then
  [[ -n "$ggml_from" ]] || ggml_from=$(fetch llama-cpp-python==0.3.36 ".peers/llama_cpp_python-0.3.36*.tar.*")
  tar -xf "$ggml_from" -C "$work" --wildcards '*/vendor/llama.cpp/ggml/*'
  rm -rf "$src/vendor/ggml"
  mv "$work"/llama_cpp_python-*/vendor/llama.cpp/ggml "$src/vendor/ggml"
fi
# A native build on a CPU with AVX512-FP16 would sum f16 products in f16 lanes (ggml's simd mappings), rounding
# CPU attention scores to f16; llama.cpp's portable builds sum them in float32, and so must tandem's
# (quant/ggml_cpu.py `require_ggml` checks it).
if echo 'int main(void) { return 0; }' | "${CC:-cc}" -mno-avx512fp16 -x c - -o /dev/null 2>/dev/null; then
  sed -i 's/list(APPEND ARCH_FLAGS -march=native)/list(APPEND ARCH_FLAGS -march=native -mno-avx512fp16)/' \
    "$src/vendor/ggml/src/ggml-cpu/CMakeLists.txt"
fi
args=(--no-deps --no-compile --force-reinstall)
[[ -n "$target" ]] && args+=(--no-index --no-build-isolation --upgrade --target "$target")
CMAKE_ARGS="-DGGML_LLAMAFILE=ON ${CMAKE_ARGS:-}" CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-$(nproc)} \
  "$py" -m pip install -q "${args[@]}" "$src"
