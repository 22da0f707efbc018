"""Timing of an autotuned kernel's candidates on the GPU alone (`graph_bench`, Triton's `autotune(do_bench=)`).

Triton's default benchmark launches every repetition from Python between two events: a busy CPU (ggml's threads
computing experts, a compiler beside the first run) delays launches inside the timed window, the GPU idles there,
and the slow candidate that happened to launch in a quiet moment wins. Its choice is kept on disk for every later
process. Here each candidate's repetitions are replayed from a CUDA graph, each after an L2 flush as Triton's
benchmark does, and the flushes' own graph is timed alike and subtracted: launch delays cannot enter the figure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

_FLUSH_BYTES = 256 << 20  # written before every repetition: more than any GPU's L2, so weights are read cold
_TARGET_MS = 5.0  # one replay of a candidate's repetitions
_TRIALS = 5
_MAX_REPS = 200


def _capture(body: Callable[[], None], reps: int) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    # thread_local: another thread's CUDA calls (a host op of the experts) do not break this capture
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(reps):
            body()
    return graph


def _replay_ms(graph: torch.cuda.CUDAGraph) -> float:
    """One replay's time on the GPU. An untimed replay goes first: while the GPU runs it, the host enqueues the
    start event and the timed replay, so a host delay shorter than it cannot leave the GPU idle in between."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def graph_bench(kernel_call: Callable[[], None], quantiles: Sequence[float] | None = None) -> float | list[float]:
    """Milliseconds per call of `kernel_call` (one launch, no host sync), at `quantiles` of the trials' figures
    as Triton's do_bench returns them (their median when None)."""
    flush = torch.empty(_FLUSH_BYTES, dtype=torch.int8, device="cuda")

    def flushed() -> None:
        flush.zero_()
        kernel_call()

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernel_call()  # compiles this candidate, outside any capture
    stream.synchronize()
    once = _capture(flushed, 1)
    reps = max(1, min(_MAX_REPS, round(_TARGET_MS / max(_replay_ms(once), 1e-3))))
    timed, flushes = _capture(flushed, reps), _capture(flush.zero_, reps)
    trials = sorted(max(_replay_ms(timed) - _replay_ms(flushes), 0.0) / reps for _ in range(_TRIALS))
    if quantiles is None:
        return trials[len(trials) // 2]
    return [trials[min(len(trials) - 1, int(q * len(trials)))] for q in quantiles]
