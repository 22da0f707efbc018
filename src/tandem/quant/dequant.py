"""Dequantize GGUF tensors to float32 with pure torch ops (runs unchanged on CPU and CUDA tensors).

Every format is bit-exact against `gguf.quants.dequantize` (gguf 0.19.0, itself a port of ggml's
`dequantize_row_*`): scales are converted f16 -> f32 first and every product is a separate f32
multiply, in the same order as the reference, so no result depends on fused or reordered arithmetic.

The raw bytes are viewed as [n_blocks, block_bytes]; each per-format function maps such a block
matrix to [n_blocks, block_elems] float32. Multi-byte fields sit at offsets that are not aligned
to their size (e.g. the f16 scale of an 18-byte Q4_0 block), so they are sliced out and copied
into a contiguous tensor before the dtype is reinterpreted; everything else is uint8 bit ops.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache

import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES, QK_K

from tandem.quant.types import check_supported

__all__ = ["dequantize", "dequantize_rows"]

# IQ4_NL / IQ4_XS non-linear 4-bit code book (ggml's kvalues_iq4nl).
_KVALUES_IQ4NL: tuple[int, ...] = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# MXFP4 e2m1 code book, doubled so it is integral; the e8m0 scale is halved to compensate.
_KVALUES_MXFP4: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


# ---------------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------------


@lru_cache(maxsize=32)
def _table(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A small f32 lookup table on `device` (cached: built once per device, not once per call)."""
    return torch.tensor(values, dtype=torch.float32, device=device)


def _bytes_as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret uint8 `x` ([..., k * itemsize]) as `dtype`, copying only when the view is illegal.

    A dtype view needs contiguous bytes starting at a multiple of the item size; a slice of a
    block (or a tensor sliced at an odd offset) may be neither, so it is copied out first.
    """
    if not x.is_contiguous() or x.storage_offset() % dtype.itemsize != 0:
        x = x.clone(memory_format=torch.contiguous_format)
    return x.view(dtype)


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The f16 field at byte `offset` of each block, as f32 of shape [n_blocks, 1]."""
    return _bytes_as(blocks[:, offset : offset + 2], torch.float16).float()


