#!/usr/bin/env bash
# tandem vs llama.cpp on the GPU machine, in ONE device call of under 10 minutes:
#   1. install the carried wheels, build ggml-python (tandem's CPU kernels), then llama-cpp-python with CUDA
#      for sm_90 (scripts/build_llamacpp.sh --cuda) in the background, about 5 minutes. Meanwhile, nothing
#      measured: synthesise the models (`tandem synth --like MODEL`, ~16 s each; all of them when the model
#      folder has room), run the GPU tests (GPU_TESTS=1), and fill Triton's autotuning cache with one short
#      untimed tandem run per model on a 6-layer copy (PREWARM, see below) while the build still runs;
#   2. per model: `tandem bench --compare llamacpp` over the placement matrix (--cpu-moe, --n-cpu-moe half
#      the layers, all on the GPU), then delete the model;
#   3. the reports land in $OUT/MODEL/report.{json,md,png}, the log in $OUT/device_compare.log (8 files at
#      most: what comes back from $OUT is at most 8 files, two folders deep). The last lines printed are the
#      summary: each model's table from its report.md (engine x placement: pp, tg, VRAM, ratio).
#
# Prepare here first:  bench/prepare_device.sh   (stages .peers/ and .whl/)
# Device call:         run(command="bash bench/device_compare.sh", carry=[".whl", ".peers"], timeout_s=600)
#   A call carries at most 64 MiB (the tree ~12 MB, .peers ~34 MB, .whl ~20 MB: together over it). Carry what the
#   call runs: the GPU tests alone (LLAMA=0) need .whl (transformers) and .peers/llama_cpp_python-*.tar.xz (ggml-python
#   is built from it); benches without HTTP need .peers and .whl less the server's wheels.
#
# Time (default: 2 models x 3 placements x 2 engines x 3 reps, pp 512, tg 128, in DEADLINE_S=570 s): the
# build ends at about 200 s; the benches share what is left, each model an equal part of what remains when
# it starts (tandem bench --budget). Two worker processes per engine x placement, tandem, llama.cpp, llama.cpp,
# tandem (each loads and warms up once, then times 2 and 1 of the 3 repetitions); every row gets its first
# repetition before any row runs into the time the others need (see src/tandem/bench/compare.py). A tandem process pays Triton's
# autotuning in its warm-up unless the cache has it (TRITON_CACHE_AUTOTUNING=1, filled by PREWARM): some
# 20-40 s per process saved. --timeout (per repetition) and --budget cut what overstays; it is reported.
# Measured (2026-11-30): with the FlashAttention kernels skipped (the default, see LLAMA_CMAKE_EXTRA) the
# llama.cpp build takes 191 s and one model's six rows 73 s: a whole qwen3-30b-a3b call took 268 s (10:52).
# Two models with six rows each and a third with four fit one call (~450 s) without GPU_TESTS. With the build
# carried from an earlier call (SAVE_LLAMA=1, LLAMA_BUNDLE): both default models' full matrix, 3 reps each, in 305 s
# (13:53; setup 31 s, pre-warm 68 s, ~100 s per model). The GPU tests
# (122) take ~160 s alone and 284 s beside the build (10:46), and the benches wait for them: with GPU_TESTS=1
# run one model per call.
#
# Knobs (environment):
#   MODELS="qwen3-30b-a3b qwen3.6-35b-a3b"  synth presets, each optionally NAME:MATRIX (its own matrix, e.g.
#     gemma4-26b-a4b:cpu-moe,all);  MODEL_FILES="a.gguf b.gguf" uses files instead
#   MATRIX=cpu-moe,n-cpu-moe=half,all  PP=512 (e.g. 512,2048: more time)  TG=128  REPS=3  THREADS=16  DEVICE=cuda
#   PROCESS_REPS=K (tandem bench --process-reps: K repetitions per worker process, the engines taking turns in
#     as many rounds as REPS needs; default: two processes per engine)
#   LAYERS=N (synth only the first N layers: quick tries)  DEADLINE_S=570 (seconds after start, all included)
#   SKIP_SETUP=1 (use this machine's python as it is: dry runs on a CPU machine, with DEVICE=cpu)
#   PEER_LIB=DIR (llama-cpp-python install; default: built into /tmp/llama_cpp_cuda)  OUT (default ./out)
#   GPU_TESTS=1 (run `pytest -m gpu` while llama.cpp builds; its results and failures in the log and its whole log in
#     $OUT/pytest_gpu.log; or a list of test files, e.g. GPU_TESTS="tests/test_gpu_offload.py", to run those only;
#     GPU_TESTS_S=420 bounds it: the whole suite took ~400 s beside the llama.cpp build on 2026-12-01, 352 s alone
#     on 2026-12-02; GPU_TESTS_WORKERS=N spreads the test files over N pytest-xdist processes sharing the GPU, then
#     runs the tests that time an overlap alone)
#   PREWARM=1 (default; 0: off) per preset, a 6-layer copy (`synth --layers 6`) run once untimed (`tandem bench
#     --matrix n-cpu-moe=half --tg 4 --reps 1`), the presets one after the other once the first model is made:
#     Triton's compiles and autotuning are per kernel and shape, so the cache then serves the full models
#     (not with MODEL_FILES). Full-size prewarms took 255 s for three models at 11:46; side by side, the
#     6-layer ones tuned under load (see the comment at PREWARM below).
#   LLAMA=0 (no llama.cpp at all: a call that only runs the GPU tests)
#   LLAMA_JOBS=16 (the llama.cpp build's parallel jobs)
#   LLAMA_BUILD_ARGS=--no-amx (if llama.cpp's CPU kernels die with SIGILL there, as on the dev machines)
#   LLAMA_CMAKE_EXTRA (default -DGGML_CUDA_FA=OFF: skip the FlashAttention kernels, ~80 of the CUDA files; the
#     comparison runs llama.cpp with flash attention off, llama-cpp-python's default, so they are never used
#     and the path measured is the same as a full build's; set it empty for a full build)
#   SAVE_LLAMA=1 (after the build: pack it into $OUT as llama_cpp_cuda.tar.xz.part-NN, 15 MiB parts; copy those to
#     .peers/ here and later calls unpack them in seconds instead of building for 190-270 s; the parts count
#     against what comes back, 8 files and 64 MiB, so save in a call with one model)
#   LLAMA_BUNDLE (default .peers/llama_cpp_cuda.tar.xz.part-): the carried build's parts; used when they exist
#     and import on this machine, else llama.cpp is built as usual
#   BENCH_FLAGS="--repack-experts" (more flags for `tandem bench`: tandem's own options, e.g. its repacked CPU
#     experts; the report's command line shows them)
#   GGML_OWN=1 (tandem's ggml-python with its own ggml 0.15.3, not the 0.25.3 of llama.cpp's tree that
#     scripts/build_ggml_python.sh builds it around by default)  GGML_VERSIONS=1 (before the benches: bench/ggml_versions.py, one
#     decode step's expert products per model through tandem's ggml and llama.cpp's, same graph and threads, for
#     each step size of GGML_VERSIONS_TOKENS="1 16" (default 1): a batched step of 16 sequences reads ~82 experts)
#   AB="ggml15 ggml15+repack t15" (after each model's comparison: tandem alone over the --cpu-moe row, or the rows
#     of AB_MATRIX (e.g. all), once per variant, in the same call, its table in the log: `ggml15` runs on ggml-python
#     with its own ggml 0.15.3 (built beside the usual one; bench/ggml_versions.py then times it too),
#     `+repack` adds --repack-experts, `pcieK` --pcie-experts K (after BENCH_FLAGS: it wins), `tNN` uses NN threads,
#     `noamx` sets TANDEM_AMX=0 (a CPU model's matrices not in ggml's AMX buffer, where tandem puts them by default on
#     an AMX CPU, as llama.cpp's build holds them), `fa` sets TANDEM_CPU_FLASH_ATTN=1 (flash attention, the CPU
#     graphs' default with an f16 cache, forced), `nofa` =0 (llama.cpp's -fa off graph),
#     `tree-NAME` imports tandem from ab/NAME/src: another
#     branch's src/ copied there, untracked, which the device call carries with the working tree; `patch-NAME`
#     imports it from a copy of src/ with ab/NAME.patch applied (`git diff -- src > ab/NAME.patch`): a
#     few KiB to carry where a tree's 1.3 MB would not fit beside the llama.cpp archive and the wheels)
#   FIDELITY=1 (after the build, before the benches: scripts/fidelity.py, tandem's GPU settings and llama.cpp's CUDA
#     defaults against transformers on the tiny models, --record: tests/fixtures/fidelity_llamacpp_cuda.json comes
#     back in $OUT; FIDELITY_SETTINGS picks tandem's settings). MODELS=" " runs no bench.
#   HANDOFF=1 (before the benches: bench/handoff.py, what one hand-off between the captured step and a host op
#     costs, with flags and in order)
#   BATCHED="1,4,16" (after each model's matrix (which then takes half of its time), with HTTP's placements
#     sharing the rest: bench/batched_compare.py, tandem's engine with N sequences at once
#     against llama-batched-bench, per placement of BATCHED_PLACEMENTS="cpu-moe all", pp BATCHED_PP=128, tg
#     BATCHED_TG=64, tandem's repetitions BATCHED_REPS=3, each engine bounded by 2/3 of the placement's time; the tables in the log; a placement NAME+pcieK gives tandem --pcie-experts K as well (NAME+repack: --repack-experts), which
#     llama.cpp has no form of; +ggml runs tandem with TANDEM_MOE_KERNEL=ggml: its CPU experts all by ggml's
#     graph, not tandem's kernel, e.g. BATCHED_PLACEMENTS="cpu-moe cpu-moe+ggml"; +patch-NAME runs tandem from src/
#     with ab/NAME.patch applied, as AB's patch-NAME: e.g. "all all+patch-before", the same work before a change,
#     same call). MATRIX=none skips the matrix.
#   MOE_KERNEL=1 (per model, before its benches: bench/moe_kernel.py, one layer's CPU experts by ggml's graph and by
#     tandem's kernel at 1-256 tokens, THREADS threads, layers MOE_KERNEL_LAYERS=0,1,2)
#   HTTP="1,4,16" (after BATCHED: bench/http_bench.py, `tandem serve` against llama-server over HTTP, N concurrent
#     streamed completions, per placement of HTTP_PLACEMENTS="cpu-moe all" (NAME+pcieK as BATCHED's), prompt
#     HTTP_PP=128 tokens, HTTP_TG=64 tokens each, HTTP_REPS=2 rounds per N and server, HTTP_TANDEM_FLAGS for tandem
#     serve alone (e.g. "-b 2048 -ub 512", llama-server's defaults); the table in the log. tandem serve needs fastapi, starlette,
#     uvicorn and pydantic, which the device image lacks: carry their wheels in .whl/, else llama-server runs alone)
#   The llama.cpp tools of BATCHED and HTTP (llama-batched-bench, llama-server) are built thin, in the background
#     once get_llama's libraries are there: scripts/build_llamacpp_tools.sh --shared-libs $PEER_LIB compiles only
#     the tools (~125 files, no CUDA) and links them to that CUDA build, so they run with its kernels (the carried
#     bundle has no flash-attention kernels: the tools' `-fa auto` then turns it off). LLAMA_TOOLS=DIR (default
#     /tmp/llama_tools): where they go, or, built already (e.g. SKIP_SETUP=1 dry runs), where DIR/bin has them.
#   EXPERT_KERNELS=1 (while the build runs: bench/expert_kernels.py, the selected-expert products of a decode
#     batch by `_qmv` and by `_grouped_qmm`, per batch size, and which one qmatmul_id picks; EXPERT_KERNELS_FLAGS
#     passes its options, e.g. "--tokens 1,4,16 --active 8")
#   PROFILE_BATCHED=16 (while the build runs, on the first model: bench/profile_batched.py, a decode step of that
#     many sequences and their prefill taken apart by GPU kernel, per PROFILE_BATCHED_PLACEMENTS=all,cpu-moe;
#     bounded by PROFILE_BATCHED_S=240; PROFILE_BATCHED_FLAGS=--host-ops times ggml's experts in the step and
#     alone, after the build, which would share the CPU)
#   VRAM_BREAKDOWN="cpu-moe cpu-moe+pcie3" (while the build runs, on the first model: bench/vram_breakdown.py per
#     placement (all, cpu-moe, NAME+pcieK), 16 sequences: the driver's memory against torch's and the plan's, stage
#     by stage, and torch's segments by the line that made them; VRAM_BREAKDOWN_FLAGS="--ctx 256 --batch 2048
#     --ubatch 512" as a server runs; a placement ending +fixed runs without torch's expandable segments, which
#     tandem asks for by default: runtime/devices.py)
#   VRAM_CONTEXT=1 (while the build runs, on the first model: bench/vram_context.py, the driver's memory after a
#     bare context, cuBLAS's first products and page-locking the model file's mapping)
#   HOT="static uniform drift long" (after the build: bench/hot_experts.sh, issue 21's bars on synthetic
#     qwen3-30b-a3b models with skewed routing, and the budget's peak VRAM with a prompt past -b; its models synthesised and their statistics recorded while
#     llama.cpp builds, or with a carried build each step's just before its runs; HOT_BUDGET=10GiB
#     HOT_CACHE=8GiB HOT_LAYERS=24 HOT_STEP_S=150 HOT_REPS=3, each run bounded by DEADLINE_S, see the script; its reports come back in $OUT/hot_reports.tar.gz). MODELS="qwen3-30b-a3b"
#     MATRIX=none runs it alone. A second call on the still-warm machine (the same command within ~30 s) finds the
#     build, the models (KEEP_MODELS=1 keeps them) and the steps done, and runs only what is left
#   TRACE=1 (while the build runs, on the first model: bench/profile_step.py over PROFILE_PLACEMENTS=cpu-moe,all,
#     its decode-step breakdown in the log and the GPU kernels of one decode step, in order, in $OUT/trace.txt;
#     PROFILE_FLAGS=--memory: instead, the CPU experts' speed with their bytes in different memory)
set -uo pipefail  # no -e: a failed step is logged and the report still written

