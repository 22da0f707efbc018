"""Experts kept in host RAM while the rest of the model computes on a GPU.

Decode: the hidden states of the routed tokens go to the CPU, ggml computes the experts on the
mmap'd blocks, the result returns. Prefill (a batch of `min_batch` tokens or more): the layer's
expert blocks are copied into a bounded GPU staging window and computed there with the GPU kernels,
since PCIe moves an expert faster than the CPU can compute it for many tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tandem.gguf import TensorInfo
from tandem.layers.linear import Experts, GGMLLinear
from tandem.layers.moe import RoutedExperts, Routing

STAGING_ALIGN = 256  # bytes: keeps every staged tensor's view aligned for any element type


class ExpertSource(Protocol):
    """Where a layer's expert tensors are read from when building its RoutedExperts."""

    def experts(self, name: str) -> Experts: ...

    def vector(self, name: str) -> torch.Tensor: ...


@dataclass(eq=False)
class HostLinear:
    """A CPU (ggml) linear used from a GPU model: activations cross to the CPU and back.

    Like every host op here it is a boundary of the captured decode step (see cuda/graphs.py)."""

    inner: GGMLLinear
    segments: Any = None

    @property
    def out_features(self) -> int:
        return self.inner.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = (*x.shape[:-1], self.out_features)
        if self.segments is not None:
            return self.segments.boundary(self, (x,), shape, x.dtype)
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
        self.host_run((x,), out)
        return out

    def host_run(self, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        out.copy_(self.inner(inputs[0].float().cpu()), non_blocking=True)


@dataclass(eq=False)
class HostExperts:
    """CPU experts used one projection at a time from a GPU model (when not built through OffloadedExperts)."""

    inner: Experts
    segments: Any = None

    @property
    def out_features(self) -> int:
        return self.inner.out_features

    def __call__(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        shape = (*ids.shape, self.out_features)
        if self.segments is not None:
            return self.segments.boundary(self, (x, ids), shape, x.dtype)
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
        self.host_run((x, ids), out)
        return out

    def host_run(self, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        x, ids = inputs
        out.copy_(self.inner(x.float().cpu(), ids.cpu()), non_blocking=True)


class StagingWindow:
    """One GPU buffer that holds a layer's CPU-resident expert blocks during a prefill step.

    Every layer reuses the window from offset 0: copies and kernels are ordered on one stream, so the
    next layer's copy starts only after the previous layer's kernels have read the window.
    """

    def __init__(self, n_bytes: int, device: torch.device) -> None:
        self.buffer = torch.empty(n_bytes, dtype=torch.uint8, device=device)

    def layout(self, infos: list[TensorInfo]) -> dict[str, int]:
        """Byte offset of each tensor in the window (the same for every layer)."""
        offsets: dict[str, int] = {}
        at = 0
        for info in infos:
            offsets[info.name] = at
            at += -(-info.n_bytes // STAGING_ALIGN) * STAGING_ALIGN
        if at > self.buffer.numel():
            raise ValueError(f"staging window of {self.buffer.numel()} bytes cannot hold {at} bytes")
        return offsets

    def view(self, offset: int, n_bytes: int) -> torch.Tensor:
        return self.buffer[offset : offset + n_bytes]

    def fill(self, infos: list[TensorInfo], offsets: dict[str, int]) -> None:
        for info in infos:
            src = torch.from_numpy(info.data)
            self.view(offsets[info.name], info.n_bytes).copy_(src, non_blocking=True)


@dataclass(eq=False)
class OffloadedExperts:
    """Routed experts whose weights stay in host RAM, used by a model that computes on a GPU.

    Also a host boundary of the captured decode step (cuda/graphs.py): while `segments` is set, a
    call ends the current graph and the replay runs `host_run` in its place.
    """

    on_cpu: RoutedExperts  # built over ggml experts and CPU vectors
    staged: RoutedExperts | None  # built over views of the staging window (None: no GPU kernel for a type)
    stage: Callable[[], None] | None  # copies the layer's expert blocks into the window
    min_batch: int  # batches this large stream the experts to the GPU (llama.cpp: 32)
    segments: Any = None  # a SegmentedGraph while the decode step is being captured

    def __call__(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        if self.segments is not None:
            return self.segments.boundary(self, (x, routing.ids, routing.weights), x.shape, x.dtype)
        if self.staged is not None and self.stage is not None and x.shape[0] >= self.min_batch:
            self.stage()
            return self.staged(x, routing)
        out = torch.empty_like(x)
        self.host_run((x, routing.ids, routing.weights), out)
        return out

    def host_run(self, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        """Experts on the CPU: the routed hidden states come over, ggml computes, the result goes back."""
        x, ids, weights = inputs
        on_host = Routing(ids=ids.cpu(), weights=weights.float().cpu())
        out.copy_(self.on_cpu(x.float().cpu(), on_host), non_blocking=True)
