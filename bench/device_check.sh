#!/usr/bin/env bash
# One device call for tandem alone: set up, run the GPU test suite, time the kernels, and profile prefill and
# decode on synthetic models (Q4_K_M mix) per placement (bench/profile_step.py), with one decode step's
# kernels in order ($OUT/trace.txt). Logs go to $OUT; a short summary is printed last. For the side-by-side
# with llama.cpp, see bench/device_compare.sh.
#   MODELS="qwen3-30b-a3b qwen3.6-35b-a3b"  (synth presets, profiled one after the other)
#   PLACEMENTS=cpu-moe,n-cpu-moe-24,all (also cpu-moe-in-order: the host ops without flags, and
#     cpu-moe-repacked: with --repack-experts, to A/B them)  TESTS="tests/test_gpu.py ..." (default: tests/test_gpu*.py; none: skip)
#   CPU_TESTS="tests/test_ggml_weights.py tests/test_synth.py" (CPU tests too, on the device's CPU: ggml picks its
#     kernels by CPU, e.g. the repacked ones)
#   THREADS=16  PROBE=1 (also bench/probe_host_memory.py: the host-to-GPU copy paths)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
eval "$(bash bench/device_setup.sh)"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
read -r -a models <<<"${MODELS:-qwen3-30b-a3b}"
synth_all() {  # one after the other, while the GPU tests run (the profiles come after: nothing timed meanwhile)
  for m in "${models[@]}"; do
    python3 -m tandem.cli.main synth --like "$m" -o "/dev/shm/$m.gguf" --overwrite >>"$OUT/synth.log" 2>&1 ||
      echo "synth $m failed"
  done
}
synth_all &
synth_pid=$!
if [[ "${TESTS:-}" != none ]]; then
  python3 -m pytest -m gpu -q -p no:cacheprovider -rA -o addopts="" ${TESTS:-tests/test_gpu*.py} \
      >"$OUT/pytest_gpu.log" 2>&1
  grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/pytest_gpu.log" | tail -40
fi
if [[ -n "${CPU_TESTS:-}" ]]; then  # CPU tests on this machine's CPU (its ggml kernels can differ from CI's)
  python3 -m pytest -q -p no:cacheprovider -rA -o addopts="" -m "not gpu" ${CPU_TESTS} >"$OUT/pytest_cpu.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_cpu.log" | tail -20
fi
wait "$synth_pid"
python3 bench/gpu_kernels.py 2>&1 | tee "$OUT/kernels.txt" | tail -12  # alone: a busy CPU delays launches
for k in "${!models[@]}"; do
  model=/dev/shm/${models[$k]}.gguf
  [[ -f "$model" ]] || { echo "no $model"; continue; }
  [[ "${PROBE:-0}" == 1 && $k == 0 ]] && python3 bench/probe_host_memory.py "$model" 2>&1 | tee "$OUT/probe.txt"
  echo "== model ${models[$k]}" | tee -a "$OUT/profile.txt" >>"$OUT/trace.txt"
  python3 bench/profile_step.py "$model" -t "${THREADS:-16}" --placements "${PLACEMENTS:-cpu-moe,all}" \
      --trace "$OUT/trace.txt" >>"$OUT/profile.txt" 2>&1
  rm -f "$model"
done
grep -E "^==|^   |Error" "$OUT/profile.txt" | head -60
echo "== summary"
[[ -f "$OUT/pytest_gpu.log" ]] && grep -E "passed|failed" "$OUT/pytest_gpu.log" | tail -1
[[ -f "$OUT/pytest_cpu.log" ]] && grep -E "passed|failed" "$OUT/pytest_cpu.log" | tail -1
grep -E "^== model|^[a-z0-9-]+: pp|^   decode step" "$OUT/profile.txt"
