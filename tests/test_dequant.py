"""Bit-exactness of tandem's torch dequantizers against gguf.quants.dequantize (numpy reference)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as ref_dequantize
from qblocks import F16_FIELDS

from tandem.errors import UnsupportedModelError
from tandem.quant.dequant import dequantize, dequantize_rows
from tandem.quant.types import SUPPORTED_TYPES

FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
ALL_TYPES = sorted(SUPPORTED_TYPES, key=lambda t: t.value)
BLOCK_COUNTS = (1, 3, 40)


def random_bytes(qtype: Q, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """`n_blocks` blocks of random bytes whose float fields are finite (no NaN/inf in the output)."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    if qtype in FLOAT_TYPES:
        top = 4 if qtype == Q.F16 else 30  # keep F16 below its 65504 maximum
        vals = (rng.standard_normal(n_blocks) * 10.0 ** rng.integers(-6, top, n_blocks)).astype(np.float32)
        if qtype == Q.F16:
            return vals.astype(np.float16).view(np.uint8)
        if qtype == Q.BF16:
            return (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return vals.view(np.uint8)
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scale = (rng.standard_normal(n_blocks) * 2.0 ** rng.integers(-20, 8, n_blocks)).astype(np.float16)
        blocks[:, off : off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    if qtype == Q.MXFP4:
        blocks[:, 0] = rng.integers(100, 155, n_blocks, dtype=np.uint8)  # 2**-27 .. 2**27
    return blocks.reshape(-1)


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.int32)


def assert_same_bits(ours: torch.Tensor, ref: np.ndarray, nan_ok: bool = False) -> None:
    """Bitwise equality; with `nan_ok`, positions where both are NaN count as equal (payloads may differ)."""
    got = ours.numpy()
    assert got.dtype == np.float32 and got.shape == ref.shape
    mask = ~(np.isnan(got) & np.isnan(ref)) if nan_ok else np.ones(ref.shape, dtype=bool)
    mismatch = (bits(got) != bits(ref)) & mask
    assert not mismatch.any(), f"{mismatch.sum()} mismatches, first at {np.argwhere(mismatch)[0]}"


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_bit_exact(qtype: Q) -> None:
    rng = np.random.default_rng(qtype.value)
    block, _ = GGML_QUANT_SIZES[qtype]
    for n_blocks in BLOCK_COUNTS:
        raw = random_bytes(qtype, n_blocks, rng)
        ref = ref_dequantize(raw, qtype).reshape(-1)
        assert_same_bits(dequantize(torch.from_numpy(raw), qtype, (n_blocks * block,)), ref)
    # 2-D shape, and bytes given as a 2-D tensor of another shape with the same count.
    rows, cols = 4, 2 * block
    raw = random_bytes(qtype, rows * 2, rng)
    ref = ref_dequantize(raw, qtype).reshape(rows, cols)
    assert_same_bits(dequantize(torch.from_numpy(raw).reshape(2, -1), qtype, (rows, cols)), ref)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_raw_random_bytes(qtype: Q) -> None:
    """Unfiltered bytes (NaN/inf/subnormal scales, any e8m0 exponent): same bits wherever not NaN."""
    rng = np.random.default_rng(1000 + qtype.value)
    _, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, 64 * type_size, dtype=np.uint8)
    with np.errstate(all="ignore"):  # the reference multiplies NaN/inf scales on purpose here
        ref = ref_dequantize(raw, qtype).reshape(-1)
    ours = dequantize(torch.from_numpy(raw), qtype, ref.shape)
    assert_same_bits(ours, ref, nan_ok=True)
    assert np.array_equal(np.isnan(ours.numpy()), np.isnan(ref))


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q4_0, Q.Q6_K], ids=lambda t: t.name)
def test_misaligned_bytes(qtype: Q) -> None:
    """A uint8 tensor starting at an odd storage offset still decodes (fields are copied out)."""
    rng = np.random.default_rng(7)
    block, _ = GGML_QUANT_SIZES[qtype]
    raw = random_bytes(qtype, 3, rng)
    shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), torch.from_numpy(raw)])[1:]
    assert shifted.storage_offset() == 1
    assert_same_bits(dequantize(shifted, qtype, (3 * block,)), ref_dequantize(raw, qtype).reshape(-1))


@pytest.mark.parametrize("qtype", [Q.F32, Q.BF16, Q.Q8_0, Q.Q4_K, Q.IQ4_XS], ids=lambda t: t.name)
def test_dequantize_rows(qtype: Q) -> None:
    rng = np.random.default_rng(11)
    block, _ = GGML_QUANT_SIZES[qtype]
    n_rows, n_cols = 6, 2 * block
    raw = torch.from_numpy(random_bytes(qtype, n_rows * 2, rng))
    full = dequantize(raw, qtype, (n_rows, n_cols))
    rows = torch.tensor([[5, 0, 2], [2, 2, 1]])
    got = dequantize_rows(raw, qtype, (n_rows, n_cols), rows)
    assert got.shape == (2, 3, n_cols)
    assert torch.equal(got.view(torch.int32), full[rows].view(torch.int32))
    # 1-D row shape (n_rows inferred) and a 0-d index.
    assert torch.equal(dequantize_rows(raw, qtype, (n_cols,), torch.tensor(4)), full[4])


def test_unsupported_type() -> None:
    with pytest.raises(UnsupportedModelError) as exc:
        dequantize(torch.zeros(66, dtype=torch.uint8), Q.IQ2_XXS, (256,), name="blk.0.ffn_up.weight")
    msg = str(exc.value)
    assert "IQ2_XXS" in msg and "blk.0.ffn_up.weight" in msg and "\n" not in msg
    with pytest.raises(UnsupportedModelError):
        dequantize_rows(torch.zeros(66, dtype=torch.uint8), Q.IQ2_XXS, (1, 256), torch.tensor([0]))


def test_bad_sizes() -> None:
    with pytest.raises(ValueError, match="multiple"):
        dequantize(torch.zeros(18, dtype=torch.uint8), Q.Q4_0, (16,))
    with pytest.raises(ValueError, match="bytes"):
        dequantize(torch.zeros(17, dtype=torch.uint8), Q.Q4_0, (32,))
