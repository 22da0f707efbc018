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

    def __post_init__(self) -> None:
        # w . x in f32 -> [T, 1]. On a GPU, as a router's projection (DenseLinear.logits: its one-kernel GEMV at
        # decode, where cuBLAS takes a cast, a split-K GEMV and its reduction: several launches for one row);
        # imported only there, as it needs Triton.
        if self.gate.is_cuda:
            from tandem.cuda.weights import DenseLinear

            self._logits = DenseLinear(self.gate.view(1, -1)).logits
        else:
            self._logits = lambda x: x.float() @ self.gate.view(-1, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.sigmoid(self._logits(x))  # [T, 1]
        out = self.mlp(x)  # [T, D]
        return out * scale.to(out.dtype)


@dataclass
class MoEWithSharedExpert:
    """routed(x) + shared(x); the shared expert runs on the GPU while experts in host RAM compute."""

    routed: MoE
    shared: SharedExpert

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.routed.start(x)
        shared = self.shared(x)
        return routed() + shared
