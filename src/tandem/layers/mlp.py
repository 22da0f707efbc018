"""Gated MLP: down(act(gate(x)) * up(x))."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.layers.linear import Linear


@dataclass
class GatedMLP:
    gate: Linear
    up: Linear
    down: Linear
    act: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x)) * self.up(x))
