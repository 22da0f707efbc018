#!/usr/bin/env bash
# Issue 21's bars on the GPU machine: experts placed one by one from routing statistics against whole layers and
# llama.cpp, on synthetic Qwen3-30B-A3B models with skewed routing (tandem synth --routing). Called by
# bench/device_compare.sh (HOT="static uniform drift") once llama.cpp is built; alone:
#
#   PY=python3 PEER_LIB=/tmp/llama_cpp_cuda MODEL_DIR=/dev/shm/m THREADS=16 bash bench/hot_experts.sh static
#
# Steps (each a word of the arguments, in this order; each bounded by HOT_STEP_S seconds):
#   static   zipf:1.0 model: routing statistics recorded first (an untimed run at the budget, --expert-stats),
#            then tandem bench --compare llamacpp over --n-cpu-moe $HOT_LAYERS (llama.cpp's best placement near
#            the budget: whole layers) and --cpu-moe, and tandem alone at --gpu-memory $HOT_BUDGET and
#            --cpu-moe --moe-cache $HOT_CACHE, both placed by the statistics
#   uniform  the plain (uniform-routing) model: --gpu-memory $HOT_BUDGET with statistics against without (whole
#            layers) and --n-cpu-moe $HOT_LAYERS
#   synth    make the models of the steps named after it (device_compare.sh runs it while llama.cpp builds)
#   drift    zipf:1.0,drift:4 model: tandem bench --drift (teacher-forced decode, the hot set moving every
#            $HOT_DRIFT tokens) with a placement fixed from phase 0's statistics, and with --moe-cache-refresh
# Every report lands in /tmp/hot/NAME (tables printed); the stats files beside the models.
set -uo pipefail

PY="${PY:-python3}"
MODEL_DIR="${MODEL_DIR:-/tmp/tandem-models}"
PEER_LIB="${PEER_LIB:-/tmp/llama_cpp_cuda}"
THREADS="${THREADS:-16}"
LIKE="${HOT_LIKE:-qwen3-30b-a3b}"
BUDGET="${HOT_BUDGET:-10GiB}"
CACHE="${HOT_CACHE:-8GiB}"
LAYERS="${HOT_LAYERS:-24}"
STEP_S="${HOT_STEP_S:-150}"
REPS="${HOT_REPS:-3}"
DRIFT="${HOT_DRIFT:-512}"
DRIFT_TG="${HOT_DRIFT_TG:-2048}"
REFRESH="${HOT_REFRESH:-16}"
work=/tmp/hot
mkdir -p "$work" "$MODEL_DIR"
t0=$(date +%s)
say() { echo "[hot $(( $(date +%s) - t0 ))s] $*"; }
tandem() { "$PY" -m tandem.cli.main "$@"; }

model() {  # model ROUTING -> the path, synthesised unless there (uniform: device_compare.sh's own file)
  local routing=$1 path="$MODEL_DIR/$LIKE-${1//[:,]/_}.gguf"
  [[ "$routing" == uniform ]] && path="$MODEL_DIR/$LIKE.gguf"
  if [[ ! -f "$path" ]]; then
    local args=()
    [[ "$routing" != uniform ]] && args=(--routing "$routing")
    tandem synth --like "$LIKE" -o "$path" "${args[@]}" --overwrite >"$work/synth_${routing//[:,]/_}.log" 2>&1 ||
      { say "synth $routing FAILED"; tail -5 "$work/synth_${routing//[:,]/_}.log"; return 1; }
  fi
  echo "$path"
}

bench() {  # bench NAME FLAGS...: tandem bench with a report, bounded; prints the report's table
  local name=$1
  shift
  timeout -s TERM -k 10 "$STEP_S" "$PY" -m tandem.cli.main bench --device cuda -t "$THREADS" --pp 512 --tg 128 \
    --reps "$REPS" --timeout "$((STEP_S - 15))" --budget "$((STEP_S - 15))" --report "$work/$name" "$@" \
    >"$work/$name.out" 2>&1
  say "$name: exit $? (tandem bench $*)"
  grep '^|' "$work/$name/report.md" 2>/dev/null || tail -5 "$work/$name.out"
}

