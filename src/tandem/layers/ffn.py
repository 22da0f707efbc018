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
from tandem.layers.norm import Branch, add_normed, rms_norm

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
        pending = self.start_experts(x)
        return lambda: _maybe_norm(pending(), self.post_norm, self.eps)

    def start_experts(self, x: torch.Tensor) -> Pending:
        """The branch before its output norm (under --tp, a rank's partial sum: the norm comes after the sum)."""
        routing = self.router(x)  # on the un-normalised input
        return start_experts(self.experts, _maybe_norm(x, self.expert_norm, self.eps), routing)


@dataclass
class ParallelFFN:
    """dense(x) + sparse(x): two independent branches on the same input; the dense one runs on the GPU
    while experts in host RAM compute the sparse one.

    Under --tp (`reduce` set) each branch is a rank's partial sum until its output norm: both are summed over the
    ranks in one all-reduce of [T, 2D], then normed and added."""

    dense: FFN
    sparse: RoutedFFN
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return add_normed(None, self.branches(x))

    def branches(self, x: torch.Tensor) -> list[Branch]:
        """Each branch's output with the output norm it still needs, for the caller to sum (with its own post-norm
        and residual add: one kernel on CUDA, `add_normed`). The experts start first: on the host they compute while
        the GPU runs the dense branch."""
        if self.reduce is not None:
            return [(self._reduced(x, self.reduce), None)]
        sparse = self.sparse.start_experts(x)
        dense = self.dense
        if isinstance(dense, NormedFFN):
            d = dense.ffn(_maybe_norm(x, dense.pre_norm, dense.eps))
            d_norm = None if dense.post_norm is None else (dense.post_norm, dense.eps)
        else:
            d, d_norm = dense(x), None
        s_norm = None if self.sparse.post_norm is None else (self.sparse.post_norm, self.sparse.eps)
        return [(d, d_norm), (sparse(), s_norm)]

    def _reduced(self, x: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        dense = self.dense
        if not isinstance(dense, NormedFFN):
            raise TypeError("a tensor-parallel ParallelFFN needs its dense branch as a NormedFFN")
        sparse = self.sparse.start_experts(x)
        d = dense.ffn(_maybe_norm(x, dense.pre_norm, dense.eps))  # [T, D]
        both = reduce(torch.cat([d, sparse().to(d.dtype)], dim=-1))  # [T, 2D]: one all-reduce for both branches
        d, s = both.split(d.shape[-1], dim=-1)
        return _maybe_norm(d, dense.post_norm, dense.eps) + _maybe_norm(s, self.sparse.post_norm, self.sparse.eps)
