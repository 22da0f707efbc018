"""Random but valid GGUF blocks for kernel tests (finite, small scales)."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES

# Byte offsets of the f16 scale fields inside one block (ggml-common.h block layouts). MXFP4's scale is the
# e8m0 byte 0, set separately.
F16_FIELDS: dict[Q, tuple[int, ...]] = {
    Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
    Q.IQ4_NL: (0,), Q.IQ4_XS: (0,), Q.MXFP4: (),
}  # fmt: skip


def random_blocks(qtype: Q, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """uint8 array of shape (*shape[:-1], row_bytes) for a tensor of `shape` (last dim = row length)."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // block, size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scales = (rng.standard_normal(raw.shape[:-1]) * 0.01).astype(np.float16)
        raw[..., offset : offset + 2] = scales[..., None].view(np.uint8)
    return raw.reshape(*shape[:-1], -1)


def random_weight_bytes(qtype: Q, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random raw GGUF bytes (flat) for `shape`, any type, whose scale fields are finite (f16 scales of
    +-0.005..0.015, E8M0 exponents 2^-7..2^3)."""
    n = int(np.prod(shape))
    if qtype == Q.F32:
        return rng.standard_normal(n).astype(np.float32).view(np.uint8)
    if qtype == Q.F16:
        return rng.standard_normal(n).astype(np.float16).view(np.uint8)
    if qtype == Q.BF16:
        bits = rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8)
    block, size = GGML_QUANT_SIZES[qtype]
    nb = n // block
    b = rng.integers(0, 256, (nb, size), dtype=np.uint8)
    if qtype == Q.MXFP4:
        b[:, 0] = rng.integers(120, 131, nb)  # E8M0 exponent: 2^-7 .. 2^3
    else:
        for off in F16_FIELDS[qtype]:
            scale = rng.uniform(0.5, 1.5, nb) * rng.choice([-1.0, 1.0], nb) * 0.01
            b[:, off : off + 2] = scale.astype(np.float16).view(np.uint8).reshape(nb, 2)
    return b.reshape(-1)