record() {  # record MODEL STATS FLAGS...: an untimed run that counts the routing into STATS
  local m=$1 stats=$2
  shift 2
  rm -f "$stats"
  timeout -s TERM -k 10 "$STEP_S" "$PY" -m tandem.cli.main bench -m "$m" --device cuda -t "$THREADS" --pp 512 \
    --tg 256 --reps 1 --expert-stats "$stats" "$@" >"$stats.log" 2>&1
  say "statistics recorded into $(basename "$stats"): exit $? ($*)"
}

declare -A routing_of=([static]=zipf:1.0 [uniform]=uniform [drift]=zipf:1.0,drift:4)
if [[ "${1:-}" == synth ]]; then
  shift
  for step in "$@"; do
    [[ -n "${routing_of[$step]:-}" ]] && model "${routing_of[$step]}" >/dev/null && say "synth for $step: done"
  done
  exit 0
fi

for step in "$@"; do
  case $step in
    static)
      z=$(model "${routing_of[static]}") || continue
      say "static: $(basename "$z"), budget $BUDGET, cache $CACHE, llama.cpp's --n-cpu-moe $LAYERS"
      record "$z" "$z.stats" --gpu-memory "$BUDGET"
      bench zipf-layers -m "$z" --compare llamacpp --peer-lib "$PEER_LIB" --matrix "n-cpu-moe=$LAYERS,cpu-moe"
      bench zipf-budget -m "$z" --gpu-memory "$BUDGET" --expert-stats "$z.stats"
      bench zipf-cache -m "$z" --cpu-moe --moe-cache "$CACHE" --expert-stats "$z.stats"
      grep -h "gpu-memory\|moe-cache" "$work/zipf-budget.out" "$work/zipf-cache.out" | grep -i "cached\|whole" | head -4
      ;;
    uniform)
      u=$(model "${routing_of[uniform]}") || continue
      say "uniform: $(basename "$u")"
      record "$u" "$u.stats" --gpu-memory "$BUDGET"
      bench uniform-stats -m "$u" --gpu-memory "$BUDGET" --expert-stats "$u.stats"
      bench uniform-layers -m "$u" --gpu-memory "$BUDGET"
      ;;
    drift)
      d=$(model "${routing_of[drift]}") || continue
      say "drift: $(basename "$d"), a new phase every $DRIFT tokens, $DRIFT_TG tokens"
      # phase 0 throughout (--drift >= --tg): the statistics of a placement fixed for the text's start
      rm -f "$d.stats"
      timeout -s TERM -k 10 "$STEP_S" "$PY" -m tandem.cli.main bench -m "$d" --device cuda -t "$THREADS" \
        --cpu-moe --moe-cache "$CACHE" --expert-stats "$d.stats" --pp 128 --tg 512 --drift 512 --reps 1 \
        >"$d.stats.log" 2>&1
      say "phase-0 statistics: exit $?"
      for mode in static refresh; do
        flags=(--expert-stats "$d.stats")
        [[ $mode == refresh ]] && flags+=(--moe-cache-refresh "$REFRESH")
        cp "$d.stats" "$d.$mode.stats" 2>/dev/null && flags[1]="$d.$mode.stats"  # each run adds to its own copy
        timeout -s TERM -k 10 "$STEP_S" "$PY" -m tandem.cli.main bench -m "$d" --device cuda -t "$THREADS" \
          --cpu-moe --moe-cache "$CACHE" "${flags[@]}" --pp 128 --tg "$DRIFT_TG" --drift "$DRIFT" --reps 1 \
          >"$work/drift-$mode.out" 2>&1
        say "drift $mode: exit $? (--cpu-moe --moe-cache $CACHE ${flags[*]:2})"
        grep -vE "Warning|warn\(" "$work/drift-$mode.out" | tail -40
      done
      ;;
    *) say "unknown step '$step' (static, uniform, drift)" ;;
  esac
done
