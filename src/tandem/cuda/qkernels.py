"""Triton kernels for products with GGUF blocks kept quantized in GPU memory.

Each kernel dequantizes tiles of the raw blocks in registers (ggml's layouts, read byte by byte)
and multiplies them with the activations; nothing is dequantized to memory. Two shapes:
- `_qmv`: one activation row per program, elementwise multiply-and-sum (decode: memory bound);
- `_qmm`: tiles of rows through `tl.dot` (prefill: many rows share each dequantized tile).
Both take optional expert ids, so the same kernels compute "selected experts" products
(ggml's mul_mat_id) on stacked expert tensors [E, N, K].
"""

from __future__ import annotations

import triton
import triton.language as tl

# ggml type ids (gguf.GGMLQuantizationType values) the kernels read natively.
Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K = 2, 6, 8, 12, 13, 14


@triton.jit
def _f16(ptr, mask):
    return tl.load(ptr.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _u8(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _k_scale_min(base, s, mask):
    """6-bit scale and min of sub-block s (0..7) from the 12-byte field at base (Q4_K/Q5_K)."""
    lo = s < 4
    b_s = _u8(base + s, mask)
    b_s4 = _u8(base + s + 4, mask)
    b_sm4 = _u8(base + tl.where(lo, s, s - 4), mask)
    sc = tl.where(lo, b_s & 63, (b_s4 & 0xF) | ((b_sm4 >> 6) << 4))
    mn = tl.where(lo, b_s4 & 63, (b_s4 >> 4) | ((b_s >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _dequant(rows, k, mask, QT: tl.constexpr):
    """float32 values at element indices k ([1, BK] or broadcastable) of rows (uint8 pointers [BN, 1])."""
    if QT == 8:  # Q8_0: d f16, 32 x int8
        base = rows + (k // 32) * 34
        q = tl.load(base + 2 + k % 32, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        return q * _f16(base, mask)
    elif QT == 2:  # Q4_0: d f16, 16 bytes of nibbles (low: 0..15, high: 16..31)
        i = k % 32
        base = rows + (k // 32) * 18
        q = (_u8(base + 2 + i % 16, mask) >> (4 * (i // 16))) & 0xF
        return (q - 8).to(tl.float32) * _f16(base, mask)
    elif QT == 6:  # Q5_0: d f16, qh u32 (bit i = 5th bit of element i), 16 bytes of nibbles
        i = k % 32
        base = rows + (k // 32) * 22
        hb = (_u8(base + 2 + i // 8, mask) >> (i % 8)) & 1
        q = ((_u8(base + 6 + i % 16, mask) >> (4 * (i // 16))) & 0xF) | (hb << 4)
        return (q - 16).to(tl.float32) * _f16(base, mask)
    elif QT == 12:  # Q4_K: d, dmin f16, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
        j = k % 256
        base = rows + (k // 256) * 144
        c = j // 64
        hi = (j % 64) // 32
        q = (_u8(base + 16 + c * 32 + j % 32, mask) >> (4 * hi)) & 0xF
        sc, mn = _k_scale_min(base + 4, 2 * c + hi, mask)
        return (_f16(base, mask) * sc) * q.to(tl.float32) - _f16(base + 2, mask) * mn
    elif QT == 13:  # Q5_K: d, dmin, scales[12], qh[32], qs[128]
        j = k % 256
        base = rows + (k // 256) * 176
        c = j // 64
        hi = (j % 64) // 32
        ql = (_u8(base + 48 + c * 32 + j % 32, mask) >> (4 * hi)) & 0xF
        hb = (_u8(base + 16 + j % 32, mask) >> (2 * c + hi)) & 1
        sc, mn = _k_scale_min(base + 4, 2 * c + hi, mask)
        return (_f16(base, mask) * sc) * (ql + 16 * hb).to(tl.float32) - _f16(base + 2, mask) * mn
    else:  # Q6_K: ql[128], qh[64], int8 scales[16], d f16
        j = k % 256
        base = rows + (k // 256) * 210
        h = j // 128
        qq = (j % 128) // 32
        m = j % 32
        nib = (_u8(base + h * 64 + m + 32 * (qq % 2), mask) >> (4 * (qq // 2))) & 0xF
        hb = (_u8(base + 128 + h * 32 + m, mask) >> (2 * qq)) & 3
        q = (nib | (hb << 4)) - 32
        sc = tl.load(base + 192 + h * 8 + m // 16 + 2 * qq, mask=mask, other=0).to(tl.int8, bitcast=True)
        return (_f16(base + 208, mask) * sc.to(tl.float32)) * q.to(tl.float32)


@triton.jit
def _qmv(
    w_ptr, x_ptr, y_ptr, ids_ptr, N, K, row_bytes, expert_bytes, x_div, stride_x, stride_y,
    QT: tl.constexpr, HAS_IDS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """y[r, n] = sum_k x[r // x_div, k] * W[e(r)][n, k]; one output row r per program along axis 1."""
    pid_n = tl.program_id(0)
    r = tl.program_id(1)
    w_base = w_ptr
    if HAS_IDS:
        w_base += tl.load(ids_ptr + r).to(tl.int64) * expert_bytes
    rn = pid_n * BN + tl.arange(0, BN)
    rows = w_base + rn[:, None].to(tl.int64) * row_bytes
    x_row = x_ptr + (r // x_div).to(tl.int64) * stride_x
    acc = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        mask = (rn[:, None] < N) & (kk[None, :] < K)
        w = _dequant(rows, kk[None, :], mask, QT)
        x = tl.load(x_row + kk, mask=kk < K, other=0.0).to(tl.float32)
        acc += tl.sum(tl.where(mask, w, 0.0) * x[None, :], axis=1)
    tl.store(y_ptr + r.to(tl.int64) * stride_y + rn, acc.to(y_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def _qmm(
    w_ptr, x_ptr, y_ptr, tile_expert_ptr, slot_ptr, M, N, K, row_bytes, expert_bytes, x_div, stride_x, stride_y,
    QT: tl.constexpr, HAS_IDS: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr,
):  # fmt: skip
    """Y[rows] = X[rows // x_div] @ W[e]^T for a tile of BM output rows (all of one expert)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    w_base = w_ptr
    if HAS_IDS:
        w_base += tl.load(tile_expert_ptr + pid_m).to(tl.int64) * expert_bytes
        out_rows = tl.load(slot_ptr + pid_m * BM + tl.arange(0, BM))  # -1 pads the expert's last tile
    else:
        out_rows = pid_m * BM + tl.arange(0, BM)
    row_ok = (out_rows >= 0) & (out_rows < M)
    x_rows = tl.where(row_ok, out_rows // x_div, 0).to(tl.int64)
    rn = pid_n * BN + tl.arange(0, BN)
    rows = w_base + rn[:, None].to(tl.int64) * row_bytes
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        k_ok = kk < K
        x = tl.load(x_ptr + x_rows[:, None] * stride_x + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wmask = (rn[:, None] < N) & k_ok[None, :]
        w = tl.where(wmask, _dequant(rows, kk[None, :], wmask, QT), 0.0)
        if IEEE:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
    y = y_ptr + out_rows.to(tl.int64)[:, None] * stride_y + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (rn[None, :] < N))