t0=$(date +%s)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo=$PWD
OUT="${OUT:-$repo/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export TRITON_CACHE_AUTOTUNING="${TRITON_CACHE_AUTOTUNING:-1}"  # autotuning results kept across processes

MODELS="${MODELS:-qwen3-30b-a3b qwen3.6-35b-a3b}"
MATRIX="${MATRIX:-cpu-moe,n-cpu-moe=half,all}"
PP="${PP:-512}"
TG="${TG:-128}"
REPS="${REPS:-3}"
THREADS="${THREADS:-16}"
DEVICE="${DEVICE:-cuda}"
# DEVICE=cpu: both engines with the GPU hidden, so llama.cpp's CUDA build computes on its CPU backend (with the GPU
# visible it would still hand large batches to it)
hide_gpu=(env)
[[ "$DEVICE" == cpu ]] && hide_gpu+=(CUDA_VISIBLE_DEVICES=)
DEADLINE_S="${DEADLINE_S:-570}"
PROFILE_PLACEMENTS="${PROFILE_PLACEMENTS:-cpu-moe,all}"
PY="${PYTHON:-python3}"
SITE=/tmp/site
SITE_GGML15=/tmp/site_ggml15  # AB=ggml15...: ggml-python with its own ggml 0.15.3
PEER_LIB="${PEER_LIB:-/tmp/llama_cpp_cuda}"
export LLAMA_CMAKE_EXTRA="${LLAMA_CMAKE_EXTRA--DGGML_CUDA_FA=OFF}"  # read by scripts/build_llamacpp.sh
LLAMA_BUNDLE="${LLAMA_BUNDLE:-$repo/.peers/llama_cpp_cuda.tar.xz.part-}"  # parts NN of a carried build
LLAMA_TOOLS="${LLAMA_TOOLS:-/tmp/llama_tools}"  # BATCHED, HTTP: bin/llama-batched-bench, bin/llama-server

