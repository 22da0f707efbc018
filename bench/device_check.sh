#!/usr/bin/env bash
# One device call: set up, run the GPU test suite, time the kernels, and bench tandem on a synthetic
# Qwen3-30B-A3B (Q4_K_M mix) in three placements. Prints a short table last. Logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
eval "$(bash bench/device_setup.sh)"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -m pytest -m gpu -q -p no:cacheprovider -rA tests/test_gpu.py 2>&1 | tee "$OUT/pytest_gpu.log" | grep -E "passed|failed|error|relative" | tail -25
python3 bench/gpu_kernels.py 2>&1 | tee "$OUT/kernels.txt"
MODEL=/tmp/qwen3-30b-a3b.gguf
/usr/bin/time -f "synth %e s" python3 -m tandem.cli.main synth --like qwen3-30b-a3b -o "$MODEL" 2>&1 | tail -2
ls -la "$MODEL"
python3 bench/profile_decode.py "$MODEL" --cpu-moe 2>&1 | tee "$OUT/profile_cpu_moe.txt" | grep -E "ms/token"
python3 bench/profile_decode.py "$MODEL" 2>&1 | tee "$OUT/profile_gpu.txt" | grep -E "ms/token"
for flags in "--cpu-moe" "--n-cpu-moe 24" ""; do
    echo "== tandem bench $flags"
    python3 -m tandem.cli.main bench -m "$MODEL" --device cuda $flags --pp 512 --tg 128 --reps 2 -c 1024 \
        -t 16 --json > "$OUT/bench_${flags// /_}.json" 2> "$OUT/bench_${flags// /_}.err"
    tail -3 "$OUT/bench_${flags// /_}.err"
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(r['pp_tok_s'], r['tg_tok_s'])" "$OUT/bench_${flags// /_}.json"
done
