"""Tensor parallelism (`--tp N`) as the layers see it: a rank's layers compute partial sums that a `Reduce` adds up
over the ranks, and a rank computes only its own experts of each MoE layer (`ExpertSubset`).

The layers themselves (attention, the delta-net, MLPs, experts) do not know about ranks: a rank builds them from
its slices of the weights and a config with its share of the heads (placement/tp.py). docs/TENSOR_PARALLEL.md.

Shapes: T = tokens, D = hidden, A = active experts per token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.layers.moe import Pending, RoutedExperts, Routing, start_experts

# Sums a rank's partial result over the ranks (an all-reduce) and returns the sum, the same on every rank.
Reduce = Callable[[torch.Tensor], torch.Tensor]


def local_routing(routing: Routing, first: int, count: int) -> Routing:
    """Each token's selected experts as a rank holding experts [first, first + count) computes them: its own
    experts by their local ids, another rank's with weight 0 and the id of one of its own that the token (else the
    step) selected anyway, so that no expert is read for a slot another rank computes. Device tensors only (a
    captured step reads no value on the host)."""
    local = routing.ids - first  # [T, A]
    mine = (local >= 0) & (local < count)
    own = torch.where(mine, local, torch.full_like(local, -1))
    per_token = own.amax(dim=1, keepdim=True)  # [T, 1]: an expert of this rank the token selected, or -1
    fill = torch.where(per_token >= 0, per_token, per_token.amax().clamp(min=0))
    ids = torch.where(mine, local, fill)
    weights = torch.where(mine, routing.weights, torch.zeros((), dtype=routing.weights.dtype, device=local.device))
    return Routing(ids=ids, weights=weights)


@dataclass
class ExpertSubset:
    """A rank's experts [first, first + count) of a layer, computed by `inner` wherever the plan put them (ggml on
    the host blocks, the GPU kernels in VRAM, streamed for prefill): [T, D] -> this rank's part of the mixed output,
    which the FFN's all-reduce adds to the other ranks' parts."""

    inner: RoutedExperts
    first: int
    count: int

    def __call__(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        return self.start(x, routing)()

    def start(self, x: torch.Tensor, routing: Routing) -> Pending:
        """Begin this rank's experts (host experts compute until the result is asked for, see start_experts). On the
        CPU, a step whose tokens select none of them reads none: its part is zero."""
        if routing.ids.is_cpu and not self._selected(routing.ids):
            zeros = torch.zeros(x.shape[0], x.shape[-1], dtype=torch.float32)
            return lambda: zeros
        return start_experts(self.inner, x, local_routing(routing, self.first, self.count))

    def _selected(self, ids: torch.Tensor) -> bool:
        return bool(((ids >= self.first) & (ids < self.first + self.count)).any())
