"""Timing of an autotuned kernel's candidates on the GPU alone (`graph_bench`, Triton's `autotune(do_bench=)`).

Triton's default benchmark launches every repetition from Python between two events: a busy CPU (ggml's threads
computing experts, a compiler beside the first run) delays launches inside the timed window, the GPU idles there,
and the slow candidate that happened to launch in a quiet moment wins. Its choice is kept on disk for every later
process. Here the repetitions, each after an L2 flush as in Triton's benchmark, and their start and end events are
captured in one CUDA graph (the events as graph nodes: `external`), so what the events measure is the GPU's work
between them, however late the host is.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch
import triton.testing

_FLUSH_MIN_BYTES = 32 << 20  # written before every repetition: twice the GPU's L2 (at least this), so weights
# are read cold; Triton's benchmark writes 256 MiB, a transient peak of VRAM the first run of a server would show
_TARGET_MS = 10.0  # the repetitions of one replay
_MAX_REPS = 100
_REPLAYS = 2
_fallback = False  # this torch cannot time events inside a graph: Triton's own benchmark
_CAPTURE_TRIES = 3


def _timed_graph(kernel_call: Callable[[], None], flush: torch.Tensor, reps: int) -> Callable[[], list[float]]:
    """A graph of `reps` flushed repetitions with an event pair around each kernel; returns its replay, which
    gives the repetitions' milliseconds."""
    events = [
        (torch.cuda.Event(enable_timing=True, external=True), torch.cuda.Event(enable_timing=True, external=True))
        for _ in range(reps)
    ]
    graph = torch.cuda.CUDAGraph()
    # thread_local: another thread's CUDA calls (a host op of the experts) do not break this capture
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for start, end in events:
            flush.zero_()
            start.record()
            kernel_call()
            end.record()

    def replay() -> list[float]:
        graph.replay()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in events]

    return replay


def graph_bench(kernel_call: Callable[[], None], quantiles: Sequence[float] | None = None) -> float | list[float]:
    """Milliseconds per call of `kernel_call` (one launch, no host sync), at `quantiles` of the repetitions as
    Triton's do_bench returns them (their median when None)."""
    global _fallback
    failed: RuntimeError | None = None
    for _ in range(0 if _fallback else _CAPTURE_TRIES):
        try:
            return _graph_bench(kernel_call, quantiles)
        except TypeError as e:  # an older torch: no external events
            warnings.warn(f"autotuning times candidates by Triton's benchmark: {e}", stacklevel=2)
            _fallback = True
            break
        except RuntimeError as e:  # no timing of external events, or another thread's CUDA call (a step's host
            failed = e  # op, overlapping the eager step that tunes) invalidated the capture: try again
    if failed is not None:
        warnings.warn(f"autotuning timed a candidate by Triton's benchmark: {failed}", stacklevel=2)
    return triton.testing.do_bench(kernel_call, quantiles=quantiles)


def _graph_bench(kernel_call: Callable[[], None], quantiles: Sequence[float] | None) -> float | list[float]:
    l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 128 << 20)
    flush = torch.empty(max(2 * l2, _FLUSH_MIN_BYTES), dtype=torch.int8, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernel_call()  # compiles this candidate, outside any capture
    stream.synchronize()
    once = _timed_graph(kernel_call, flush, 1)
    once()  # the first replay uploads the graph
    estimate = max(once()[0], 1e-3)
    reps = max(1, min(_MAX_REPS, round(_TARGET_MS / estimate)))
    replay = _timed_graph(kernel_call, flush, reps)
    replay()
    times = sorted(t for _ in range(_REPLAYS) for t in replay())
    if quantiles is None:
        return times[len(times) // 2]
    return [times[min(len(times) - 1, int(q * len(times)))] for q in quantiles]
