"""Float64 references for the RMSNorm and rope kernels, shared by their interpreter and GPU tests."""

from __future__ import annotations

import torch


def ref_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()


def ref_rope(x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NEOX rotation in float64 of x [T, H, Dh] over the first 2 * cos.shape[1] dimensions."""
    half = cos.shape[1]
    c, s = cos[pos].double().unsqueeze(1), sin[pos].double().unsqueeze(1)  # [T, 1, half]
    x = x.double()
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * half :]], dim=-1)
