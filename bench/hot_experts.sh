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
#            --cpu-moe --moe-cache $HOT_CACHE, both placed by the statistics (each run its own copy of them),
#            and at the budget with --moe-cache-refresh $HOT_REFRESH
#   uniform  the plain (uniform-routing) model: --gpu-memory $HOT_BUDGET with statistics against without (whole
#            layers), and with statistics and --moe-cache-refresh $HOT_REFRESH; --cpu-moe --moe-cache $HOT_CACHE
#            with statistics against --cpu-moe
#   synth    make the models of the steps named after it and record their routing statistics (untimed, so
#            device_compare.sh runs it while llama.cpp builds)
#   drift    zipf:1.0,drift:4 model: tandem bench --drift (teacher-forced decode, the hot set moving every
#            $HOT_DRIFT tokens) with a placement fixed from phase 0's statistics, and with --moe-cache-refresh
#   long     the plain model at --gpu-memory $HOT_BUDGET with a prompt of HOT_LONG_PP (4096) tokens, longer than -b:
#            its later chunks' masked attention, whose peak VRAM (the report's, the driver's) the budget must hold
# Every report lands in /tmp/hot/NAME (tables printed); the stats files beside the models. A run that ended well
# with its whole HOT_STEP_S (an earlier call on the same warm machine) is not run again (`bounded`), nor a recording
# whose statistics file exists: a call cut short is resumed by the next. HOT_DEADLINE (seconds since the epoch) bounds
# every run: one that would end after it is cut to fit, or skipped when under HOT_MIN_S (60) seconds are left.
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
DEADLINE="${HOT_DEADLINE:-}"
MIN_S="${HOT_MIN_S:-60}"
LONG_PP="${HOT_LONG_PP:-4096}"
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

limit() {  # limit -> seconds a run may take now: HOT_STEP_S, or less before HOT_DEADLINE; fails under HOT_MIN_S
  local s=$STEP_S
  [[ -n "$DEADLINE" ]] && (( DEADLINE - $(date +%s) < s )) && s=$(( DEADLINE - $(date +%s) ))
  (( s >= MIN_S )) && echo "$s"
}

bounded() {  # bounded NAME FUNCTION ARGS...: FUNCTION ARGS (it may read $s: its seconds) into $work/NAME.out,
  # within limit; not again once it ended well with its whole HOT_STEP_S (NAME.done: a run cut short by the deadline
  # runs again in the next call)
  local name=$1 s rc
  shift
  if [[ -f "$work/$name.done" ]]; then
    say "$name: done in an earlier call"
    return 0
  fi
  s=$(limit) || { say "$name: no time left"; return 1; }
  "$@" >"$work/$name.out" 2>&1
  rc=$?
  (( rc == 0 && s == STEP_S )) && touch "$work/$name.done"
  say "$name: exit $rc in $s s at most (${*:2})"
}

timed() { timeout -s TERM -k 10 "$s" "$PY" -m tandem.cli.main "$@"; }  # within bounded's $s

timed_bench() {  # tandem bench pp512 / tg128, its own bounds inside bounded's $s
  timed bench --device cuda -t "$THREADS" --pp 512 --tg 128 --reps "$REPS" --timeout "$((s - 15))" \
    --budget "$((s - 15))" "$@"
}

bench() {  # bench NAME FLAGS...: tandem bench with a report, bounded; prints the report's table
  local name=$1
  shift
  bounded "$name" timed_bench --report "$work/$name" "$@" || return
  grep '^|' "$work/$name/report.md" 2>/dev/null || tail -5 "$work/$name.out"
}

record() {  # record MODEL STATS FLAGS...: an untimed run that counts the routing into STATS (unless it exists)
  local m=$1 stats=$2 s
  shift 2
  [[ -s "$stats" ]] && { say "statistics $(basename "$stats"): recorded earlier"; summary "$stats"; return; }
  s=$(limit) || { say "statistics $(basename "$stats"): no time left"; return 1; }
  # --seed: other texts than the timed runs' (seeds 0, 1, ...), each into a half of the file of its own
  timeout -s TERM -k 10 "$s" "$PY" -m tandem.cli.main bench -m "$m" --device cuda -t "$THREADS" "$@" \
    --seed 1000 --expert-stats "$stats.part" >"$stats.log" 2>&1
  local rc=$?
  (( rc == 0 )) && mv "$stats.part" "$stats"
  say "statistics recorded into $(basename "$stats"): exit $rc ($*)"
  (( rc == 0 )) || { tail -3 "$stats.log"; return 1; }
  summary "$stats"
}

