"""Rotary position embeddings (NEOX layout: the two halves of each head are rotated together)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeSpec:
    """How one layer rotates its queries and keys."""

    base: float
    dim: int  # rotated dimensions per head (== head_dim unless partial rotary)
    scale: float = 1.0  # linear position scaling (positions are multiplied by `scale`)


class Rope:
    """cos/sin tables for one RopeSpec, grown on demand."""

    def __init__(self, spec: RopeSpec, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        self.device = torch.device(device)
        half = spec.dim // 2
        exponent = torch.arange(0, half, dtype=torch.float64) * 2.0 / spec.dim
        self.inv_freq = (1.0 / (spec.base**exponent)).to(torch.float32)
        self._cos = torch.empty(0, half, device=self.device)
        self._sin = torch.empty(0, half, device=self.device)

    def _ensure(self, n_positions: int) -> None:
        if self._cos.shape[0] >= n_positions:
            return
        n = max(n_positions, 2 * self._cos.shape[0], 256)
        pos = torch.arange(n, dtype=torch.float32) * self.spec.scale
        angles = torch.outer(pos, self.inv_freq)  # [P, half]
        self._cos = angles.cos().to(self.device)
        self._sin = angles.sin().to(self.device)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, H, Dh] at integer `positions` [T]."""
        self._ensure(int(positions.max().item()) + 1)
        cos = self._cos[positions].unsqueeze(1)  # [T, 1, half]
        sin = self._sin[positions].unsqueeze(1)
        half = self.spec.dim // 2
        x1 = x[..., :half].float()
        x2 = x[..., half : self.spec.dim].float()
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
        if self.spec.dim == x.shape[-1]:
            return rotated
        return torch.cat([rotated, x[..., self.spec.dim :]], dim=-1)
