#!/usr/bin/env bash
# Build ggml-python (tandem's CPU kernels) from its carried source archive into a pip --target folder:
#
#   scripts/build_ggml_python.sh TARGET [--ggml-from LLAMA_CPP_PYTHON_TARBALL]
#
# ggml-python 0.0.45 vendors ggml 0.15.3; llama-cpp-python 0.3.36 vendors ggml 0.25.3. --ggml-from builds
# ggml-python around the ggml of that llama-cpp-python source archive instead (its vendor/llama.cpp/ggml),
# for an A/B of the two ggml versions under tandem (bench/ggml_versions.py times them side by side). tandem's
# CPU test suite passes with either (2026-11-30: the 0.25.3 libraries under ggml-python's bindings).
# Environment: SDIST (default .whl/ggml_python-*.tar.gz), PYTHON (python3), JOBS (16).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[[ $# -eq 1 || ( $# -eq 3 && $2 == --ggml-from ) ]] || { sed -n '2,11p' "$0" >&2; exit 2; }
target=$1
sdist=${SDIST:-$(ls .whl/ggml_python-*.tar.gz | head -1)}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar -xzf "$sdist" -C "$work"
src=$(echo "$work"/ggml_python-*)
if [[ $# -eq 3 ]]; then
  tar -xJf "$3" -C "$work" --wildcards '*/vendor/llama.cpp/ggml/*'
  rm -rf "$src/vendor/ggml"
  mv "$work"/llama_cpp_python-*/vendor/llama.cpp/ggml "$src/vendor/ggml"
fi
# llamafile's batched kernels on, as in llama.cpp's ggml and the Makefile's build
CMAKE_ARGS="-DGGML_LLAMAFILE=ON ${CMAKE_ARGS:-}" CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-16} "${PYTHON:-python3}" -m pip install -q --no-index --no-deps \
  --no-build-isolation --no-compile --target "$target" "$src"
