"""Random but valid GGUF blocks for kernel tests (finite, small scales)."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES

# Byte offsets of the f16 scale fields inside one block.
F16_FIELDS = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q5_0: [0], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}


def random_blocks(qtype: Q, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """uint8 array of shape (*shape[:-1], row_bytes) for a tensor of `shape` (last dim = row length)."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // block, size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scales = (rng.standard_normal(raw.shape[:-1]) * 0.01).astype(np.float16)
        raw[..., offset : offset + 2] = scales[..., None].view(np.uint8)
    return raw.reshape(*shape[:-1], -1)
