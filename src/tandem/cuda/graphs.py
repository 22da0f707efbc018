"""The one-token decode step as CUDA graphs.

Launching a decode step kernel by kernel costs more than the kernels themselves. The step is
captured once and replayed. Where the step must run host code -- experts that the plan keeps in host
RAM -- the capture is split: replay runs graph 0, host op 0, graph 1, ..., so the plan is obeyed in
the captured path exactly as in the eager one (the host ops are the same objects the eager path calls).

When every host op hands over through a HostFlag (cuda/host_memory.py), graph i + 1 begins with a
device-side wait for host op i's flag, and the replay launches it BEFORE running host op i: the launch
(~10 µs of Python and driver per segment, 48 per token on Qwen3-30B-A3B with --cpu-moe) leaves the
serial path, and the GPU starts graph i + 1 as soon as the host op's result is in place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from tandem.models.decoder import DecoderModel
from tandem.runtime.kv_cache import KVCache

if TYPE_CHECKING:
    from tandem.cuda.host_memory import HostFlag


class HostBoundary(Protocol):
    """A host op of the step (runtime/offload.py HostCall): while `segments` is set, it calls
    `segments.split` where its host part must run instead of running it."""

    segments: SegmentedGraph | None


class SegmentedGraph:
    """Graphs of one captured step and the host steps between them, replayed in order."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.steps: list[Callable[[], object]] = []  # graph, host step, graph, ..., graph
        self._current: torch.cuda.CUDAGraph | None = None
        self.pipelined = True  # every graph after a host step waits for that step's flag on the device

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
            if self._current is not None:  # leave no stream capturing behind an error
                try:
                    self._current.capture_end()
                except Exception:
                    pass
                self._current = None
            raise
        finally:
            for b in boundaries:
                b.segments = None
        torch.cuda.current_stream().wait_stream(stream)
        return out

    def split(self, host_step: Callable[[], object], flag: HostFlag | None = None) -> None:
        """Called by a host op during capture: end the graph so far; replay runs `host_step` after it,
        then the graph captured next. With a `flag`, the next graph starts by waiting for it on the device,
        and the replay sets it once `host_step` returns (or fails: a graph never waits for ever)."""
        self._end()
        if flag is None:
            self.pipelined = False
            self.steps.append(host_step)
        else:
            self.steps.append(_releasing(host_step, flag))
        self._begin()
        if flag is not None:
            flag.enqueue_wait_and_clear(torch.cuda.current_stream())

    @torch.inference_mode()
    def replay(self) -> None:
        if not self.pipelined:
            for step in self.steps:
                step()
            return
        graphs, host_steps = self.steps[0::2], self.steps[1::2]
        graphs[0]()
        for host_step, next_graph in zip(host_steps, graphs[1:], strict=True):
            next_graph()  # waits on the device for host_step's flag
            host_step()


def _releasing(host_step: Callable[[], object], flag: HostFlag) -> Callable[[], None]:
    def run() -> None:
        try:
            host_step()
        finally:
            flag.set()

    return run


class DecodeGraph:
    """The model's one-token step with static input buffers, captured on first use."""

    def __init__(self, model: DecoderModel, cache: KVCache, boundaries: Sequence[HostBoundary]) -> None:
        self.model = model
        self.cache = cache
        self.boundaries = boundaries
        self.x = torch.zeros(1, model.cfg.hidden, dtype=model.dtype, device=model.device)
        self.positions = torch.zeros(1, dtype=torch.long, device=model.device)
        self.graph: SegmentedGraph | None = None
        self.logits: torch.Tensor | None = None

    def __call__(self, token: int) -> torch.Tensor:
        """Logits [V] after `token` at the cache's next position (the caller does the bookkeeping)."""
        # The embedding lookup stays outside the graph: the table may be in host RAM (as llama.cpp keeps it).
        self.x.copy_(self.model.embed_tokens(torch.tensor([token])))
        self.positions.fill_(self.cache.length)
        if self.graph is None:
            graph = SegmentedGraph()
            self.logits = graph.capture(
                lambda: self.model.blocks_and_head(self.x, self.positions, self.cache, start=0), self.boundaries
            )
            self.graph = graph
        self.graph.replay()
        assert self.logits is not None
        return self.logits[-1]
