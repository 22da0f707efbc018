"""The one-token decode step as CUDA graphs.

Launching a decode step kernel by kernel costs more than the kernels themselves. The step is
captured once and replayed. Where the step must run host code -- experts that the plan keeps in host
RAM -- the capture is split: replay runs graph 0, host op 0, graph 1, ..., so the plan is obeyed in
the captured path exactly as in the eager one (the host ops are the same objects the eager path calls).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.models.decoder import DecoderModel
from tandem.runtime.kv_cache import KVCache


class HostBoundary(Protocol):
    """A part of the step that runs on the host; it switches to `segments.boundary` while captured."""

    segments: SegmentedGraph | None

    def host_run(self, inputs: Sequence[torch.Tensor], out: torch.Tensor) -> None: ...


@dataclass
class _HostOp:
    op: HostBoundary
    inputs: tuple[torch.Tensor, ...]
    out: torch.Tensor


class SegmentedGraph:
    """Graphs of one captured step and the host ops between them."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.host_ops: list[_HostOp] = []
        self._current: torch.cuda.CUDAGraph | None = None

    def _begin(self) -> None:
        self._current = torch.cuda.CUDAGraph()
        self._current.capture_begin(pool=self.pool)

    def _end(self) -> None:
        assert self._current is not None
        self._current.capture_end()
        self.graphs.append(self._current)
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
        finally:
            for b in boundaries:
                b.segments = None
        torch.cuda.current_stream().wait_stream(stream)
        return out

    def boundary(
        self, op: HostBoundary, inputs: Sequence[torch.Tensor], shape: Sequence[int], dtype: torch.dtype
    ) -> torch.Tensor:
        """Called by a host op during capture: close the graph so far, note the op, open the next graph."""
        self._end()
        out = torch.empty(tuple(shape), dtype=dtype, device=inputs[0].device)  # static: host op writes, next reads
        self.host_ops.append(_HostOp(op=op, inputs=tuple(inputs), out=out))
        self._begin()
        return out

    @torch.inference_mode()
    def replay(self) -> None:
        for i, graph in enumerate(self.graphs):
            graph.replay()
            if i < len(self.host_ops):
                h = self.host_ops[i]
                h.op.host_run(h.inputs, h.out)


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
