"""Routed experts plus a sigmoid-gated shared expert (Qwen2-MoE, Qwen3-Next, Qwen3.5).

The two halves read the same input and are only summed at the end, so they can run on different
devices at the same time (the shared expert on the GPU while the CPU computes the routed experts):
`MoEWithSharedExpert.routed` and `.shared` are separate callables for that purpose.

Shapes: T = tokens, D = hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.layers.mlp import GatedMLP
from tandem.layers.moe import MoE


@dataclass
class SharedExpert:
    """A dense gated MLP scaled per token by sigmoid(w . x) (`ffn_*_shexp`, `ffn_gate_inp_shexp`)."""

    mlp: GatedMLP
    gate: torch.Tensor  # [D] float32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.sigmoid(self._gate_logits(x))  # [T]
        out = self.mlp(x)  # [T, D]
        return out * scale.unsqueeze(-1).to(out.dtype)

    def _gate_logits(self, x: torch.Tensor) -> torch.Tensor:
        """w . x [T] in f32. At decode on the GPU, the router's GEMV kernel (one launch, x read as it is): cuBLAS
        took a cast, a split-K GEMV and its reduction, 11-19 µs per layer on an H200 (Qwen3.6 traces, 12:22, 14:05)."""
        if x.is_cuda and self.gate.is_cuda:  # Triton is imported only with a GPU
            from tandem.cuda.routing import router_logits
            from tandem.cuda.weights import ROUTER_GEMV_MAX_ROWS

            if x.shape[0] <= ROUTER_GEMV_MAX_ROWS:
                return router_logits(x, self.gate.view(1, -1)).view(-1)
        return x.float() @ self.gate


@dataclass
class MoEWithSharedExpert:
    """routed(x) + shared(x); the shared expert runs on the GPU while experts in host RAM compute."""

    routed: MoE
    shared: SharedExpert

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.routed.start(x)
        shared = self.shared(x)
        return routed() + shared
