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
        scale = torch.sigmoid(x.float() @ self.gate)  # [T]
        out = self.mlp(x)  # [T, D]
        return out * scale.unsqueeze(-1).to(out.dtype)


@dataclass
class MoEWithSharedExpert:
    """routed(x) + shared(x); the shared expert runs on the GPU while experts in host RAM compute."""

    routed: MoE
    shared: SharedExpert

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.routed.start(x)
        shared = self.shared(x)
        return routed() + shared
