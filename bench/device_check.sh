#!/usr/bin/env bash
# One device call for tandem alone: set up, run the GPU test suite, time the kernels, and profile prefill and
# decode on a synthetic Qwen3-30B-A3B (Q4_K_M mix) per placement (bench/profile_step.py). Logs go to $OUT;
# a short summary is printed last. For the side-by-side with llama.cpp, see bench/device_compare.sh.
#   PLACEMENTS=cpu-moe,n-cpu-moe-24,all  TESTS="tests/test_gpu.py ..." (default: tests/test_gpu*.py; none: skip)
#   THREADS=16  PROBE=1 (also bench/probe_host_memory.py: the host-to-GPU copy paths)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
eval "$(bash bench/device_setup.sh)"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
MODEL=/dev/shm/qwen3-30b-a3b.gguf
python3 -m tandem.cli.main synth --like qwen3-30b-a3b -o "$MODEL" --overwrite >"$OUT/synth.log" 2>&1 &
synth=$!
if [[ "${TESTS:-}" != none ]]; then
  python3 -m pytest -m gpu -q -p no:cacheprovider -rA -o addopts="" ${TESTS:-tests/test_gpu*.py} \
      >"$OUT/pytest_gpu.log" 2>&1
  grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/pytest_gpu.log" | tail -40
fi
wait "$synth" || { echo "synth failed"; tail "$OUT/synth.log"; }
python3 bench/gpu_kernels.py 2>&1 | tee "$OUT/kernels.txt" | tail -12  # alone: a busy CPU delays launches
[[ "${PROBE:-0}" == 1 ]] && python3 bench/probe_host_memory.py "$MODEL" 2>&1 | tee "$OUT/probe.txt"
python3 bench/profile_step.py "$MODEL" -t "${THREADS:-16}" --placements "${PLACEMENTS:-cpu-moe,all}" \
    --trace "$OUT/trace.txt" >"$OUT/profile.txt" 2>&1
grep -E "^==|^   |Error" "$OUT/profile.txt" | head -40
echo "== summary"
[[ -f "$OUT/pytest_gpu.log" ]] && grep -E "passed|failed" "$OUT/pytest_gpu.log" | tail -1
sed -n '/^== summary/,$p' "$OUT/profile.txt" | tail -n +2
