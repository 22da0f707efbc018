#!/usr/bin/env bash
# Install what tandem needs on the GPU machine (no network there): the carried wheels in .whl/ and
# ggml-python built from its carried source. Puts everything in /tmp/site; prints the exports to eval.
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=/tmp/site
mkdir -p "$SITE"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl
if ! PYTHONPATH="$SITE" python3 -c "import ggml" 2>/dev/null; then
    own=()  # GGML_OWN=1: ggml-python's own ggml 0.15.3, not llama.cpp's (scripts/build_ggml_python.sh)
    [[ "${GGML_OWN:-0}" == 1 ]] && own=(--own-ggml)
    bash scripts/build_ggml_python.sh --target "$SITE" "${own[@]}" >&2
fi
echo "export PYTHONPATH=$SITE:$PWD/src:$PWD/tests"
