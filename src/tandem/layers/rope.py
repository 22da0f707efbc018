"""Rotary position embeddings (NEOX layout: the two halves of each head are rotated together).

Frequencies follow ggml's `rope_yarn` (ggml-cpu/ops.cpp): per rotated pair i, theta_i = p * base^(-2i/dim)
/ freq_factor_i, linearly scaled by `scale`, or, with YaRN, blended between scaled and unscaled by a ramp
over the pairs, and cos/sin multiplied by the YaRN magnitude scale.

The tables are computed as ggml's CPU backend computes them, in float32 and in the same order
(`ggml_rope_cache_init`): theta starts at the position and is multiplied by powf(base, -2/dim) from one
pair to the next, and cos/sin are the C library's cosf/sinf (taken through ggml's own cos/sin ops).
On the CPU the rotation rounds like llama.cpp's build, whose compiler contracts x0*cos - x1*sin into
fma(x0, cos, -(x1*sin)). Rotated queries and keys feed f16 rounding and 8-bit quantization downstream,
where one unit in the last place can become a visible difference: this keeps tandem on llama.cpp's
tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from tandem.layers.norm import rms_norm_f32
from tandem.quant.ggml_ops import ggml_elementwise


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


def _cos_sin_f32(theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cosf/sinf of a float32 array, as ggml's CPU backend computes them (its cos/sin ops call the C
    library's cosf/sinf element by element, the functions its rope uses)."""
    cos, sin = ggml_elementwise(np.asarray(theta, dtype=np.float32), ["cos", "sin"])
    return cos, sin


def _mscale(spec: RopeSpec) -> float:
    """The cos/sin magnitude (ggml: attn_factor, times 1 + 0.1 ln(1/scale) with YaRN extrapolation)."""
    y = spec.yarn
    if y is None:
        return 1.0
    f32 = np.float32
    mscale = f32(y.attn_factor)
    if y.ext_factor != 0.0:
        mscale = mscale * (f32(1) + f32(0.1) * np.log(f32(1) / f32(spec.scale)))
    return float(mscale)


def _angles(spec: RopeSpec, n_positions: int) -> np.ndarray:
    """theta [P, half] in float32, pair by pair as `ggml_rope_cache_init` / `rope_yarn` compute it."""
    half = spec.dim // 2
    f32 = np.float32
    theta_scale = np.power(f32(spec.base), f32(-2.0) / f32(spec.dim), dtype=np.float32)  # powf
    freq_scale = f32(spec.scale)
    y = spec.yarn
    ramp_mix: np.ndarray | None = None
    if y is not None and y.ext_factor != 0.0:
        low, high = yarn_corr_dims(spec.dim, y.n_ctx_orig, spec.base, y.beta_fast, y.beta_slow)
        pair = np.arange(half, dtype=np.float32)
        ramp = f32(1) - np.minimum(f32(1), np.maximum(f32(0), (pair - f32(low)) / f32(max(0.001, high - low))))
        ramp_mix = (ramp * f32(y.ext_factor)).astype(np.float32)
    factors = None if spec.freq_factors is None else np.asarray(spec.freq_factors[:half], dtype=np.float32)
    theta = np.arange(n_positions, dtype=np.float32)
    out = np.empty((n_positions, half), dtype=np.float32)
    for i in range(half):
        extrap = theta if factors is None else theta / factors[i]
        interp = freq_scale * extrap
        if ramp_mix is not None:
            mix = ramp_mix[i]
            interp = interp * (f32(1) - mix) + extrap * mix
        out[:, i] = interp
        theta = theta * theta_scale
    return out


class Rope:
    """cos/sin tables for one RopeSpec, grown on demand."""

    def __init__(self, spec: RopeSpec, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        self.device = torch.device(device)
        half = spec.dim // 2
        self.mscale = _mscale(spec)
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
        cos, sin = _cos_sin_f32(_angles(self.spec, n))
        if self.mscale != 1.0:
            cos, sin = cos * np.float32(self.mscale), sin * np.float32(self.mscale)
        self._cos = torch.from_numpy(cos).to(self.device)
        self._sin = torch.from_numpy(sin).to(self.device)

    def apply(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        norm: torch.Tensor | None = None,
        eps: float = 0.0,
        into: torch.Tensor | None = None,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rotate x [T, H, Dh] at integer `positions` [T], after an RMSNorm of each head by weight `norm`
        [Dh] when given (q/k norms). On CUDA one Triton kernel does both, with no rounding in between.

        into (CUDA only): a contiguous buffer [R, H, Dh] (a KV cache) that receives token t at row
        positions[t] % R (a sliding-window ring; a full cache has a row per position), cast to its dtype, in the
        same kernel; it is returned. slots (CUDA only, with into): [T] int64 on the device, into a pool
        [N, R, H, Dh] of sequences' buffers, token t to slot slots[t] (none where negative: padding), as
        `rope_rows` says."""
        if self._cos.device != positions.device or self._cos.shape[0] == 0:
            self.reserve(int(positions.max().item()) + 1, positions.device)
        if x.is_cuda:
            from tandem.cuda.norm_rope import rope_rows

            return rope_rows(x, positions, self._cos, self._sin, norm, eps, into, slots)
        if into is not None or slots is not None:
            raise ValueError("Rope.apply writes `into` a buffer only on CUDA")
        # numpy: a dozen small steps, each a fraction of torch's per-call cost
        x32 = x.detach().float().contiguous().numpy()
        if norm is not None:
            x32 = rms_norm_f32(x32, norm.detach().float().numpy(), eps)
            if x.dtype is not torch.float32:  # rounded to x's dtype between the two, as two ops would
                x32 = torch.from_numpy(x32).to(x.dtype).float().numpy()
        pos = positions.numpy()
        cos = self._cos.numpy()[pos][:, None]  # [T, 1, half]
        sin = self._sin.numpy()[pos][:, None]
        half = self.spec.dim // 2
        x1d = x32[..., :half].astype(np.float64)
        x2 = x32[..., half : self.spec.dim]
        # fma(x1, cos, -(x2*sin)) and fma(x1, sin, x2*cos), as ggml's CPU rope is compiled: the float32
        # products x1*cos, x1*sin are exact in double, and the sum is rounded once to float32
        out = x32.copy() if self.spec.dim < x32.shape[-1] else np.empty_like(x32)
        out[..., :half] = x1d * cos - (x2 * sin).astype(np.float64)
        out[..., half : self.spec.dim] = x1d * sin + (x2 * cos).astype(np.float64)
        return torch.from_numpy(out).to(x.dtype)
