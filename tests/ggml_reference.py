"""Float64 references for ggml's CPU products on quantized blocks.

Two references per case:
  * exact: x @ dequant(W).T in float64. ggml converts x to the weight type's vec_dot type first
    (Q8_0/Q8_1 per 32 values, Q8_K per 256, F16, BF16), so the error is the activation rounding:
    for 8-bit blocks with scale amax/127 the error is uniform in +-d/2, rms d/sqrt(12), i.e. about
    2.1/(127*3.46) = 0.5 % of sigma for 32-value blocks of Gaussian x (amax ~ 2.1 sigma) and
    3/(127*3.46) = 0.7 % for 256-value blocks (amax ~ 3 sigma). With random weights the relative
    Frobenius error of y is the same ratio; the tolerances below are 2-3x that.
  * emulated: x rounded the way ggml rounds it (its quantize_row_q8_0 / q8_K), then the float64
    product. This must agree to float32 accumulation error, which shows the arithmetic is ggml's.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from tandem.quant.ggml_weights import GGMLWeight

# The type ggml converts activations to for each weight type (ggml_type_traits_cpu.vec_dot_type).
VEC_DOT_TYPE: dict[Q, Q] = {
    Q.F32: Q.F32, Q.F16: Q.F16, Q.BF16: Q.BF16,
    Q.Q8_0: Q.Q8_0, Q.Q4_0: Q.Q8_0, Q.Q5_0: Q.Q8_0, Q.IQ4_NL: Q.Q8_0, Q.MXFP4: Q.Q8_0,
    Q.Q4_1: Q.Q8_1, Q.Q5_1: Q.Q8_1,
    Q.Q2_K: Q.Q8_K, Q.Q3_K: Q.Q8_K, Q.Q4_K: Q.Q8_K, Q.Q5_K: Q.Q8_K, Q.Q6_K: Q.Q8_K, Q.IQ4_XS: Q.Q8_K,
}  # fmt: skip

# Relative Frobenius tolerances, by vec_dot type (see the module docstring).
# F16: ggml's F16 dot product on this build also accumulates partly in f16 (measured ~7e-4).
# Q8_1: the block sum s = d * sum(q) is stored as f16, which the emulation leaves out (~3e-5).
TOL_EXACT = {Q.F32: 1e-6, Q.F16: 2e-3, Q.BF16: 5e-3, Q.Q8_0: 1.5e-2, Q.Q8_1: 1.5e-2, Q.Q8_K: 2e-2}
TOL_EMULATED = {Q.F32: 1e-6, Q.F16: 2e-3, Q.BF16: 1e-6, Q.Q8_0: 1e-5, Q.Q8_1: 1e-4, Q.Q8_K: 1e-5}


def dequant(w: GGMLWeight) -> torch.Tensor:
    rows = int(np.prod(w.shape[:-1]))
    return torch.from_numpy(dequantize(w.data.reshape(rows, -1), w.qtype).reshape(w.shape)).double()


def _q8_0_roundtrip(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q8_0 then dequantization (float32 arithmetic, rint as on x86/ARM SIMD)."""
    b = x.reshape(-1, 32).astype(np.float32)
    amax = np.abs(b).max(axis=1, keepdims=True)
    inv = np.float32(127) / np.where(amax > 0, amax, np.float32(1))
    q = np.rint(b * inv.astype(np.float32))
    d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    return (q * d).reshape(x.shape)


def _q8_k_roundtrip(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q8_K (signed max, iscale = -127/max, float32 d) then dequantization."""
    b = x.reshape(-1, 256).astype(np.float32)
    mx = b[np.arange(len(b)), np.abs(b).argmax(axis=1)][:, None]
    iscale = np.float32(-127) / np.where(mx != 0, mx, np.float32(1))
    q = np.minimum(np.float32(127), np.rint(iscale * b))
    return (q * (np.float32(1) / iscale)).reshape(x.shape)


def activation_as_ggml_sees_it(x: torch.Tensor, qtype: Q) -> torch.Tensor:
    vdt = VEC_DOT_TYPE[qtype]
    xn = x.numpy()
    if vdt == Q.F32:
        return x.double()
    if vdt == Q.F16:
        return torch.from_numpy(xn.astype(np.float16)).double()
    if vdt == Q.BF16:
        return x.bfloat16().double()
    if vdt in (Q.Q8_0, Q.Q8_1):
        return torch.from_numpy(_q8_0_roundtrip(xn)).double()
    return torch.from_numpy(_q8_k_roundtrip(xn)).double()


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


def check(y: torch.Tensor, x_ref_exact: torch.Tensor, x_ref_emulated: torch.Tensor, qtype: Q) -> None:
    """y against both references; x_ref_* are the products computed from exact / emulated x."""
    assert y.dtype == torch.float32 and torch.isfinite(y).all()
    vdt = VEC_DOT_TYPE[qtype]
    err = rel_err(y, x_ref_exact)
    assert err < TOL_EXACT[vdt], f"{qtype.name}: relative error {err:.2e} vs float64 reference"
    err = rel_err(y, x_ref_emulated)
    assert err < TOL_EMULATED[vdt], f"{qtype.name}: relative error {err:.2e} vs emulated activations"
