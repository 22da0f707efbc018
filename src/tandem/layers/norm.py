"""RMSNorm. GGUF files carry the final multiplier (Gemma's `1 + w` is folded in by the converter)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dimension, computed in float32."""
    if x.is_cuda:  # torch's fused kernel: one launch instead of five
        return F.rms_norm(x.float(), (x.shape[-1],), weight.float().expand(x.shape[-1]), eps).to(x.dtype)
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight).to(x.dtype)
