"""Mixture-of-experts: routing (softmax, top-k, renormalisation) and the gated experts.

Shapes: T = tokens, D = hidden, E = experts, A = active experts per token, F = expert FFN dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.layers.linear import Experts, Linear


@dataclass(frozen=True)
class Routing:
    ids: torch.Tensor  # [T, A] int64 selected experts
    weights: torch.Tensor  # [T, A] float32 mixing weights


@dataclass
class SoftmaxTopKRouter:
    """Qwen-style router: softmax over all experts, keep the top A, optionally renormalise."""

    proj: Linear  # [E, D]
    n_active: int
    renormalize: bool

    def __call__(self, x: torch.Tensor) -> Routing:
        logits = self.proj(x).float()  # [T, E]
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, self.n_active, dim=-1)  # [T, A]
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(ids=ids, weights=weights)


@dataclass
class GatedExperts:
    """down_e(act(gate_e(x)) * up_e(x)) for each selected expert e, mixed by the routing weights."""

    gate: Experts
    up: Experts
    down: Experts
    act: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        hidden = self.act(self.gate(x, routing.ids)) * self.up(x, routing.ids)  # [T, A, F]
        out = self.down(hidden, routing.ids)  # [T, A, D]
        return (out * routing.weights.unsqueeze(-1).to(out.dtype)).sum(dim=1)  # [T, D]


@dataclass
class MoE:
    router: SoftmaxTopKRouter
    experts: GatedExperts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))
