"""What both bench workers share: the prompt tokens, the result line, fault injection, peak RSS.

Standard library only: the llama.cpp worker loads this file by path, before llama_cpp and without
importing the `tandem` package (whose import pulls in numpy and torch; see llamacpp_worker.py).
"""

from __future__ import annotations

import json
import os
import random
import resource
import sys
import time
from typing import Any

# The worker's result is the one stdout line starting with this; anything else a library prints is ignored.
RESULT_MARKER = "TANDEM_BENCH_RESULT "

# The llama.cpp worker's exit status when llama_cpp cannot be imported: the row says "peer missing".
EXIT_PEER_MISSING = 4

# Fault injection for tests and dry runs: TANDEM_BENCH_INJECT="KIND:ENGINE[,KIND:ENGINE...]", KIND one of
# crash (exit 3 with a traceback-like message), hang (sleep until killed), garbage (exit 0 without a result);
# ENGINE is tandem, llamacpp or * (both).
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


def maybe_inject(engine: str) -> None:
    """Act on TANDEM_BENCH_INJECT for `engine` (see INJECT_ENV); does nothing when it is unset."""
    spec = os.environ.get(INJECT_ENV, "")
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, _, target = item.partition(":")
        if target not in (engine, "*"):
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


def emit_result(result: dict[str, Any]) -> None:
    """Print the result line the orchestrator looks for."""
    sys.stdout.write(RESULT_MARKER + json.dumps(result) + "\n")
    sys.stdout.flush()


def parse_result(stdout: str) -> dict[str, Any] | None:
    """The last result line of a worker's stdout, or None."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER) :])
    return None