main() {  # the whole run; its output goes to the terminal and to $OUT/device_compare.log (see the end)
elapsed() { echo $(( $(date +%s) - t0 )); }
say() { echo "[$(elapsed)s] $*"; }

say "device_compare: models '${MODEL_FILES:-$MODELS}', matrix $MATRIX, pp $PP tg $TG reps $REPS threads $THREADS device $DEVICE"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null || say "nvidia-smi: none"

# -- 1. setup -----------------------------------------------------------------------------------------------
if [[ "${SKIP_SETUP:-0}" != 1 ]]; then
  mkdir -p "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl || say "wheel install FAILED"
  export PYTHONPATH="$SITE:$repo/src${PYTHONPATH:+:$PYTHONPATH}"
  # diskcache inside the peer's target too, so build_llamacpp.sh does not reach for the (absent) network.
  mkdir -p "$PEER_LIB"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$PEER_LIB" .whl/diskcache-*.whl
  get_llama() {  # a build carried from an earlier call (SAVE_LLAMA=1) when it imports here, else build it
    if compgen -G "$LLAMA_BUNDLE[0-9][0-9]" >/dev/null &&
        PYTHON="$PY" bash scripts/llamacpp_bundle.sh unpack "$LLAMA_BUNDLE" "$PEER_LIB"; then
      return 0
    fi
    TARBALL="$(ls "$repo"/.peers/llama_cpp_python-*.tar.xz 2>/dev/null | head -1)" PYTHON="$PY" JOBS="${LLAMA_JOBS:-16}" \
      SRC_CACHE=/tmp/llama_src bash scripts/build_llamacpp.sh --cuda ${LLAMA_BUILD_ARGS:-} --target "$PEER_LIB"
  }
  llama_pid=""
  if [[ "${LLAMA:-1}" == 0 ]]; then
    say "llama-cpp-python: not wanted (LLAMA=0)"
  elif compgen -G "$LLAMA_BUNDLE[0-9][0-9]" >/dev/null; then
    say "llama-cpp-python: unpacking the build carried in ${LLAMA_BUNDLE#"$repo"/}NN; ggml-python built side by side"
  else
    say "building llama-cpp-python (CUDA, sm_90) and ggml-python side by side"
  fi
  if [[ "${LLAMA:-1}" != 0 ]]; then
    get_llama >/tmp/llama_build.log 2>&1 &
    llama_pid=$!
  fi
  tools_pid=""
  if [[ "${LLAMA:-1}" != 0 && -n "${BATCHED:-}${HTTP:-}" && "$DEVICE" != cpu && ! -x "$LLAMA_TOOLS/bin/llama-server" ]]; then
    (  # once get_llama has ended (exited: a zombie until waited for, or gone), against the libraries it left
      while [[ -e /proc/$llama_pid && "$(awk '{print $3}' "/proc/$llama_pid/stat" 2>/dev/null)" != Z ]]; do sleep 1; done
      JOBS="${LLAMA_JOBS:-16}" bash scripts/build_llamacpp_tools.sh "$LLAMA_TOOLS" --shared-libs "$PEER_LIB"
    ) >/tmp/llama_tools.log 2>&1 &
    tools_pid=$!
  fi
  ab_pid=""
  if [[ "${AB:-}" == *ggml15* ]]; then  # the second ggml-python, for the AB variants, beside the first
    JOBS=4 PYTHON="$PY" bash scripts/build_ggml_python.sh --target "$SITE_GGML15" --own-ggml \
      >/tmp/ggml15_build.log 2>&1 &
    ab_pid=$!
  fi
  if ! "$PY" -c "import ggml" 2>/dev/null; then
    own=()
    [[ "${GGML_OWN:-0}" == 1 ]] && own=(--own-ggml)
    JOBS=4 PYTHON="$PY" bash scripts/build_ggml_python.sh --target "$SITE" "${own[@]}" >/tmp/ggml_build.log 2>&1 ||
      { say "ggml-python build FAILED"; tail -30 /tmp/ggml_build.log; }
  fi
  say "ggml-python: $("$PY" -c 'import ggml, os; print(os.path.dirname(ggml.__file__))' 2>&1 | tail -1)"
  if [[ -n "$ab_pid" ]]; then
    wait "$ab_pid" && say "ggml-python with its own ggml 0.15.3: $SITE_GGML15" ||
      { say "ggml-python (ggml 0.15.3) build FAILED"; tail -30 /tmp/ggml15_build.log; }
  fi
else
  export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}"
  llama_pid=""
