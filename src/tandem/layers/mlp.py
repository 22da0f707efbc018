"""Gated MLP: down(act(gate(x)) * up(x))."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.layers.activations import ACTIVATIONS
from tandem.layers.linear import GGMLLinear, Linear


@dataclass
class GatedMLP:
    gate: Linear
    up: Linear
    down: Linear
    act: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate, self.up
        if (
            x.shape[0] == 1
            and self.act is ACTIVATIONS["gelu_tanh_ggml"]
            and isinstance(gate, GGMLLinear)
            and isinstance(up, GGMLLinear)
            and gate.kernels is up.kernels
            and gate.weight.shape == up.weight.shape
        ):  # decoding: both products and ggml's own GEGLU (the activation's definition) in one compute call
            return self.down(gate.kernels.geglu(x, gate.weight, up.weight).to(x.dtype))
        return self.down(self.act(gate(x)) * up(x))
