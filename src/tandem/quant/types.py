"""The ggml types tandem reads, with their block geometry."""

from __future__ import annotations

from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES

from tandem.errors import UnsupportedModelError

SUPPORTED_TYPES: frozenset[Q] = frozenset(
    {
        Q.F32,
        Q.F16,
        Q.BF16,
        Q.Q8_0,
        Q.Q4_0,
        Q.Q4_1,
        Q.Q5_0,
        Q.Q5_1,
        Q.Q2_K,
        Q.Q3_K,
        Q.Q4_K,
        Q.Q5_K,
        Q.Q6_K,
        Q.IQ4_NL,
        Q.IQ4_XS,
        Q.MXFP4,
    }
)


# Types the GPU kernels read in their block form; other types are dequantized at load on the GPU.
GPU_NATIVE_TYPES: frozenset[Q] = frozenset({Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K})
# Types kept as they are on the GPU (plain floats).
GPU_FLOAT_TYPES: frozenset[Q] = frozenset({Q.F32, Q.F16, Q.BF16})


# Transient GPU memory of a prefill product: blocks are dequantized to floats at most this much at a time.
GPU_DEQUANT_CHUNK_BYTES = 64 << 20
# Prefill streams CPU-resident experts to the GPU through two slots of at most this many bytes each.
STAGING_SLOT_BYTES = 32 << 20
# cuBLAS's workspace, which torch takes from its allocator on Hopper (CUBLAS_WORKSPACE_CONFIG default).
CUBLAS_WORKSPACE_BYTES = 32 << 20


def gpu_resident_bytes(qtype: Q, n_elements: int, file_bytes: int, dtype_bytes: int) -> int:
    """VRAM a tensor takes on the GPU: its file bytes when kept as blocks or floats, else dequantized."""
    if qtype in GPU_NATIVE_TYPES or qtype in GPU_FLOAT_TYPES:
        return file_bytes
    return n_elements * dtype_bytes


def block_geometry(qtype: Q) -> tuple[int, int]:
    """(elements per block, bytes per block) of a ggml type."""
    return GGML_QUANT_SIZES[qtype]


def row_bytes(qtype: Q, n_cols: int) -> int:
    """Bytes of one row of `n_cols` elements stored as `qtype`."""
    block, size = GGML_QUANT_SIZES[qtype]
    return n_cols // block * size


def check_supported(qtype: Q, tensor_name: str) -> None:
    """Raise a one-line UnsupportedModelError when tandem cannot compute with `qtype`."""
    if qtype not in SUPPORTED_TYPES:
        names = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise UnsupportedModelError(
            f"tensor '{tensor_name}' uses quant type {qtype.name}, which tandem does not support (supported: {names})"
        )
