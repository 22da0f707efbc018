#!/usr/bin/env bash
# Run HERE (the dev machine, which has the network) before a device call of bench/device_compare.sh.
# The GPU machine fetches nothing and receives only the repo, so stage in the repo's ignored folders:
#   .peers/llama_cpp_python-0.3.36-trim.tar.xz  llama.cpp's source, built there with CUDA for sm_90; its ggml is
#                                               also the one ggml-python is built around (build_ggml_python.sh)
#   .whl/gguf-0.19.0-py3-none-any.whl           tandem's GGUF reader/writer (not on the device image)
#   .whl/diskcache-5.6.3-py3-none-any.whl       llama_cpp imports it (not on the device image)
#   .whl/ggml_python-0.0.45.tar.gz              the bindings to ggml's CPU kernels for tandem: built there
#   .whl/transformers-5.23.0-py3-none-any.whl   the GPU tests build tiny models with it (the image has 5.17,
#                                               which lacks the Qwen3.5-MoE and Gemma 4 config classes)
#   .whl/{fastapi,starlette,uvicorn,pydantic,pydantic_core,annotated_types,typing_inspection,
#         opentelemetry_api}-*.whl              `tandem serve` (bench/http_bench.py there); the image has
#                                               annotated-doc, anyio, click, h11, httpx, prometheus-client
# numpy, pyyaml, tqdm, requests, typing_extensions, psutil, jinja2, rich, matplotlib, nvidia-ml-py,
# scikit-build-core, cmake and ninja are on the device image already (KINDS.md's package list).
# Then: device run(command="bash bench/device_compare.sh", carry=[".whl", ".peers"], timeout_s=600).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY="${PYTHON:-.venv/bin/python}"
[[ -x "$PY" ]] || PY="$(command -v python3)"
if [[ -z "${TARBALL:-}" ]]; then
  for cand in shared/peers ../shared/peers /work/shared/peers; do
    if [[ -f "$cand/llama_cpp_python-0.3.36-trim.tar.xz" ]]; then TARBALL="$cand/llama_cpp_python-0.3.36-trim.tar.xz"; break; fi
  done
fi
[[ -n "${TARBALL:-}" && -f "$TARBALL" ]] || { echo "llama_cpp_python-0.3.36-trim.tar.xz not found (set TARBALL)" >&2; exit 1; }

# Both folders are in .gitignore: they travel through `carry`, never as part of the tree, and are never committed.
for d in .whl .peers; do git check-ignore -q "$d" 2>/dev/null || echo "warning: $d/ is not ignored by git" >&2; done
mkdir -p .whl .peers
cmp -s "$TARBALL" .peers/"$(basename "$TARBALL")" || cp -f "$TARBALL" .peers/

# Pure-Python wheels for the device's CPython 3.12 (pip needs the target named when it is not this Python).
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any \
  -d .whl gguf==0.19.0 diskcache==5.6.3 transformers==5.23.0 \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic_core==2.50.5 \
  annotated_types==0.7.0 typing_inspection==0.4.5 opentelemetry_api==1.45.2
# The sdist: --no-build-isolation, or pip builds cmake from source just to read the metadata (minutes).
"$PY" -m pip download -q --no-deps --no-binary :all: --no-build-isolation -d .whl ggml-python==0.0.45

# Two versions of one package in .whl/ make `pip install .whl/*.whl` refuse everything.
for name in gguf diskcache ggml_python transformers fastapi starlette uvicorn pydantic pydantic_core annotated_types \
    typing_inspection opentelemetry_api; do
  n=$(find .whl -maxdepth 1 -iname "${name}-*" | wc -l)
  [[ $n -le 1 ]] || { echo "more than one $name in .whl/: keep one" >&2; ls .whl >&2; exit 1; }
done
ls -l .whl .peers
du -sh .whl .peers
echo "staged; the device call carries .whl and .peers (64 MiB in all with the repo)"
