"""Feed-forward compositions: a branch with its own norms, routed experts with a separate expert input
norm, and a dense branch beside a routed one.

`ParallelFFN` keeps its two branches as separate callables on purpose: they read the same input and share
nothing, so the dense one can run on another device while the CPU computes the experts.

Shapes: T = tokens, D = hidden.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.layers.moe import Pending, RoutedExperts, Router, start_experts
from tandem.layers.norm import rms_norm

FFN = Callable[[torch.Tensor], torch.Tensor]  # [T, D] -> [T, D]


def _maybe_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return x if weight is None else rms_norm(x, weight, eps)


@dataclass
class NormedFFN:
    """post_norm(ffn(pre_norm(x))), either norm optional."""

    ffn: FFN
    pre_norm: torch.Tensor | None
    post_norm: torch.Tensor | None
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _maybe_norm(self.ffn(_maybe_norm(x, self.pre_norm, self.eps)), self.post_norm, self.eps)


@dataclass
class RoutedFFN:
    """Routed experts whose router reads x itself while the experts read expert_norm(x), followed by an
    optional output norm (Gemma 4's MoE branch)."""

    router: Router
    experts: RoutedExperts
    expert_norm: torch.Tensor | None
    post_norm: torch.Tensor | None
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.start(x)()

    def start(self, x: torch.Tensor) -> Pending:
        """The branch, its result asked for later (the experts may compute on the host meanwhile)."""
        routing = self.router(x)  # on the un-normalised input
        pending = start_experts(self.experts, _maybe_norm(x, self.expert_norm, self.eps), routing)
        return lambda: _maybe_norm(pending(), self.post_norm, self.eps)


@dataclass
class ParallelFFN:
    """dense(x) + sparse(x): two independent branches on the same input; the dense one runs on the GPU
    while experts in host RAM compute the sparse one."""

    dense: FFN
    sparse: RoutedFFN

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        sparse = self.sparse.start(x)
        return self.dense(x) + sparse()
