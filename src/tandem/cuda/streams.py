"""Independent projections of one decode token side by side on the GPU.

At decode a layer's projections are GEMVs of a few µs each that read the same input: Qwen3.6's delta-net
layer runs four and attention layers three. None fills the
GPU, yet one stream runs them one after the other, on the critical path of every layer. `side_by_side` runs
all but the first on a second stream of the same device, forked from and joined back into the current one, so
that the CUDA graph of the decode step gets parallel branches (stream forks and joins inside a capture become
graph dependencies, and torch routes a joined stream's allocations to the graph's pool).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


def on_host(projection: object) -> bool:
    """Whether a projection runs on the host (weights/offload.py HostLinear, or a pair holding one): a boundary
    of the captured step, which must stay on the step's stream."""
    return bool(getattr(projection, "on_host", False))


def side_by_side(x: torch.Tensor, *projections: Callable[[torch.Tensor], Any]) -> list[Any]:
    """[p(x) for p in projections], for projections that read x (and their weights) and nothing another
    writes. For one token on a GPU, projections[1:] run on a side stream that starts after the work queued so
    far, and the current stream waits for them before what is queued next; otherwise, or when one of them runs
    on the host (`on_host`), one after the other.

    Lifetimes need no `record_stream`: the side stream's tensors are freed after the join, so the current
    stream's later work is ordered after their use, and a block freed there is next handed to the side stream
    at a fork, which waits for the current stream first."""
    if not x.is_cuda or x.shape[0] != 1 or len(projections) < 2 or any(map(on_host, projections)):
        return [p(x) for p in projections]
    main = torch.cuda.current_stream(x.device)
    side = _side_stream(x.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        rest = [p(x) for p in projections[1:]]
    first = projections[0](x)
    main.wait_stream(side)
    return [first, *rest]