def _unpack(x: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """Split each byte of `x` ([n, m] uint8) into 8 // bits fields of `bits` bits, low bits first.

    The bytes are taken in runs of `group`: for each run, all lowest fields come first, then all
    next fields, and so on -- ggml's layout for packed quants (e.g. group=16, bits=4 gives the 16
    low nibbles then the 16 high nibbles). Returns [n, m * 8 // bits] uint8.
    """
    n = x.shape[0]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=x.device).view(1, 1, -1, 1)
    fields = (x.reshape(n, -1, 1, group) >> shifts) & ((1 << bits) - 1)
    return fields.reshape(n, -1)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte Q4_K/Q5_K field into 8 six-bit scales and 8 six-bit mins ([n, 8] each).

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the high 2 bits of scales 4-7; bytes 4-7 the same
    for the mins; bytes 8-11 hold the low nibbles of scales 4-7 (low half) and mins 4-7 (high half).
    """
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _signed6(low4: torch.Tensor, high2: torch.Tensor) -> torch.Tensor:
    """A 6-bit unsigned field made of a low nibble and 2 high bits, minus 32, as f32."""
    return ((low4 & 0x0F) | ((high2 & 0x03) << 4)).float() - 32.0


# ---------------------------------------------------------------------------------------------------
# Per-format block decoders: [n_blocks, block_bytes] uint8 -> [n_blocks, block_elems] float32
# ---------------------------------------------------------------------------------------------------


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].view(torch.int8).float() * _f16(b, 0)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _unpack(b[:, 2:], 16, 4).float() - 8.0
    return _f16(b, 0) * q


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q = _unpack(b[:, 4:], 16, 4).float()
    return _f16(b, 0) * q + _f16(b, 2)


def _q5_quants(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1 5-bit quants: bit i of the little-endian u32 `qh` is the 5th bit of element i."""
    return _unpack(qs, 16, 4) | (_unpack(qh, 1, 1) << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _q5_quants(b[:, 2:6], b[:, 6:]).float() - 16.0
    return _f16(b, 0) * q


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _q5_quants(b[:, 4:8], b[:, 8:]).float()
    return _f16(b, 0) * q + _f16(b, 2)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    # scales[16] | qs[64] | d | dmin ; 16 sub-blocks of 16, each with a 4-bit scale and 4-bit min.
    n = b.shape[0]
    scales = b[:, : QK_K // 16]
    qs = b[:, QK_K // 16 : QK_K // 16 + QK_K // 4]
    d, dmin = _f16(b, QK_K // 16 + QK_K // 4), _f16(b, QK_K // 16 + QK_K // 4 + 2)
    dl = (d * (scales & 0x0F).float()).view(n, QK_K // 16, 1)
    ml = (dmin * (scales >> 4).float()).view(n, QK_K // 16, 1)
    q = _unpack(qs, 32, 2).float().view(n, QK_K // 16, 16)
    return (dl * q - ml).view(n, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    # hmask[32] | qs[64] | scales[12] | d ; 16 sub-blocks of 16 with 6-bit signed scales.
    n = b.shape[0]
    hmask, qs = b[:, : QK_K // 8], b[:, QK_K // 8 : QK_K // 8 + QK_K // 4]
    sc = b[:, QK_K // 8 + QK_K // 4 : QK_K // 8 + QK_K // 4 + 12]
    d = _f16(b, QK_K // 8 + QK_K // 4 + 12)
    # Bytes 0-7: low nibbles of scales 0-7, then high nibbles for 8-15; bytes 8-11: 2-bit highs.
    scales = _signed6(_unpack(sc[:, :8], 8, 4), _unpack(sc[:, 8:], 4, 2))
    dl = (d * scales).view(n, 16, 1)
    ql = _unpack(qs, 32, 2).view(n, 16, 16).to(torch.int16)
    # The high bit is inverted: a set hmask bit means no -4 offset.
    qh = (_unpack(hmask, 32, 1).view(n, 16, 16) ^ 1).to(torch.int16)
    q = (ql - (qh << 2)).float()
    return (dl * q).view(n, QK_K)


def _k_dmin_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K header (d, dmin, 12-byte scales) -> per-sub-block scale and min, [n, 8, 1] f32."""
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (_f16(b, 0) * sc.float()).view(n, 8, 1)
    ml = (_f16(b, 2) * mn.float()).view(n, 8, 1)
    return dl, ml


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    # d | dmin | scales[12] | qs[128] ; 8 sub-blocks of 32.
    n = b.shape[0]
    dl, ml = _k_dmin_scales(b)
    q = _unpack(b[:, 16:], 32, 4).float().view(n, 8, 32)
    return (dl * q - ml).view(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    # d | dmin | scales[12] | qh[32] | qs[128] ; 8 sub-blocks of 32.
    n = b.shape[0]
    dl, ml = _k_dmin_scales(b)
    ql = _unpack(b[:, 16 + QK_K // 8 :], 32, 4)
    qh = _unpack(b[:, 16 : 16 + QK_K // 8], 32, 1)
    q = (ql | (qh << 4)).float().view(n, 8, 32)
    return (dl * q - ml).view(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    # ql[128] | qh[64] | scales[16] (int8) | d ; 16 sub-blocks of 16.
    n = b.shape[0]
    o_qh, o_sc, o_d = QK_K // 2, QK_K // 2 + QK_K // 4, QK_K // 2 + QK_K // 4 + QK_K // 16
    scales = b[:, o_sc:o_d].view(torch.int8).float()
    dl = (_f16(b, o_d) * scales).view(n, QK_K // 16, 1)
    ql = _unpack(b[:, :o_qh], 64, 4)
    qh = _unpack(b[:, o_qh:o_sc], 32, 2)
    q = ((ql | (qh << 4)).float() - 32.0).view(n, QK_K // 16, 16)
    return (dl * q).view(n, QK_K)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    q = _table(_KVALUES_IQ4NL, b.device)[_unpack(b[:, 2:], 16, 4).long()]
    return _f16(b, 0) * q


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    # d | scales_h (u16) | scales_l[4] | qs[128] ; 8 sub-blocks of 32 with 6-bit signed scales.
    n = b.shape[0]
    scales = _signed6(_unpack(b[:, 4:8], 1, 4), _unpack(b[:, 2:4], 1, 2))
    dl = (_f16(b, 0) * scales).view(n, 8, 1)
    q = _table(_KVALUES_IQ4NL, b.device)[_unpack(b[:, 8:], 16, 4).long()].view(n, 8, 32)
    return (dl * q).view(n, QK_K)


def _e8m0_to_f32_half(e: torch.Tensor) -> torch.Tensor:
    """Half of 2**(e - 127) as f32 (ggml_e8m0_to_fp32_half); e < 2 gives a subnormal."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    q = _table(_KVALUES_MXFP4, b.device)[_unpack(b[:, 1:], 16, 4).long()]
    return _e8m0_to_f32_half(b[:, :1]) * q


def _f32(b: torch.Tensor) -> torch.Tensor:
    return _bytes_as(b, torch.float32)


def _f16_elems(b: torch.Tensor) -> torch.Tensor:
    return _bytes_as(b, torch.float16).float()


def _bf16(b: torch.Tensor) -> torch.Tensor:
    # bf16 is the top half of an f32: shift the bits up rather than convert (keeps NaN payloads).
    return (_bytes_as(b, torch.int16).to(torch.int32) << 16).view(torch.float32)


_DEQUANT: dict[Q, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.F32: _f32,
    Q.F16: _f16_elems,
    Q.BF16: _bf16,
    Q.Q8_0: _q8_0,
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
    Q.Q2_K: _q2_k,
    Q.Q3_K: _q3_k,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
    Q.IQ4_NL: _iq4_nl,
    Q.IQ4_XS: _iq4_xs,
    Q.MXFP4: _mxfp4,
}


# ---------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------


def dequantize(
    data: torch.Tensor, qtype: Q, shape: tuple[int, ...], *, name: str = "<unnamed>"
) -> torch.Tensor:
    """Decode the raw GGUF bytes of one tensor into float32 of `shape` (PyTorch order).

    `data` is a uint8 tensor of exactly the tensor's bytes, of any shape (e.g. a 1-D
    `torch.from_numpy` view of the memory map); the result is on `data`'s device. `shape[-1]` must
    be a multiple of the format's block size. For F32 the result may share memory with `data`.
    `name` only labels the error. Raises UnsupportedModelError for a type tandem cannot decode and
    ValueError when the byte count or row length does not fit `shape`.
    """
    check_supported(qtype, name)
    if data.dtype != torch.uint8:
        raise ValueError(f"tensor '{name}': expected uint8 bytes, got {data.dtype}")
    block, type_size = GGML_QUANT_SIZES[qtype]
    n_elems = math.prod(shape)
    if shape and shape[-1] % block != 0:
        raise ValueError(f"tensor '{name}': row length {shape[-1]} is not a multiple of {qtype.name} "
                         f"block size {block}")
    n_bytes = n_elems // block * type_size
    if data.numel() != n_bytes:
        raise ValueError(f"tensor '{name}': {qtype.name} {tuple(shape)} needs {n_bytes} bytes, "
                         f"got {data.numel()}")
    blocks = data.reshape(n_elems // block, type_size)
    return _DEQUANT[qtype](blocks).reshape(shape)


def dequantize_rows(
    data: torch.Tensor, qtype: Q, row_shape: tuple[int, ...], rows: torch.Tensor, *, name: str = "<unnamed>"
) -> torch.Tensor:
    """Dequantize only the rows `rows` of a 2-D quantized tensor (e.g. an embedding lookup).

    `data` holds the whole tensor, n_rows * row_bytes uint8 bytes; `row_shape` is its shape
    (n_rows, n_cols) -- a 1-tuple (n_cols,) is also accepted, n_rows then follows from the byte
    count. `rows` is an integer tensor of any shape; the result is float32 of shape
    `(*rows.shape, n_cols)` on `data`'s device. Only the selected rows' bytes are decoded.
    """
    check_supported(qtype, name)
    block, type_size = GGML_QUANT_SIZES[qtype]
    n_cols = row_shape[-1]
    if n_cols % block != 0:
        raise ValueError(f"tensor '{name}': row length {n_cols} is not a multiple of {qtype.name} "
                         f"block size {block}")
    row_bytes = n_cols // block * type_size
    n_rows = row_shape[0] if len(row_shape) == 2 else data.numel() // row_bytes
    if data.numel() != n_rows * row_bytes:
        raise ValueError(f"tensor '{name}': {n_rows} rows of {qtype.name}[{n_cols}] need "
                         f"{n_rows * row_bytes} bytes, got {data.numel()}")
    idx = rows.reshape(-1).to(device=data.device, dtype=torch.long)
    picked = data.reshape(n_rows, row_bytes)[idx]  # gathers (copies) just these rows' bytes
    return dequantize(picked, qtype, (idx.numel(), n_cols), name=name).reshape(*rows.shape, n_cols)
