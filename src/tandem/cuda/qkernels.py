"""Triton kernels for GGUF blocks kept quantized in GPU memory.

A superblock of 256 values is viewed as NSUB sub-blocks of SUBLEN values that share one scale (and,
for the K-quants with a minimum, one min): `_subblocks` returns the integer codes [BN, NSUB, SUBLEN]
and the per-sub-block scale and min [BN, NSUB], so a kernel multiplies codes by activations first
and applies each scale once per sub-block (ggml's own order of work).
- `_qmv`: one activation row per program (decode; memory bound), optional expert ids;
- `_dequant`: codes * scale - min written out as bf16/f32 (dense prefill feeds it to cuBLAS);
- `_align_slots`: groups expert slots by expert into tiles of BM rows (no host sync);
- `_grouped_qmm`: a GEMM over the blocks of the experts, tiles of BM slots of one expert (prefill experts):
  per step each program decodes BK values (sub-blocks of one superblock) of BN rows of W in registers
  (`_subblock_part`) and multiplies them on tensor cores; no float copy of W is written.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Decode GEMV shapes: rows per program, superblocks per loop step (more bytes in flight) and warps, tuned
# per (N, K, type) on first use; the choice is cached on disk (Triton's cache) for later processes. Under
# Triton's CPU interpreter (tests without a GPU) one configuration, with KSTEP > 1 to cover the unrolled
# step and its masking past K.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_QMV_CONFIGS = (
    [triton.Config({"BN": 8, "KSTEP": 2}, num_warps=4)]
    if _INTERPRET
    else [
        triton.Config({"BN": bn, "KSTEP": ks}, num_warps=w)
        for bn, ks, w in ((4, 4, 2), (8, 2, 2), (8, 4, 4), (16, 1, 4), (16, 2, 4), (16, 4, 8), (32, 2, 8), (32, 1, 4))
    ]
)

# Grouped expert GEMM: output columns per program (BN), values per product (BK: 64 or 128, sub-blocks of
# one superblock) and warps, tuned per (N, K, type, BM, precision) on first use and cached on disk; BM (slots
# per tile) is the caller's, which builds the tiles before the launch. Offline sm_90 builds of these (with
# Triton's divisibility specialization) take 56-226 registers and no spills for every type, bf16 and ieee.
# The interpreter's configuration takes BK = 128 to cover sub-block offsets inside a superblock.
_GQMM_CONFIGS = (
    [triton.Config({"BN": 32, "BK": 128}, num_warps=4)]
    if _INTERPRET
    else [
        triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=st)
        for bn, bk, w, st in ((64, 64, 8, 2), (64, 64, 4, 2), (128, 64, 8, 2), (64, 128, 8, 2), (32, 64, 4, 3))
    ]
)

# Triton's interpreter multiplies bf16 dot operands as their raw uint16 bits; it gets f32 copies instead.
_BF16_DOT = tl.constexpr(not _INTERPRET)

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
    return _subblock_part(rows, row_ok, kb, 0, K, QT, NSUB, SUBLEN)


@triton.jit
def _subblock_part(rows, row_ok, kb, s0, K, QT: tl.constexpr, NSUB: tl.constexpr, SUBLEN: tl.constexpr):
    """Sub-blocks s0 .. s0 + NSUB - 1 of superblock kb (values (kb * 256 + s0 * SUBLEN) + [0, NSUB * SUBLEN))
    of the rows: codes [BN, NSUB, SUBLEN] f32, scale and min [BN, NSUB] f32."""
    s2 = s0 + tl.arange(0, NSUB)[None, :]  # [1, NSUB]
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


@triton.autotune(configs=_QMV_CONFIGS, key=["N", "K", "QT", "HAS_IDS"], cache_results=not _INTERPRET)
@triton.jit
def _qmv(
    w_ptr, x_ptr, y_ptr, ids_ptr, N, K, row_bytes, expert_bytes, x_div, stride_x, stride_y,
    QT: tl.constexpr, HAS_IDS: tl.constexpr, BN: tl.constexpr, KSTEP: tl.constexpr, NSUB: tl.constexpr,
    SUBLEN: tl.constexpr,
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
    for kb0 in range(0, tl.cdiv(K, 256), KSTEP):
        for j in tl.static_range(KSTEP):  # unrolled: the loads of KSTEP superblocks are issued together
            kb = kb0 + j
            q, scale, mn = _subblocks(rows, row_ok, kb, K, QT, NSUB, SUBLEN)  # masked past K
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
def _align_slots(
    sorted_ptr, order_ptr, tile_expert_ptr, slot_ptr, tiles_ptr, R, E, n_iter,
    BM: tl.constexpr, EP: tl.constexpr,
):  # fmt: skip
    """Tile t (one program each) of the slots grouped by expert: each expert owns ceil(count / BM)
    consecutive tiles, in expert order; its slots fill them in order, the rest of its last tile is -1.
    Writes tile_expert[t] (-1 past the last used tile) and slot[t * BM: (t + 1) * BM]; program 0 also
    writes tiles[e] (tiles of expert e). sorted: the R expert ids sorted (stably), order: their slots."""
    ex = tl.arange(0, EP)
    e_ok = ex < E
    # first index of expert e and of e + 1 in the sorted ids: binary searches, n_iter >= log2(R + 1) steps
    lo_a = tl.zeros([EP], dtype=tl.int32)
    hi_a = tl.zeros([EP], dtype=tl.int32) + R
    lo_b = lo_a
    hi_b = hi_a
    for _ in range(n_iter):
        mid_a = (lo_a + hi_a) // 2
        act_a = lo_a < hi_a
        less_a = tl.load(sorted_ptr + mid_a, mask=act_a, other=0) < ex
        lo_a = tl.where(act_a & less_a, mid_a + 1, lo_a)
        hi_a = tl.where(act_a & ~less_a, mid_a, hi_a)
        mid_b = (lo_b + hi_b) // 2
        act_b = lo_b < hi_b
        less_b = tl.load(sorted_ptr + mid_b, mask=act_b, other=0) < ex + 1
        lo_b = tl.where(act_b & less_b, mid_b + 1, lo_b)
        hi_b = tl.where(act_b & ~less_b, mid_b, hi_b)
    start = lo_a
    count = tl.where(e_ok, lo_b - lo_a, 0)
    n_tiles = (count + BM - 1) // BM
    tile_end = tl.cumsum(n_tiles, 0)
    tile_start = tile_end - n_tiles
    t = tl.program_id(0)
    own = (tile_start <= t) & (t < tile_end)  # the expert owning tile t (none past the last used tile)
    used = tl.sum(own.to(tl.int32), axis=0) > 0
    e = tl.sum(tl.where(own, ex, 0), axis=0)
    shift = tl.sum(tl.where(own, tile_start * BM - start, 0), axis=0)  # tile row p holds sorted slot p - shift
    end = tl.sum(tl.where(own, start + count, 0), axis=0)
    p = t * BM + tl.arange(0, BM)
    j = p - shift
    slot = tl.load(order_ptr + j, mask=used & (j < end), other=-1)
    tl.store(slot_ptr + p.to(tl.int64), slot.to(tl.int32))
    tl.store(tile_expert_ptr + t, tl.where(used, e, -1).to(tl.int32))
    tl.store(tiles_ptr + ex, n_tiles, mask=e_ok & (t == 0))


@triton.autotune(configs=_GQMM_CONFIGS, key=["N", "K", "QT", "BM", "IEEE"], cache_results=not _INTERPRET)
@triton.jit(do_not_specialize=["tile0", "e0"])
def _grouped_qmm(
    w_ptr, x_ptr, y_ptr, tile_expert_ptr, slot_ptr, tile0, e0, N, K, row_bytes, expert_bytes, x_div, stride_x,
    stride_y, QT: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    NSUB: tl.constexpr, SUBLEN: tl.constexpr,
):  # fmt: skip
    """Y[rows] = X[rows // x_div] @ W[e]^T for tile tile0 + program_id(1) of BM slots of expert e (from
    `_align_slots`), output columns along axis 0. W: the blocks of experts e0.. at w_ptr; a tile of expert
    -1 is unused (the grid covers the tiles' upper bound) and slot -1 pads an expert's last tile."""
    pid_n = tl.program_id(0)
    tile = tile0 + tl.program_id(1)
    e = tl.load(tile_expert_ptr + tile)
    if e < 0:
        return
    w_base = w_ptr + (e - e0).to(tl.int64) * expert_bytes
    out_rows = tl.load(slot_ptr + tile.to(tl.int64) * BM + tl.arange(0, BM))
    row_ok = out_rows >= 0
    x_rows = tl.where(row_ok, out_rows // x_div, 0).to(tl.int64)
    rn = pid_n * BN + tl.arange(0, BN)
    n_ok = rn < N
    rows = w_base + rn[:, None].to(tl.int64) * row_bytes
    x_tile = x_ptr + x_rows[:, None] * stride_x
    kk = tl.arange(0, BK)[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):  # BK values (BK // SUBLEN sub-blocks of one superblock) per product
        q, scale, mn = _subblock_part(rows, n_ok[:, None], k0 // 256, (k0 % 256) // SUBLEN, K, QT, BK // SUBLEN, SUBLEN)
        w = tl.reshape(q * scale[:, :, None] - mn[:, :, None], (BN, BK))  # zero past K and N
        k = k0 + kk
        x = tl.load(x_tile + k, mask=row_ok[:, None] & (k < K), other=0.0)
        if IEEE:
            acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
        else:  # bf16 operands, f32 accumulation (tensor cores)
            xb, wb = x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16))
            if _BF16_DOT:
                acc = tl.dot(xb, wb, acc)
            else:  # the interpreter's dot reads bf16 as raw uint16: the same exact products, in f32
                acc = tl.dot(xb.to(tl.float32), wb.to(tl.float32), acc, input_precision="ieee")
    y = y_ptr + out_rows.to(tl.int64)[:, None] * stride_y + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
