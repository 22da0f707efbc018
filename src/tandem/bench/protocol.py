"""What both bench workers share: the prompt tokens, the result lines, fault injection, peak RSS.

A worker loads the model once, warms up once and then times every repetition, printing one line per
repetition as it finishes (REP_MARKER + JSON: that repetition's result, complete in itself) and one line at
the end (RESULT_MARKER + JSON: the whole process). The orchestrator keeps the repetition lines of a worker
that crashes or is killed later on, so a failure in repetition k costs only the repetitions from k on.

Standard library only: the llama.cpp worker loads this file by path, before llama_cpp and without
importing the `tandem` package (whose import pulls in numpy and torch; see llamacpp_worker.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

# The worker's result is the one stdout line starting with this; anything else a library prints is ignored.
RESULT_MARKER = "TANDEM_BENCH_RESULT "
# One line per finished repetition, printed (and flushed) as soon as it is measured.
REP_MARKER = "TANDEM_BENCH_REP "

# The llama.cpp worker's exit status when llama_cpp cannot be imported: the row says "peer missing".
EXIT_PEER_MISSING = 4

# Fault injection for tests and dry runs: TANDEM_BENCH_INJECT="KIND:ENGINE[,KIND:ENGINE...]", KIND one of
# crash (exit 3 with a traceback-like message), hang (sleep until killed), garbage (exit 0 without a result);
# ENGINE is tandem, llamacpp or * (both). KIND@R (crash@1, hang@2, ...) acts just before repetition R
# (0-based, after the load and the warm-up), so repetitions 0..R-1 have been measured and printed; a plain
# KIND acts when the worker starts.
INJECT_ENV = "TANDEM_BENCH_INJECT"


def prompt_ids(n_vocab: int, n: int, seed: int) -> list[int]:
    """`n` token ids drawn uniformly from the vocabulary: the same list for both engines, given the seed.

    Random ids rather than text so that no tokenizer is involved and the experts see a spread routing.
    """
    rng = random.Random(seed)
    return [rng.randrange(n_vocab) for _ in range(n)]


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def maybe_inject(engine: str, rep: int | None = None) -> None:
    """Act on TANDEM_BENCH_INJECT for `engine` at the worker's start (rep None) or before repetition `rep`
    (see INJECT_ENV); does nothing when it is unset."""
    spec = os.environ.get(INJECT_ENV, "")
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, _, target = item.partition(":")
        kind, _, at = kind.partition("@")
        if target not in (engine, "*") or (int(at) if at else None) != rep:
            continue
        if kind == "crash":
            print(f"injected crash in the {engine} worker ({INJECT_ENV}={spec})", file=sys.stderr)
            sys.stderr.flush()
            os._exit(3)
        if kind == "hang":
            print(f"injected hang in the {engine} worker", file=sys.stderr, flush=True)
            while True:
                time.sleep(1)
        if kind == "garbage":
            print("no result line here", flush=True)
            os._exit(0)


def exit_worker(main: Callable[[], int]) -> NoReturn:
    """Run a worker's main and exit with its code, skipping the interpreter's teardown (module GC, the CUDA
    context's orderly release): the OS frees the process's memory anyway, and the orchestrator waits for
    the exit before starting the next worker."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def emit_result(result: dict[str, Any]) -> None:
    """Print the result line the orchestrator looks for."""
    sys.stdout.write(RESULT_MARKER + json.dumps(result) + "\n")
    sys.stdout.flush()


def emit_rep(rep: dict[str, Any]) -> None:
    """Print one repetition's line, flushed at once: it must reach the orchestrator if the worker dies next."""
    sys.stdout.write(REP_MARKER + json.dumps(rep) + "\n")
    sys.stdout.flush()


def parse_result(stdout: str) -> dict[str, Any] | None:
    """The last result line of a worker's stdout, or None."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER) :])
    return None


def parse_rep(line: str) -> dict[str, Any] | None:
    """One repetition line's result, or None for any other line (or a line cut short by a kill)."""
    if not line.startswith(REP_MARKER):
        return None
    try:
        rep = json.loads(line[len(REP_MARKER) :])
    except json.JSONDecodeError:
        return None
    return rep if isinstance(rep, dict) else None


def parse_reps(stdout: str) -> list[dict[str, Any]]:
    """Every repetition line of a worker's stdout, in order."""
    return [rep for rep in map(parse_rep, stdout.splitlines()) if rep is not None]


class RepClock:
    """When to stop starting repetitions: at `deadline` (time.time(), from the orchestrator's --budget),
    a repetition is not started if the last one, taken again, would end past it. The first always runs."""

    def __init__(self, deadline: float | None) -> None:
        self.deadline = deadline
        self.last_s = 0.0

    def may_start(self, rep: int) -> bool:
        return rep == 0 or self.deadline is None or time.time() + self.last_s <= self.deadline


Rep = tuple[dict[int, float], float]  # one repetition: prefill seconds per prompt length, decode seconds


def timed_reps(
    engine: str,
    one_rep: Callable[[list[int], int, int], Rep],
    pp_sizes: list[int],
    args: argparse.Namespace,
    common: dict[str, Any],
    memory: Callable[[], dict[str, Any]],
) -> list[Rep]:
    """Time up to `args.reps` repetitions of one_rep(pp_sizes, args.tg, args.seed + r) while `args.deadline`
    allows (RepClock), printing each as it ends: `common`, the repetition's timings and `memory()` (the peaks
    so far)."""
    clock = RepClock(args.deadline)
    done: list[Rep] = []
    for r in range(args.reps):
        if not clock.may_start(r):
            break
        maybe_inject(engine, rep=r)
        start = time.perf_counter()
        pp_s, tg_s = one_rep(pp_sizes, args.tg, args.seed + r)
        clock.last_s = time.perf_counter() - start
        done.append((pp_s, tg_s))
        emit_rep(
            {
                **common,
                "rep": r,
                "seed": args.seed + r,
                "pp_s": {str(pp): [pp_s[pp]] for pp in pp_sizes},
                "tg_s": [tg_s],
                "rep_wall_s": clock.last_s,
                **memory(),
            }
        )
    return done


def run_result(
    common: dict[str, Any], done: list[Rep], reps: int, pp_sizes: list[int], memory: dict[str, Any]
) -> dict[str, Any]:
    """A worker's whole result: `common`, every repetition's timings, whether the deadline cut them, `memory`."""
    return {
        **common,
        "ok": True,
        "reps_done": len(done),
        "reps_asked": reps,
        "stopped": None if len(done) == reps else "deadline",
        "pp_s": {str(pp): [r[0][pp] for r in done] for pp in pp_sizes},
        "tg_s": [r[1] for r in done],
        **memory,
    }
