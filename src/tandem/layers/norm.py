"""RMSNorm. GGUF files carry the final multiplier (Gemma's `1 + w` is folded in by the converter)."""

from __future__ import annotations

import numpy as np
import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dimension, computed in float32.

    On the CPU this is ggml's `rms_norm` followed by `mul`, bit for bit (ggml-cpu/ops.cpp): the float
    squares are summed in double, the mean is rounded to float, scale = 1.0f / sqrtf(mean + eps), and
    the row is scaled, then multiplied by the weight (two roundings). It runs in numpy, whose float32
    sqrt is correctly rounded as sqrtf is (torch's vectorized one is not always). A norm's output feeds
    the 8-bit quantization of a product's activations, where one unit in the last place can move a
    rounding by a whole quantization step: matching llama.cpp token for token needs exactly this.
    """
    if x.is_cuda:  # one Triton kernel (f32 inside, x's dtype out) instead of a cast, a norm and a cast
        from tandem.cuda.norm_rope import rms_norm_rows

        return rms_norm_rows(x, weight, eps)
    w = weight.detach().float().numpy() if isinstance(weight, torch.Tensor) else np.float32(weight)
    return torch.from_numpy(rms_norm_f32(x.detach().float().contiguous().numpy(), w, eps)).to(x.dtype)


def rms_norm_f32(x32: np.ndarray, w: np.ndarray | np.float32, eps: float) -> np.ndarray:
    """`rms_norm`'s CPU arithmetic on a float32 array (for callers that stay in numpy)."""
    mean = ((x32 * x32).sum(-1, keepdims=True, dtype=np.float64) / x32.shape[-1]).astype(np.float32)
    scale = np.float32(1.0) / np.sqrt(mean + np.float32(eps))  # float32: sqrtf, then a division
    return (x32 * scale) * w


def add_rms_norm(
    x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + h, rms_norm(x + h, weight, eps)): a residual add and the next pre-norm.

    On CUDA, with x and h of one dtype and shape, one Triton kernel writes both, rounded exactly as the two
    ops round (the norm reads the sum in x's dtype); elsewhere the two ops."""
    if x.is_cuda and h.dtype == x.dtype and h.shape == x.shape:
        from tandem.cuda.norm_rope import add_rms_norm_rows

        return add_rms_norm_rows(x, h, weight, eps)
    total = x + h
    return total, rms_norm(total, weight, eps)