fi

# Where the models go: RAM (tmpfs) when it has room for the largest, else /tmp.
MODEL_DIR="${MODEL_DIR:-}"
if [[ -z "$MODEL_DIR" ]]; then
  free_kb=$(df -Pk /dev/shm 2>/dev/null | awk 'NR==2 {print $4}')
  if [[ -n "$free_kb" && "$free_kb" -gt $((24 * 1024 * 1024)) ]]; then MODEL_DIR=/dev/shm/tandem-models; else MODEL_DIR=/tmp/tandem-models; fi
fi
mkdir -p "$MODEL_DIR"

synth() {  # synth PRESET -> prints the path (made now unless it was made while llama.cpp built)
  local name=$1 path="$MODEL_DIR/$1.gguf" layers=()
  [[ -n "${LAYERS:-}" ]] && layers=(--layers "$LAYERS")
  if [[ ! -f "$path" ]]; then
    "$PY" -m tandem.cli.main synth --like "$name" -o "$path" "${layers[@]}" --overwrite >/tmp/synth_"$name".log 2>&1 \
      || { say "synth $name FAILED" >&2; tail -20 /tmp/synth_"$name".log >&2; return 1; }
  fi
  echo "$path"
}

read -r -a models <<<"$MODELS"
read -r -a files <<<"${MODEL_FILES:-}"
building() { [[ -n "$llama_pid" ]] && kill -0 "$llama_pid" 2>/dev/null; }

