"""Rotary position embeddings (NEOX layout: the two halves of each head are rotated together).

Frequencies follow ggml's `rope_yarn` (ggml-cpu/ops.cpp): per rotated pair i, theta_i = p * base^(-2i/dim)
/ freq_factor_i, linearly scaled by `scale`, or, with YaRN, blended between scaled and unscaled by a ramp
over the pairs, and cos/sin multiplied by the YaRN magnitude scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class YarnSpec:
    """YaRN as ggml applies it (the arguments of `ggml_rope_ext` besides base and scale)."""

    n_ctx_orig: int  # context length the model was trained with (bounds the ramp)
    ext_factor: float = 1.0  # weight of the extrapolation ramp (0: plain linear scaling)
    attn_factor: float = 1.0  # cos/sin multiplier, before ggml's own 1 + 0.1 ln(1/scale)
    beta_fast: float = 32.0  # rotations at which the ramp starts (fully unscaled below)
    beta_slow: float = 1.0  # rotations at which it ends (fully scaled above)


@dataclass(frozen=True)
class RopeSpec:
    """How one layer rotates its queries and keys."""

    base: float
    dim: int  # rotated dimensions per head (== head_dim unless partial rotary)
    scale: float = 1.0  # linear position scaling (positions are multiplied by `scale`)
    # Per rotated pair, frequencies are divided by these (llama.cpp's `rope_freqs`; Gemma 4 uses 1e30 to
    # leave pairs unrotated, its "proportional" rope).
    freq_factors: tuple[float, ...] | None = None
    yarn: YarnSpec | None = None


def yarn_corr_dims(dim: int, n_ctx_orig: int, base: float, beta_fast: float, beta_slow: float) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims: the pair range [low, high] of the ramp, floored/ceiled and clamped."""

    def corr_dim(n_rot: float) -> float:
        return dim * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    return max(0.0, math.floor(corr_dim(beta_fast))), min(dim - 1.0, math.ceil(corr_dim(beta_slow)))


def _inv_freq(spec: RopeSpec) -> tuple[torch.Tensor, float, float]:
    """(per-pair angle per position [half], position multiplier, cos/sin magnitude) of a spec."""
    half = spec.dim // 2
    exponent = torch.arange(0, half, dtype=torch.float64) * 2.0 / spec.dim
    inv_freq = 1.0 / (spec.base**exponent)
    if spec.freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(spec.freq_factors[:half], dtype=torch.float64)
    y = spec.yarn
    if y is None:
        return inv_freq.to(torch.float32), spec.scale, 1.0
    # theta = theta_interp * (1 - mix) + theta_extrap * mix, theta_interp = scale * theta_extrap
    low, high = yarn_corr_dims(spec.dim, y.n_ctx_orig, spec.base, y.beta_fast, y.beta_slow)
    pair = torch.arange(half, dtype=torch.float64)
    ramp = 1.0 - ((pair - low) / max(0.001, high - low)).clamp(0.0, 1.0)
    mix = ramp * y.ext_factor
    inv_freq = inv_freq * (spec.scale * (1.0 - mix) + mix)
    mscale = y.attn_factor
    if y.ext_factor != 0.0:
        mscale *= 1.0 + 0.1 * math.log(1.0 / spec.scale)
    return inv_freq.to(torch.float32), 1.0, mscale


class Rope:
    """cos/sin tables for one RopeSpec, grown on demand."""

    def __init__(self, spec: RopeSpec, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        self.device = torch.device(device)
        half = spec.dim // 2
        self.inv_freq, self._pos_scale, self.mscale = _inv_freq(spec)
        self._cos = torch.empty(0, half, device=self.device)
        self._sin = torch.empty(0, half, device=self.device)

    def reserve(self, n_positions: int, device: torch.device | str) -> None:
        """Build the tables for positions [0, n_positions) on `device` (the model does this once per
        context size, so `apply` never has to look at the positions on the host)."""
        self.device = torch.device(device)
        self._cos = self._cos.to(self.device)
        self._sin = self._sin.to(self.device)
        self._ensure(n_positions)

    def _ensure(self, n_positions: int) -> None:
        if self._cos.shape[0] >= n_positions:
            return
        n = max(n_positions, 2 * self._cos.shape[0], 256)
        pos = torch.arange(n, dtype=torch.float32) * self._pos_scale
        angles = torch.outer(pos, self.inv_freq)  # [P, half]
        cos, sin = angles.cos(), angles.sin()
        if self.mscale != 1.0:
            cos, sin = cos * self.mscale, sin * self.mscale
        self._cos = cos.to(self.device)
        self._sin = sin.to(self.device)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, H, Dh] at integer `positions` [T]."""
        if self._cos.device != positions.device or self._cos.shape[0] == 0:
            self.reserve(int(positions.max().item()) + 1, positions.device)
        cos = self._cos[positions].unsqueeze(1)  # [T, 1, half]
        sin = self._sin[positions].unsqueeze(1)
        half = self.spec.dim // 2
        x1 = x[..., :half].float()
        x2 = x[..., half : self.spec.dim].float()
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
        if self.spec.dim == x.shape[-1]:
            return rotated
        return torch.cat([rotated, x[..., self.spec.dim :]], dim=-1)
