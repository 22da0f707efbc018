#!/usr/bin/env bash
# Install what tandem needs on the GPU machine (no network there): the carried wheels in .whl/ and
# ggml-python built from its carried source. Puts everything in /tmp/site; prints the exports to eval.
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=/tmp/site
mkdir -p "$SITE"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl
if ! PYTHONPATH="$SITE" python3 -c "import ggml" 2>/dev/null; then
    ggml_from=()  # GGML_FROM_LLAMA=1: around llama.cpp's ggml (scripts/build_ggml_python.sh)
    [[ "${GGML_FROM_LLAMA:-0}" == 1 ]] && ggml_from=(--ggml-from "$(ls .peers/llama_cpp_python-*.tar.xz | head -1)")
    bash scripts/build_ggml_python.sh "$SITE" "${ggml_from[@]}" >&2
fi
echo "export PYTHONPATH=$SITE:$PWD/src:$PWD/tests"
