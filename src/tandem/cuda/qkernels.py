"""Triton kernels for GGUF blocks kept quantized in GPU memory.

A superblock of 256 values is viewed as NSUB sub-blocks of SUBLEN values that share one scale (and,
for the K-quants with a minimum, one min): `_subblocks` returns the integer codes [BN, NSUB, SUBLEN]
and the per-sub-block scale and min [BN, NSUB], so a kernel multiplies codes by activations first
and applies each scale once per sub-block (ggml's own order of work).
- `_qmv`: one activation row per program (decode; memory bound), optional expert ids;
- `_dequant`: codes * scale - min written out as bf16/f32 (prefill feeds it to a dense GEMM);
- `_grouped_mm`: a GEMM over float weights whose rows are grouped by expert (prefill experts).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Decode GEMV shapes: rows per program and warps, tuned per (N, K, type) on first use. Under Triton's
# CPU interpreter (tests without a GPU) one configuration is enough.
_QMV_CONFIGS = (
    [triton.Config({"BN": 16}, num_warps=4)]
    if os.environ.get("TRITON_INTERPRET") == "1"
    else [triton.Config({"BN": bn}, num_warps=w) for bn in (4, 8, 16, 32) for w in (1, 2, 4)]
)

# ggml type ids (gguf.GGMLQuantizationType values) the kernels read natively.
Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K = 2, 6, 8, 12, 13, 14


@triton.jit
def _f16(ptr, mask):
    return tl.load(ptr.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _u8(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _k_scale_min(field, s, mask):
    """6-bit scales and mins of sub-blocks s (0..7) from the 12-byte field (Q4_K/Q5_K)."""
    lo = s < 4
    b_s = _u8(field + s, mask)
    b_s4 = _u8(field + s + 4, mask)
    b_sm4 = _u8(field + tl.where(lo, s, s - 4), mask)
    sc = tl.where(lo, b_s & 63, (b_s4 & 0xF) | ((b_sm4 >> 6) << 4))
    mn = tl.where(lo, b_s4 & 63, (b_s4 >> 4) | ((b_s >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _subblocks(rows, row_ok, kb, K, QT: tl.constexpr, NSUB: tl.constexpr, SUBLEN: tl.constexpr):
    """Superblock kb of the rows (uint8 pointers [BN, 1]): codes [BN, NSUB, SUBLEN] f32, scale and
    min [BN, NSUB] f32 (value = code * scale - min)."""
    s2 = tl.arange(0, NSUB)[None, :]  # [1, NSUB]
    s = s2[:, :, None]  # [1, NSUB, 1]
    i = tl.arange(0, SUBLEN)[None, None, :]  # [1, 1, SUBLEN]
    r3 = rows[:, :, None]
    ok2 = row_ok & (kb * 256 + s2 * SUBLEN < K)  # [BN, NSUB]: sub-blocks past K (32-blocks) read nothing
    ok3 = ok2[:, :, None]
    mn = tl.zeros(ok2.shape, dtype=tl.float32)
    if QT == 8:  # Q8_0: d f16, 32 x int8
        b3 = r3 + (kb * 8 + s) * 34
        q = tl.load(b3 + 2 + i, mask=ok3, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        scale = _f16(rows + (kb * 8 + s2) * 34, ok2)
    elif QT == 2:  # Q4_0: d f16, 16 bytes (low nibbles: values 0..15, high: 16..31), value = d * (q - 8)
        b3 = r3 + (kb * 8 + s) * 18
        q = (((_u8(b3 + 2 + i % 16, ok3) >> (4 * (i // 16))) & 0xF) - 8).to(tl.float32)
        scale = _f16(rows + (kb * 8 + s2) * 18, ok2)
    elif QT == 6:  # Q5_0: d f16, qh u32 (bit i: 5th bit of value i), 16 bytes of nibbles
        b3 = r3 + (kb * 8 + s) * 22
        hb = (_u8(b3 + 2 + i // 8, ok3) >> (i % 8)) & 1
        q = ((((_u8(b3 + 6 + i % 16, ok3) >> (4 * (i // 16))) & 0xF) | (hb << 4)) - 16).to(tl.float32)
        scale = _f16(rows + (kb * 8 + s2) * 22, ok2)
    elif QT == 12:  # Q4_K: d, dmin f16, 12 bytes of 6-bit scales/mins, 128 bytes (sub-block pairs share bytes)
        b3 = r3 + kb * 144
        q = ((_u8(b3 + 16 + (s // 2) * 32 + i, ok3) >> (4 * (s % 2))) & 0xF).to(tl.float32)
        b2 = rows + kb * 144
        sc, m = _k_scale_min(b2 + 4, s2, ok2)
        scale = _f16(b2, ok2) * sc
        mn = _f16(b2 + 2, ok2) * m
    elif QT == 13:  # Q5_K: d, dmin, scales[12], qh[32] (bit s: 5th bit in sub-block s), qs[128]
        b3 = r3 + kb * 176
        ql = (_u8(b3 + 48 + (s // 2) * 32 + i, ok3) >> (4 * (s % 2))) & 0xF
        hb = (_u8(b3 + 16 + i, ok3) >> s) & 1
        q = (ql | (hb << 4)).to(tl.float32)
        b2 = rows + kb * 176
        sc, m = _k_scale_min(b2 + 4, s2, ok2)
        scale = _f16(b2, ok2) * sc
        mn = _f16(b2 + 2, ok2) * m
    else:  # Q6_K (NSUB=16, SUBLEN=16): ql[128], qh[64], int8 scales[16], d f16
        b3 = r3 + kb * 210
        j = s * 16 + i  # value index in the superblock
        h = j // 128
        qq = (j % 128) // 32
        m32 = j % 32
        nib = (_u8(b3 + h * 64 + m32 + 32 * (qq % 2), ok3) >> (4 * (qq // 2))) & 0xF
        hb = (_u8(b3 + 128 + h * 32 + m32, ok3) >> (2 * qq)) & 3
        q = ((nib | (hb << 4)) - 32).to(tl.float32)
        b2 = rows + kb * 210
        sc = tl.load(b2 + 192 + s2, mask=ok2, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        scale = _f16(b2 + 208, ok2) * sc
    return q, scale, mn


@triton.autotune(configs=_QMV_CONFIGS, key=["N", "K", "QT", "HAS_IDS"])
@triton.jit
def _qmv(
    w_ptr, x_ptr, y_ptr, ids_ptr, N, K, row_bytes, expert_bytes, x_div, stride_x, stride_y,
    QT: tl.constexpr, HAS_IDS: tl.constexpr, BN: tl.constexpr, NSUB: tl.constexpr, SUBLEN: tl.constexpr,
):  # fmt: skip
    """y[r, n] = sum_k x[r // x_div, k] * W[e(r)][n, k]; output row r along grid axis 1."""
    pid_n = tl.program_id(0)
    r = tl.program_id(1)
    w_base = w_ptr
    if HAS_IDS:
        w_base += tl.load(ids_ptr + r).to(tl.int64) * expert_bytes
    rn = pid_n * BN + tl.arange(0, BN)
    row_ok = (rn < N)[:, None]
    rows = w_base + rn[:, None].to(tl.int64) * row_bytes
    x_row = x_ptr + (r // x_div).to(tl.int64) * stride_x
    sub = tl.arange(0, NSUB)[:, None] * SUBLEN + tl.arange(0, SUBLEN)[None, :]  # [NSUB, SUBLEN]
    acc = tl.zeros([BN], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, 256)):
        q, scale, mn = _subblocks(rows, row_ok, kb, K, QT, NSUB, SUBLEN)
        k = kb * 256 + sub
        x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)  # [NSUB, SUBLEN]
        acc += tl.sum(tl.sum(q * x[None, :, :], axis=2) * scale, axis=1)
        acc -= tl.sum(mn * tl.sum(x, axis=1)[None, :], axis=1)
    tl.store(y_ptr + r.to(tl.int64) * stride_y + rn, acc.to(y_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def _dequant(
    w_ptr, out_ptr, N, K, row_bytes,
    QT: tl.constexpr, BN: tl.constexpr, NSUB: tl.constexpr, SUBLEN: tl.constexpr,
):  # fmt: skip
    """out[n, k] = value of row n (rows of all experts are contiguous, so N may be E * N)."""
    pid_n = tl.program_id(0)
    kb = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    row_ok = (rn < N)[:, None]
    rows = w_ptr + rn[:, None].to(tl.int64) * row_bytes
    q, scale, mn = _subblocks(rows, row_ok, kb, K, QT, NSUB, SUBLEN)
    val = q * scale[:, :, None] - mn[:, :, None]
    k = kb * 256 + tl.arange(0, NSUB)[None, :, None] * SUBLEN + tl.arange(0, SUBLEN)[None, None, :]
    out = out_ptr + rn.to(tl.int64)[:, None, None] * K + k
    tl.store(out, val.to(out_ptr.dtype.element_ty), mask=row_ok[:, :, None] & (k < K))


@triton.jit
def _grouped_mm(
    w_ptr, x_ptr, y_ptr, tile_expert_ptr, slot_ptr, tile0, M, N, K, x_div, stride_x, stride_y,
    IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """Y[rows] = X[rows // x_div] @ W[e]^T for tiles of BM slots of one expert; W float [E', N, K]
    (expert ids relative to w_ptr); slot -1 pads an expert's last tile."""
    pid_n = tl.program_id(0)
    tile = tile0 + tl.program_id(1)
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    out_rows = tl.load(slot_ptr + tile * BM + tl.arange(0, BM))
    row_ok = (out_rows >= 0) & (out_rows < M)
    x_rows = tl.where(row_ok, out_rows // x_div, 0).to(tl.int64)
    rn = pid_n * BN + tl.arange(0, BN)
    w_rows = w_ptr + e * N * K + rn[:, None].to(tl.int64) * K
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        k_ok = kk < K
        x = tl.load(x_ptr + x_rows[:, None] * stride_x + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=(rn[:, None] < N) & k_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x.to(w.dtype), tl.trans(w))
    y = y_ptr + out_rows.to(tl.int64)[:, None] * stride_y + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (rn[None, :] < N))
