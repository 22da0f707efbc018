"""The one-token decode step as CUDA graphs.

Launching a decode step kernel by kernel costs more than the kernels themselves. The step is
captured once and replayed. Where the step must run host code -- experts that the plan keeps in host
RAM -- the capture is split: replay runs graph 0, host op 0, graph 1, ..., so the plan is obeyed in
the captured path exactly as in the eager one (the host ops are the same objects the eager path calls).

When every host op hands over through HostFlags (cuda/host_memory.py), the graphs never wait on the host's
side of a launch: at each host op the graph sets the op's to-host flag and waits on the device for its to-device
flag, and the host runs the op in between (spin on the first flag, compute, set the second). No event round
trip, and the launches leave the critical path: the step is a graph per host op (cut where it waits for the
op's result), launched two ahead by the thread that runs the host ops. After host op i it launches graph i + 2
while the GPU runs graph i + 1, time it would otherwise spend spinning on a flag; a layer's launches cost less
than the GPU's part of that layer, so they hide in it. One graph for the whole step was slower: its launch is
long, and a helper thread to launch it competes with ggml's threads for the cores
(docs/reports/NOTES-FROM-CODE.md has the measurements).

The host ops stay on the calling thread because ggml computes through OpenMP, in the libgomp torch loads:
libgomp keeps a team of worker threads per thread that starts parallel regions, and once its threads
outnumber the CPUs it cuts every barrier's spin to ~100 iterations and puts waiting threads to sleep. A second
team (ggml's on a helper thread beside the one torch and the eager host ops made on the caller's) would make every
barrier of every expert graph a futex sleep and wake-up, which slows decode by about a quarter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from tandem.cuda.host_memory import HostFlag

LAUNCH_AHEAD = 2  # graphs launched before the first host op runs: the one it waits for and the next


class HostBoundary(Protocol):
    """A host op of the step (weights/offload.py HostCall): while `segments` is set, it calls
    `segments.split` where its host part must run instead of running it."""

    segments: SegmentedGraph | None


class SegmentedGraph:
    """One captured step: a graph per host step, the host steps handing over through HostFlags while the graphs
    run (launched ahead), or (without flags) the graphs and the host steps between them, replayed in order."""

    def __init__(self, pool: tuple[int, int] | None = None) -> None:
        """`pool`: a graph memory pool (torch.cuda.graph_pool_handle()) shared with graphs that never run at the
        same time as this one; by default its own."""
        self.pool = torch.cuda.graph_pool_handle() if pool is None else pool
        # Split captures: graph, host step, graph, ..., graph. Flag captures: the graphs only (one more than the
        # host steps), with the host steps in `host_steps`.
        self.steps: list[Callable[[], object]] = []
        self.host_steps: list[Callable[[], object]] = []  # run while the graphs run (flag captures)
        self._to_host: list[HostFlag] = []
        self._to_device: list[HostFlag] = []
        self._current: torch.cuda.CUDAGraph | None = None
        self._split = False

    @property
    def uses_flags(self) -> bool:
        """Whether the host steps hand over through flags while the graphs run (else: replayed in order)."""
        return bool(self.host_steps)

    def _begin(self) -> None:
        self._current = torch.cuda.CUDAGraph()
        self._current.capture_begin(pool=self.pool)

    def _end(self) -> None:
        assert self._current is not None
        self._current.capture_end()
        self.steps.append(self._current.replay)
        self._current = None

    def capture(self, fn: Callable[[], torch.Tensor], boundaries: Sequence[HostBoundary]) -> torch.Tensor:
        """Capture `fn` (run eagerly at least once before, so kernels are compiled); returns its output."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        for b in boundaries:
            b.segments = self
        try:
            with torch.cuda.stream(stream):
                self._begin()
                out = fn()
                self._end()
        except BaseException:
            if self._current is not None:  # leave no stream capturing behind an error (ended where it began)
                try:
                    with torch.cuda.stream(stream):
                        self._current.capture_end()
                except Exception:
                    pass
                self._current = None
            raise
        finally:
            for b in boundaries:
                b.segments = None
        if self.host_steps and self._split:
            raise RuntimeError("a captured step mixes host ops with and without flags")
        torch.cuda.current_stream().wait_stream(stream)
        return out

    def split(self, host_step: Callable[[], object]) -> None:
        """Called by a host op without flags during capture: end the graph so far; replay runs `host_step`
        after it, then the graph captured next."""
        self._split = True
        self._end()
        self.steps.append(host_step)
        self._begin()

    def add_host_step(self, host_step: Callable[[], object], to_host: HostFlag, to_device: HostFlag) -> None:
        """Called by a host op with flags during capture (the graph has set `to_host`, and may have queued work
        that runs while the host computes): replay runs `host_step` while the graph runs; the graph goes on
        once `to_device` is set, which the replay does when `host_step` returns (or fails). The graph ends here;
        the next one begins by waiting for `to_device`."""
        self.host_steps.append(host_step)
        self._to_host.append(to_host)
        self._to_device.append(to_device)
        self._end()
        self._begin()
        to_device.enqueue_wait_and_clear(torch.cuda.current_stream())

    @torch.inference_mode()
    def replay(self) -> None:
        if not self.host_steps:
            for step in self.steps:
                step()
            return
        graphs = self.steps  # graph i + LAUNCH_AHEAD is launched right after host step i released graph i + 1
        for graph in graphs[:LAUNCH_AHEAD]:
            graph()
        later = iter(graphs[LAUNCH_AHEAD:])
        try:
            for i, host_step in enumerate(self.host_steps):
                try:
                    host_step()
                finally:  # released even when it fails, so that the graphs launched drain
                    self._to_device[i].set()
                if (graph := next(later, None)) is not None:
                    graph()
        except BaseException:
            for flag in self._to_device:
                flag.set()
            self._forget()
            raise

    def _forget(self) -> None:
        """After a failure (every graph launched was released): let them end, then clear the hand-overs left set,
        for the next replay."""
        torch.cuda.current_stream().synchronize()
        for flag in (*self._to_host, *self._to_device):
            flag.clear()