early=()  # models made while llama.cpp builds: the first always, the others while the folder has room
if [[ ${#files[@]} -eq 0 ]]; then
  for m in "${models[@]%%:*}"; do
    free_kb=$(df -Pk "$MODEL_DIR" | awk 'NR==2 {print $4}')
    if (( ${#early[@]} > 0 )) && { ! building || (( free_kb < 30 * 1024 * 1024 )); }; then break; fi
    say "synth $m"
    synth "$m" >/dev/null && { say "synth $m: $(du -h "$MODEL_DIR/$m.gguf" | cut -f1)"; early+=("$MODEL_DIR/$m.gguf"); }
  done
fi
# Prewarm (untimed): Triton compiles and autotunes per kernel and shape, not per layer, so a copy of each
# preset with one layer of each kind fills the cache for the whole model: 6 layers hold Gemma 4's global layer
# (every 6th; with 2 layers its head-512 kernels were tuned in the timed warm-up, 16.8 s at 12:40) and
# Qwen3.5/3.6's full-attention layer (every 4th). One process per model with half the layers' experts on the
# CPU runs both the GPU-expert and the CPU-expert (streamed prefill) kernels. The models run ONE AFTER THE
# OTHER, after the synths: autotuning times each candidate on the GPU, and a busy CPU (two prewarms side by
# side, a synth) delays the launches it times, so the cache kept configurations picked under load (tandem's
# all-GPU pp512 on qwen3-30b-a3b: 6,370 tok/s at 10:52 with tuning in a quiet warm-up, 3,561-3,926 at 12:40
# and 13:53 with side-by-side prewarms). A llama.cpp build (no carried bundle) still runs beside them.
prewarm_pid=""
if [[ "${PREWARM:-1}" == 1 && "$DEVICE" != cpu && ${#files[@]} -eq 0 ]]; then
  (
    for m in "${models[@]%%:*}"; do
      small="$MODEL_DIR/prewarm-$m.gguf"
      "$PY" -m tandem.cli.main synth --like "$m" -o "$small" --layers 6 --overwrite >/tmp/prewarm_"$m".log 2>&1 &&
        "$PY" -m tandem.cli.main bench -m "$small" --device "$DEVICE" -t 4 --matrix n-cpu-moe=half \
          --pp "${PP%%,*}" --tg 4 --reps 1 >>/tmp/prewarm_"$m".log 2>&1
      rc=$?
      rm -f "$small"
      say "prewarm $m: exit $rc (untimed: fills Triton's cache)"
      (( rc == 0 )) || tail -5 /tmp/prewarm_"$m".log
    done
  ) &
  prewarm_pid=$!
  say "prewarm: ${#models[@]} models (6 layers each), one after the other"
fi
[[ -n "$prewarm_pid" ]] && wait "$prewarm_pid" && say "prewarm done"
hot_synth_pid=""
if [[ -n "${HOT:-}" && "$DEVICE" != cpu ]] && building; then  # the skewed models and their statistics, beside the build
  # after the prewarm: recording runs on the GPU, and autotuning beside another process's kernels would time both.
  # With a carried build there is nothing to hide them behind: each step then makes its own model and statistics
  # just before its runs, so that a call cut short still brings back the steps before it.
  PY="$PY" MODEL_DIR="$MODEL_DIR" THREADS="$THREADS" bash bench/hot_experts.sh synth $HOT &
  hot_synth_pid=$!
fi

# A BATCHED or HTTP placement's flags: pflags for both engines (cpu-moe, n-cpu-moe=N), tflags for tandem alone
# (NAME+pcieK: --pcie-experts K; NAME+repack: --repack-experts), which llama.cpp has no form of.
# tandem from a copy of src/ with ab/NAME.patch applied (`git diff -- src > ab/NAME.patch`): its path in $patched
patch_tree() {
  patched="/tmp/ab_patched_$1"
  rm -rf "$patched" && mkdir -p "$patched" && cp -r "$repo/src" "$patched/" &&
    patch -d "$patched" -p1 -s -t --no-backup-if-mismatch <"$repo/ab/$1.patch" && patched="$patched/src" ||
    { say "ab/$1.patch does not apply to src/"; return 1; }
}

placement_flags() {  # NAME[+pcieK|+repack][+ggml][+patch-P]: pflags (both engines), tflags (tandem's), penv (its run)
  pflags=() tflags="" penv=(env)
  local words="+${1#*+}+"  # the words after the placement's name, each between + signs (as AB's variants)
  [[ $1 == cpu-moe* ]] && pflags=(--cpu-moe)
  [[ $1 =~ ^n-cpu-moe=([0-9]+) ]] && pflags=(--n-cpu-moe "${BASH_REMATCH[1]}")
  [[ $words =~ \+pcie([0-9]+)\+ ]] && tflags="--pcie-experts ${BASH_REMATCH[1]}"
  [[ $words == *+repack+* ]] && tflags="--repack-experts"
  [[ $words == *+ggml+* ]] && penv+=(TANDEM_MOE_KERNEL=ggml)
  if [[ $words =~ \+patch-([A-Za-z0-9_.-]+)\+ ]]; then  # tandem from src/ with ab/NAME.patch applied
    patch_tree "${BASH_REMATCH[1]}" || return 1
    penv+=(PYTHONPATH="$patched:$PYTHONPATH")
  fi
  return 0
}

if [[ "${GPU_TESTS:-0}" != 0 ]]; then  # the GPU tests run while llama.cpp builds (nothing is timed then)
  gpu_tests=(tests)  # every module: GPU tests live beside their CPU twins (e.g. tests/test_fidelity.py)
  [[ "$GPU_TESTS" == 1 ]] || read -r -a gpu_tests <<<"$GPU_TESTS"
  say "pytest -m gpu ${gpu_tests[*]} (at most ${GPU_TESTS_S:-420} s)"
  # The log goes straight to $OUT and the run is bounded: a call that runs out of time still brings back what ran.
  pytest_gpu=("$PY" -m pytest -m gpu -q -p no:cacheprovider -rA -o addopts="")
  workers="${GPU_TESTS_WORKERS:-1}"
  if (( workers > 1 )); then  # files spread over worker processes on the one GPU; the timed tests alone after
    # they assert that work overlapped in time, or what the driver counts: another process's kernels or memory skew it
    serial="overlap or side_by_side or by_the_driver"
    timeout -k 10 "${GPU_TESTS_S:-420}" "${pytest_gpu[@]}" -n "$workers" --dist loadfile -k "not ($serial)" \
      "${gpu_tests[@]}" >"$OUT/pytest_gpu.log" 2>&1
    say "pytest -m gpu, $workers workers: exit $? ($(grep -E "passed|failed" "$OUT/pytest_gpu.log" | tail -1))"
    timeout -k 10 120 "${pytest_gpu[@]}" -k "$serial" "${gpu_tests[@]}" >>"$OUT/pytest_gpu.log" 2>&1
    say "pytest -m gpu -k '$serial', alone: exit $? ($(grep -E "passed|failed" "$OUT/pytest_gpu.log" | tail -1))"
  else
    timeout -k 10 "${GPU_TESTS_S:-420}" "${pytest_gpu[@]}" "${gpu_tests[@]}" >"$OUT/pytest_gpu.log" 2>&1
    say "pytest -m gpu: exit $? ($(grep -E "passed|failed" "$OUT/pytest_gpu.log" | tail -1))"
  fi
  ln -sf "$OUT/pytest_gpu.log" /tmp/pytest_gpu.log
  grep -E "^(PASSED|FAILED|ERROR)|relative L2" /tmp/pytest_gpu.log  # the whole log stays there: $OUT has room for 8 files
  # Each failure's header, its location and its E lines (a whole traceback would push the others out of the tail).
  grep -q "^FAILED" /tmp/pytest_gpu.log && sed -n '/= FAILURES =/,/= PASSES =/p' /tmp/pytest_gpu.log |
    grep -E '^_{3,} |^E  |^[A-Za-z0-9_/.-]+\.py:[0-9]+: ' | cut -c1-400 | head -60
fi

if [[ "${TRACE:-0}" == 1 && "$DEVICE" != cpu && ${#early[@]} -gt 0 ]]; then  # untimed: the kernel order only
  say "profile and kernel trace of one decode step ($PROFILE_PLACEMENTS), while the build runs"
  "$PY" bench/profile_step.py "${early[0]}" -t "$THREADS" --tg 8 --placements "$PROFILE_PLACEMENTS" \
    --trace "$OUT/trace.txt" ${PROFILE_FLAGS:-} >/tmp/trace_profile.log 2>&1 ||
    { say "profile FAILED"; tail -20 /tmp/trace_profile.log; }
  grep -E "^==|one decode step" "$OUT/trace.txt" 2>/dev/null
  grep -E "^== |^[a-z0-9-]+: pp|^   decode step|ggml expert FFN|^   round |^   after the copies" /tmp/trace_profile.log
fi

if [[ "${EXPERT_KERNELS:-0}" == 1 && "$DEVICE" != cpu ]]; then  # a few seconds: qmv against grouped per batch size
  say "selected-expert kernels at decode batch sizes (bench/expert_kernels.py)"
  "$PY" bench/expert_kernels.py ${EXPERT_KERNELS_FLAGS:-} 2>&1 | grep -vE "Warning|warn\(" | tail -300
fi

if [[ -n "${PROFILE_BATCHED:-}" && "$DEVICE" != cpu && ${#early[@]} -gt 0 ]]; then  # while the build runs
  if [[ "${PROFILE_BATCHED_FLAGS:-}" == *--host-ops* ]]; then while building; do sleep 2; done; fi
  say "profile of batched steps: ${PROFILE_BATCHED} sequences, ${PROFILE_BATCHED_PLACEMENTS:-all,cpu-moe}"
  timeout -k 10 "${PROFILE_BATCHED_S:-240}" "$PY" bench/profile_batched.py "${early[0]}" --seqs "$PROFILE_BATCHED" \
    --placements "${PROFILE_BATCHED_PLACEMENTS:-all,cpu-moe}" -t "$THREADS" ${PROFILE_BATCHED_FLAGS:-} \
    >/tmp/profile_batched.log 2>&1 ||
    say "profile_batched: exit $?"
  grep -vE "Warning|warn\(" /tmp/profile_batched.log | tail -120
fi

if [[ "${VRAM_CONTEXT:-0}" == 1 && "$DEVICE" != cpu && ${#early[@]} -gt 0 ]]; then  # while the build runs
  say "VRAM outside torch's allocator, piece by piece: bench/vram_context.py"
  timeout -k 10 60 "$PY" bench/vram_context.py "${early[0]}" 2>&1 | grep -vE "Warning|warn\(" | tail -12
fi

if [[ -n "${VRAM_BREAKDOWN:-}" && "$DEVICE" != cpu && ${#early[@]} -gt 0 ]]; then  # while the build runs
  for placement in $VRAM_BREAKDOWN; do
    flags=()
    [[ $placement == cpu-moe* ]] && flags=(--cpu-moe)
    [[ $placement =~ \+pcie([0-9]+) ]] && flags+=(--pcie-experts "${BASH_REMATCH[1]}")
    alloc="${PYTORCH_CUDA_ALLOC_CONF:-}"
    [[ $placement == *+fixed* ]] && alloc="expandable_segments:False"  # torch's own default, not tandem's
    say "VRAM breakdown $placement: bench/vram_breakdown.py ${flags[*]}"
    env ${alloc:+PYTORCH_CUDA_ALLOC_CONF="$alloc"} timeout -k 10 "${VRAM_BREAKDOWN_S:-120}" "$PY" \
      bench/vram_breakdown.py "${early[0]}" -t "$THREADS" "${flags[@]}" ${VRAM_BREAKDOWN_FLAGS:-} 2>&1 |
      grep -vE "Warning|warn\(" | tail -50
  done
fi

if [[ -n "$llama_pid" ]]; then
  wait "$llama_pid" && say "llama-cpp-python ready" || { say "llama-cpp-python build FAILED"; tail -40 /tmp/llama_build.log; }
  grep -E "built in|already in|unpacked in" /tmp/llama_build.log | tail -1
  if [[ "${SAVE_LLAMA:-0}" == 1 ]]; then  # for the next calls: carry the parts in .peers/ (see LLAMA_BUNDLE)
    bash scripts/llamacpp_bundle.sh pack "$PEER_LIB" "$OUT/$(basename "$LLAMA_BUNDLE")" >/dev/null &&
      say "saved the build: $(du -ch "$OUT/$(basename "$LLAMA_BUNDLE")"[0-9][0-9] | tail -1 | cut -f1) in $OUT"
  fi
fi

if [[ "${FIDELITY:-0}" == 1 && -d "$PEER_LIB/llama_cpp" ]]; then  # before the benches: nothing is timed
  say "fidelity: tandem's settings and llama.cpp's CUDA defaults against transformers (scripts/fidelity.py)"
  PYTHONPATH="$PYTHONPATH:$repo/tests" "$PY" scripts/fidelity.py --backend cuda --lib "$PEER_LIB" --record \
    --settings "${FIDELITY_SETTINGS:-gpu,gpu-cpu-moe,gpu-n-cpu-moe,gpu-f32,gpu-f32-f32kv}" --json "$OUT/fidelity.json" \
    >/tmp/fidelity.log 2>&1 || { say "fidelity FAILED"; tail -30 /tmp/fidelity.log; }
  grep -E "^(qwen|gpt|gemma)" /tmp/fidelity.log
  cp tests/fixtures/fidelity_llamacpp_cuda.json "$OUT/" 2>/dev/null
fi

if [[ -n "${HOT:-}" && "$DEVICE" != cpu ]]; then  # before the matrix; its steps bound themselves
  [[ -n "$hot_synth_pid" ]] && wait "$hot_synth_pid"
  HOT_DEADLINE="${HOT_DEADLINE:-$(( t0 + DEADLINE_S ))}" PY="$PY" MODEL_DIR="$MODEL_DIR" PEER_LIB="$PEER_LIB" \
    THREADS="$THREADS" bash bench/hot_experts.sh $HOT
  tar -C /tmp -czf "$OUT/hot_reports.tar.gz" hot 2>/dev/null  # every step's report and output, this call's and earlier
fi

if [[ "${GGML_VERSIONS:-0}" == 1 && -d "$PEER_LIB/llama_cpp/lib" ]]; then  # quiet machine: nothing else runs
  ggml_lib=$("$PY" -c 'import ggml, os; print(os.path.join(os.path.dirname(ggml.__file__), "lib"))')
  libs=(--lib "$ggml_lib")
  [[ -d "$SITE_GGML15/ggml/lib" ]] && libs+=(--lib "$SITE_GGML15/ggml/lib")
  for m in "${models[@]%%:*}"; do
    for tokens in ${GGML_VERSIONS_TOKENS:-1}; do
      "$PY" bench/ggml_versions.py --like "$m" --threads "$THREADS" --tokens "$tokens" "${libs[@]}" \
        --lib "$PEER_LIB/llama_cpp/lib" 2>&1 |
        sed "s|$ggml_lib|tandem's ggml-python|; s|$SITE_GGML15/ggml/lib|ggml-python on ggml 0.15.3|;
             s|$PEER_LIB/llama_cpp/lib|llama.cpp's ggml|"
    done
  done
fi

if [[ "${HANDOFF:-0}" == 1 && "$DEVICE" != cpu ]]; then  # quiet machine: nothing else runs
  "$PY" bench/handoff.py 2>&1 | tail -5
fi

# -- 2. the matrix, model by model --------------------------------------------------------------------------
targets=("${files[@]}")
[[ ${#files[@]} -eq 0 ]] && targets=("${models[@]}")
n_targets=${#targets[@]}
status=0
for k in "${!targets[@]}"; do
  target=${targets[$k]%%:*}
  matrix=$MATRIX
  [[ ${targets[$k]} == *:* ]] && matrix=${targets[$k]#*:}
  [[ "$DEVICE" == cpu && "$matrix" != none ]] && matrix=all  # one placement: the CPU's
  if [[ ${#files[@]} -eq 0 ]]; then
    [[ -f "$MODEL_DIR/$target.gguf" ]] || say "synth $target"
    model=$(synth "$target") || { status=1; continue; }
    name=$target
  else
    model=$target
    name=$(basename "$target" .gguf)
  fi
  left=$(( DEADLINE_S - $(elapsed) ))
  share=$(( left / (n_targets - k) ))
  if (( share < 30 )); then say "no time left for $name ($left s)"; status=1; continue; fi
  n_ab=$(wc -w <<<"${AB:-}")
  n_rows=$(( 2 * $(tr ',' '\n' <<<"$matrix" | wc -l) ))
  ab_share=$(( n_ab > 0 ? share * n_ab / (n_rows + n_ab) / n_ab : 0 ))  # each AB variant: one row's part
  share=$(( share - n_ab * ab_share ))
  budget=$(( share - 15 ))  # 15 s for the orchestrator's start and the report; `timeout` below is the hard stop
  batched_share=0 http_share=0
  if [[ -n "${BATCHED:-}${HTTP:-}" ]]; then  # the batched and HTTP comparisons take half of what this model has
    tools_share=$share
    [[ "$matrix" != none ]] && tools_share=$(( share / 2 ))
    share=$(( share - tools_share ))
    budget=$(( share - 15 ))
    if [[ -n "${BATCHED:-}" && -n "${HTTP:-}" ]]; then  # shared by their placements
      n_bp=$(wc -w <<<"${BATCHED_PLACEMENTS:-cpu-moe all}") n_hp=$(wc -w <<<"${HTTP_PLACEMENTS:-cpu-moe all}")
      batched_share=$(( tools_share * n_bp / (n_bp + n_hp) ))
    elif [[ -n "${BATCHED:-}" ]]; then batched_share=$tools_share; fi
    [[ -n "${HTTP:-}" ]] && http_share=$(( tools_share - batched_share ))
  fi
  if [[ "${MOE_KERNEL:-0}" == 1 ]]; then  # before the benches, on a quiet machine (the llama.cpp build is done)
    "$PY" bench/moe_kernel.py "$model" --layers "${MOE_KERNEL_LAYERS:-0,1,2}" --threads "$THREADS" 2>&1 | tail -30
  fi
  say "bench $name: $share s (budget $budget s)${AB:+; then $n_ab AB variants, $ab_share s each}"
  # --timeout is per repetition (the first also counts the load and warm-up): the budget bounds it anyway.
  if [[ "$matrix" != none ]]; then
    timeout -s TERM -k 10 "$share" "${hide_gpu[@]}" "$PY" -m tandem.cli.main bench -m "$model" --device "$DEVICE" \
      -t "$THREADS" --matrix "$matrix" --pp "$PP" --tg "$TG" --reps "$REPS" --compare llamacpp --peer-lib "$PEER_LIB" \
      --timeout "$budget" --budget "$budget" --report "$OUT/$name" ${PROCESS_REPS:+--process-reps "$PROCESS_REPS"} \
      ${BENCH_FLAGS:-} >"/tmp/bench_$name.out"
    rc=$?
    say "bench $name: exit $rc"
    (( rc == 0 )) || status=1
    [[ -f "$OUT/$name/report.md" ]] && cat "$OUT/$name/report.md"
  fi
  if [[ -n "${tools_pid:-}" ]]; then  # (none with SKIP_SETUP=1)
    wait "$tools_pid" && say "llama.cpp tools ready: $(tail -1 /tmp/llama_tools.log)" ||
      { say "llama.cpp tools (thin) build FAILED"; tail -20 /tmp/llama_tools.log; }
    tools_pid=""
  fi
  if [[ -n "${BATCHED:-}" ]]; then
    placements=(${BATCHED_PLACEMENTS:-cpu-moe all})
    for placement in "${placements[@]}"; do
      placement_flags "$placement" || { status=1; continue; }
      flags=("${pflags[@]}")
      part=$(( batched_share / ${#placements[@]} ))
      say "batched $name $placement: npl $BATCHED, $part s"
      timeout -s TERM -k 10 "$part" "${penv[@]}" "$PY" bench/batched_compare.py -m "$model" --npl "$BATCHED" \
        --pp "${BATCHED_PP:-128}" --tg "${BATCHED_TG:-64}" -t "$THREADS" --device "$DEVICE" "${flags[@]}" \
        --tandem-flags="$tflags" --reps "${BATCHED_REPS:-3}" \
        --llama-bin "$LLAMA_TOOLS/bin/llama-batched-bench" --timeout "$(( part * 2 / 3 ))" \
        --out "/tmp/batched_${name}_$placement" >"/tmp/batched_${name}_$placement.out" 2>&1
      say "batched $name $placement: exit $?"
      cat "/tmp/batched_${name}_$placement.out"
    done
  fi
  if [[ -n "${HTTP:-}" ]]; then  # both servers at once, taking turns (bench/http_bench.py); its table in the log
    servers=(--llama-server "$LLAMA_TOOLS/bin/llama-server")
    if why=$("$PY" -c "import fastapi, uvicorn" 2>&1); then
      servers+=(--tandem "$PY -m tandem.cli.main serve --device $DEVICE")
    else
      say "http: the server's stack does not import ($(tail -1 <<<"$why")), so no tandem serve (carry its wheels in" \
        ".whl/: bench/prepare_device.sh): llama-server alone"
    fi
    ngl=99
    [[ "$DEVICE" == cpu ]] && ngl=0
    placements=(${HTTP_PLACEMENTS:-cpu-moe all})
    for placement in "${placements[@]}"; do
      placement_flags "$placement" || { status=1; continue; }
      flags=(-t "$THREADS" "${pflags[@]}")
      tflags="$tflags ${HTTP_TANDEM_FLAGS:-}"  # e.g. "-b 2048 -ub 512", llama-server's own defaults
      tflags="${tflags## }" tflags="${tflags%% }"
      part=$(( http_share / ${#placements[@]} ))
      if (( part < 60 )); then say "http $name $placement: no time left ($part s)"; continue; fi
      say "http $name $placement: concurrency $HTTP, $part s"
      timeout -s TERM -k 20 "$part" "${penv[@]}" "$PY" bench/http_bench.py -m "$model" --concurrency "$HTTP" "${servers[@]}" \
        --prompt-tokens "${HTTP_PP:-128}" --max-tokens "${HTTP_TG:-64}" --reps "${HTTP_REPS:-2}" \
        --flags "${flags[*]}" --llama-flags "-ngl $ngl -lv 4" ${tflags:+--tandem-flags "$tflags"} --budget "$(( part - 25 ))" --start-timeout "$(( part / 3 ))" \
        --out "/tmp/http_${name}_$placement" >"/tmp/http_${name}_$placement.out" 2>&1
      say "http $name $placement: exit $?"
      cat "/tmp/http_${name}_$placement.out"
      # where each server's VRAM goes by its own account (llama-server's memory breakdown and buffers, printed at
      # -lv 4: its default verbosity leaves them out)
      grep -hE "memory_breakdown_print|buffer size|graph splits" \
        "/tmp/http_${name}_$placement"/server_*.log 2>/dev/null | cut -c1-300 | head -30
    done
  fi
  for variant in ${AB:-}; do  # tandem alone, --cpu-moe, once per variant (see AB above); the table in the log
    left=$ab_share  # a prewarmed row: ~25 s (load 2-3 s, warm-up 2-3 s, 3 reps of pp512 + tg128)
    if (( left < 25 )); then say "AB $name $variant: no time left ($left s)"; continue; fi
    flags=(-t "$THREADS") path="$PYTHONPATH"
    # each word of a variant (words joined by +) on its own: a tree or patch NAME may hold "t1" or "fa"
    words="+$variant+"
    [[ $words == *+ggml15+* ]] && path="$SITE_GGML15:$PYTHONPATH"
    [[ $words =~ \+tree-([A-Za-z0-9_.-]+)\+ ]] && path="$repo/ab/${BASH_REMATCH[1]}/src:$path"
    if [[ $words =~ \+patch-([A-Za-z0-9_.-]+)\+ ]]; then
      patch_tree "${BASH_REMATCH[1]}" || { status=1; continue; }
      path="$patched:$path"
    fi
    [[ $words == *+repack+* ]] && flags+=(--repack-experts)
    [[ $words =~ \+t([0-9]+)\+ ]] && flags=(-t "${BASH_REMATCH[1]}" "${flags[@]:2}")
    [[ $words =~ \+pcie([0-9]+)\+ ]] && flags+=(--pcie-experts "${BASH_REMATCH[1]}")
    envs=("${hide_gpu[@]}")
    [[ $words == *+noamx+* ]] && envs+=(TANDEM_AMX=0)
    [[ $words == *+fa+* ]] && envs+=(TANDEM_CPU_FLASH_ATTN=1)
    [[ $words == *+nofa+* ]] && envs+=(TANDEM_CPU_FLASH_ATTN=0)
    ab_matrix=${AB_MATRIX:-cpu-moe}
    [[ "$DEVICE" == cpu ]] && ab_matrix=all
    say "AB $name $variant: tandem ${flags[*]} (ggml: $(PYTHONPATH=$path "$PY" -c 'import ggml, os; print(os.path.dirname(ggml.__file__))'), tandem: $(PYTHONPATH=$path "$PY" -c 'import tandem, os; print(os.path.dirname(tandem.__file__))'))"
    PYTHONPATH=$path timeout -s TERM -k 10 "$left" "${envs[@]}" "$PY" -m tandem.cli.main bench -m "$model" \
      --device "$DEVICE" \
      --matrix "$ab_matrix" --pp "$PP" --tg "$TG" --reps "$REPS" --timeout "$((left - 10))" \
      --budget "$((left - 10))" --report "/tmp/ab_${name}_$variant" ${BENCH_FLAGS:-} "${flags[@]}" \
      >"/tmp/ab_${name}_$variant.out" 2>&1  # the variant's flags last: they win over BENCH_FLAGS
    say "AB $name $variant: exit $?"
    grep '^|' "/tmp/ab_${name}_$variant/report.md" 2>/dev/null || tail -5 "/tmp/ab_${name}_$variant.out"
  done
  [[ ${#files[@]} -eq 0 && "${KEEP_MODELS:-0}" != 1 ]] && rm -f "$model"  # room for the next one
done

say "done, exit $status; reports under $OUT"
ls -R "$OUT"
# The summary, last: each model's table (engine x placement: pp, tg, VRAM, ratio), from its report.md.
echo
echo "== summary: pp $PP, tg $TG, $REPS reps (median), threads $THREADS, device $DEVICE; $(elapsed) s in all =="
for target in "${targets[@]%%:*}"; do
  name=$target
  [[ ${#files[@]} -eq 0 ]] || name=$(basename "$target" .gguf)
  echo "-- $name"
  if [[ -f "$OUT/$name/report.md" ]]; then grep '^|' "$OUT/$name/report.md"; else echo "(no report)"; fi
done
return $status
}

main 2>&1 | tee -a "$OUT/device_compare.log"
exit "${PIPESTATUS[0]}"
