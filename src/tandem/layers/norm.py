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


Norm = tuple[torch.Tensor, float]  # an RMSNorm's weight and eps
Branch = tuple[torch.Tensor, Norm | None]  # a branch's output and the norm it still needs


def add_normed(
    x: torch.Tensor | None, branches: list[Branch], post_norm: Norm | None = None, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """(x + post_norm(sum of the branches, each normed)) * scale; x None: the normed sum alone (no scale).

    A block's tail after its mixer or its FFN (Gemma's sandwich norms, Gemma 4's two FFN branches and layer scalar).
    On CUDA, with float32 rows of one shape and at most two branches, one Triton kernel with the ops' own order and
    float32 arithmetic; elsewhere the ops."""
    if x is not None and x.is_cuda and 1 <= len(branches) <= 2:
        from tandem.cuda.norm_rope import normed_residual_fits, normed_residual_rows

        norms = [n for _, n in branches] + [post_norm]
        vectors = [w for w, _ in filter(None, norms)] + ([scale] if scale is not None else [])
        if normed_residual_fits(x, [h for h, _ in branches], vectors):
            (a, a_norm), (b, b_norm) = branches[0], (branches[1] if len(branches) == 2 else (None, None))
            return normed_residual_rows(x, a, a_norm, b, b_norm, post_norm, scale)
    h = None
    for out, norm in branches:
        out = out if norm is None else rms_norm(out, *norm)
        h = out if h is None else h + out
    assert h is not None, "add_normed needs a branch"
    if post_norm is not None:
        h = rms_norm(h, *post_norm)
    if x is None:
        return h
    x = x + h
    return x if scale is None else x * scale