summary() {  # summary STATS: per layer, the picks counted and the share of the 10 % most picked experts
  cp "$1" "$work/" 2>/dev/null
  "$PY" - "$1" <<'PY'
import json, sys
import numpy as np
c = np.asarray(json.load(open(sys.argv[1]))["counts"], dtype=float)
picks = c.sum(1)
top = max(1, c.shape[1] // 10)
share = np.sort(c, 1)[:, ::-1][:, :top].sum(1) / np.maximum(picks, 1)
print(f"  {c.shape[0]} layers: picks per layer {picks.min():.0f}..{picks.max():.0f}, layers with none "
      f"{np.flatnonzero(picks == 0).tolist()}; the top {top} experts' share per layer {share.min():.2f}.."
      f"{share.max():.2f} (uniform {top / c.shape[1]:.2f})")
PY
}

own() {  # own STATS NAME -> a copy of STATS for run NAME: each timed run reads the recording alone (a run adds its
  # own texts to the file it reads, which the next run's placement would then be fitted on)
  cp "$1" "$1.$2" && echo "$1.$2"
}

declare -A routing_of=([static]=zipf:1.0 [uniform]=uniform [drift]=zipf:1.0,drift:4)
statistics() {  # statistics STEP MODEL: the routing statistics that STEP's placements read, recorded once
  case $1 in
    # five texts (a warm-up's and four repetitions'): a random text routes with a hot set of its own around the
    # model's law (docs/synth.md), and the placement trusts what the file's two halves of texts agree on
    # (placement/experts.py estimated_shares)
    static|uniform) record "$2" "$2.stats" --gpu-memory "$BUDGET" --pp 512 --tg 256 --reps 4 ;;
    # phase 0 throughout (--drift >= --tg): the statistics of a placement fixed for the text's start
    drift) record "$2" "$2.stats" --cpu-moe --moe-cache "$CACHE" --pp 128 --tg 512 --drift 512 --reps 2 ;;
  esac
}

if [[ "${1:-}" == synth ]]; then
  shift
  for step in "$@"; do
    [[ -n "${routing_of[$step]:-}" ]] || continue
    m=$(model "${routing_of[$step]}") && say "synth for $step: done" && statistics "$step" "$m"
  done
  exit 0
fi

for step in "$@"; do
  case $step in
    static)
      z=$(model "${routing_of[static]}") || continue
      say "static: $(basename "$z"), budget $BUDGET, cache $CACHE, llama.cpp's --n-cpu-moe $LAYERS"
      statistics static "$z" && recorded=1 || recorded=0
      bench zipf-layers -m "$z" --compare llamacpp --peer-lib "$PEER_LIB" --matrix "n-cpu-moe=$LAYERS,cpu-moe"
      (( recorded )) || continue  # placed by statistics only when they were recorded
      bench zipf-budget -m "$z" --gpu-memory "$BUDGET" --expert-stats "$(own "$z.stats" budget)"
      bench zipf-cache -m "$z" --cpu-moe --moe-cache "$CACHE" --expert-stats "$(own "$z.stats" cache)"
      # the budget's cache re-placed online too: it follows each text's own hot set (bench/refresh_replay.py)
      bench zipf-budget-refresh -m "$z" --gpu-memory "$BUDGET" --expert-stats "$(own "$z.stats" refresh)" \
        --moe-cache-refresh "$REFRESH"
      grep -h "gpu-memory\|moe-cache" "$work"/zipf-{budget,cache}.out | grep -i "cached\|whole" | head -4
      ;;
    uniform)
      u=$(model "${routing_of[uniform]}") || continue
      say "uniform: $(basename "$u")"
      statistics uniform "$u" && bench uniform-stats -m "$u" --gpu-memory "$BUDGET" --expert-stats "$(own "$u.stats" run)"
      bench uniform-layers -m "$u" --gpu-memory "$BUDGET"
      statistics uniform "$u" && bench uniform-refresh -m "$u" --gpu-memory "$BUDGET" \
        --expert-stats "$(own "$u.stats" refresh)" --moe-cache-refresh "$REFRESH"
      bench uniform-cpu-moe -m "$u" --cpu-moe
      statistics uniform "$u" && bench uniform-cache -m "$u" --cpu-moe --moe-cache "$CACHE" \
        --expert-stats "$(own "$u.stats" cache)"
      grep -h "gpu-memory\|moe-cache" "$work"/uniform-{stats,layers,refresh,cache}.out | grep -i "whole\|cached" | head -8
      ;;
    drift)
      d=$(model "${routing_of[drift]}") || continue
      say "drift: $(basename "$d"), a new phase every $DRIFT tokens, $DRIFT_TG tokens"
      statistics drift "$d" || continue
      for mode in static refresh; do
        cp "$d.stats" "$d.$mode.stats" 2>/dev/null
        flags=(--expert-stats "$d.$mode.stats")  # each run adds to its own copy of phase 0's
        [[ $mode == refresh ]] && flags+=(--moe-cache-refresh "$REFRESH")
        bounded "drift-$mode" timed bench -m "$d" --device cuda -t "$THREADS" --cpu-moe --moe-cache "$CACHE" \
          "${flags[@]}" --pp 128 --tg "$DRIFT_TG" --drift "$DRIFT" --reps 1 || continue
        grep -vE "Warning|warn\(" "$work/drift-$mode.out" | tail -40
      done
      ;;
    long)
      u=$(model "${routing_of[uniform]}") || continue
      say "long: a prompt of $LONG_PP tokens (chunks of -b 512 after the first) at --gpu-memory $BUDGET"
      bounded long-prompt timed bench -m "$u" --device cuda -t "$THREADS" --gpu-memory "$BUDGET" \
        -c "$((LONG_PP + 64))" --pp "$LONG_PP" --tg 16 --reps 1 --report "$work/long-prompt" || continue
      grep '^|' "$work/long-prompt/report.md" 2>/dev/null || tail -5 "$work/long-prompt.out"
      ;;
    *) say "unknown step '$step' (static, uniform, drift, long)" ;;
  esac
done
