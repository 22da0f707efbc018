#!/usr/bin/env bash
# Install what tandem needs on the GPU machine (no network there): the carried wheels in .whl/ and
# ggml-python built from its carried source. Puts everything in /tmp/site; prints the exports to eval.
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=/tmp/site
mkdir -p "$SITE"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl
if ! PYTHONPATH="$SITE" python3 -c "import ggml" 2>/dev/null; then
    CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-index --no-deps --no-build-isolation \
        --target "$SITE" .whl/ggml_python-*.tar.gz
fi
echo "export PYTHONPATH=$SITE:$PWD/src:$PWD/tests"
