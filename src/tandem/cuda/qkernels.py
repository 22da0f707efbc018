"""Triton kernels for GGUF blocks kept quantized in GPU memory.

- `_qmv`: the decode GEMV, a few activation rows (one per grid row), optional expert ids;
- `_dequant`: codes * scale - min written out as bf16/f32 (dense prefill feeds it to cuBLAS);
- `_align_slots`: groups expert slots by expert into tiles of BM rows (no host sync);
- `_grouped_qmm`: a GEMM over the blocks of the experts, tiles of BM slots of one expert (prefill experts):
  per step each program decodes BK values (sub-blocks of one superblock) of BN rows of W in registers
  (`_subblock_part`) and multiplies them on tensor cores; no float copy of W is written.

`_dequant` and `_grouped_qmm` view a superblock of 256 values as NSUB sub-blocks of SUBLEN values that share
one scale (and, for the K-quants with a minimum, one min): `_subblocks` returns the integer codes
[BN, NSUB, SUBLEN] and the per-sub-block scale and min [BN, NSUB].

`_qmv` reads each weight byte once per activation row, so its time is the bytes of W over the memory
bandwidth (Q4_K 4096 x 2048: 4.7 MB, 1.2 us at 4 TB/s) plus the instructions that decode them. It works on
16-bit words of codes (`_qmv_step`): a nibble or 6-bit code is masked in place, OR-ed into the bits of
2**23 and read as a float (`_field`), and the power of two of its place is folded into the sub-block's scale,
so no code is shifted down and no int-to-float conversion (a quarter-rate instruction) is issued; x is
read in pairs of values, one 32- or 64-bit word per pair. Offline sm_90 builds (`triton.compile` for
GPUTarget("cuda", 90, 32), bf16 x, Triton's divisibility specialization) give, per value of W:
- loads: Q4_K/Q5_K superblocks (144/176 bytes) are 16-byte aligned, so a thread's 16 bytes of codes
  are one 16-byte load (LDG.128); Q6_K (210 bytes) and the 32-value blocks Q8_0/Q4_0/Q5_0 (34/18/22
  bytes) are only 2-byte aligned and load 2 bytes at a time, contiguous per thread. x loads are 16 bytes.
  Scales are loaded per sub-block, at most one 32-bit word per thread and superblock;
- instructions in the loop: Q4_K 7.3-8.4, Q5_K 9.9-11, Q6_K 9.6-11.6, Q8_0 10.2, Q4_0 7.7, Q5_0 12, against
  52 (Q4_K) and 59 (Q6_K) in the kernel it replaced, which loaded and addressed every value's byte on its
  own (each Q4_K byte twice) and converted codes with I2F. No shared memory or barrier in the loop, no
  spills, 32-106 registers.
Expected on the H200 (132 SMs, 4 warp instructions per clock each): Q4_K 4096 x 2048 issues ~2.2 M warp
instructions, ~2 us, against 12.8 us before; narrow products (k/v 512 x 2048, 0.6 MB) are one wave of
loads in flight, bound by launch and latency (~2-3 us). Split-K is not needed for these: with BN = 1 and SB
up to 16 (4 warps along K) a 512-row product already spreads over 512 programs, and every byte of it is
requested in the first loop step.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from tandem.cuda.autotune import graph_bench

# ggml type ids (gguf.GGMLQuantizationType values) the kernels read natively.
Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K = 2, 6, 8, 12, 13, 14

# Decode GEMV shapes: rows per program (BN), superblocks of each row per loop step (SB) and warps, tuned per
# (N, K, type, tier of rows) on first use; the choice is cached on disk (Triton's cache) for later processes.
# Small BN keeps narrow products (N = 512) on hundreds of programs; large SB puts more warps along K. A thread takes
# BN * SB * 256 / (32 * warps) values per step; `qmv_configs` keeps, per type, the counts for which the
# per-sub-block scale loads hold fewer elements than the program has threads (below that, Triton loads them
# in the tile's own register layout; at or above it, it converts the whole tile through shared memory).
# Under Triton's CPU interpreter (tests without a GPU) one configuration, with BN > 1 and SB > 1 to cover the
# masking past N and past K.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Candidates timed from CUDA graphs, so a busy CPU cannot pick them (cuda/autotune.py); the interpreter has one each.
_TIMING = None if _INTERPRET else graph_bench
# (BN, SB, warps); two superblocks a step with more rows suit a short K (Qwen3.6's down: K = 512) and many rows.
QMV_SHAPES = (
    *((1, 2, 1), (1, 4, 2), (1, 8, 4), (2, 4, 4), (2, 2, 2), (4, 2, 4)),  # 16 values per thread
    *((1, 4, 1), (1, 8, 2), (1, 16, 4), (2, 8, 4), (4, 4, 4), (2, 2, 1), (4, 2, 2), (8, 2, 4)),  # 32
    *((2, 4, 1), (4, 4, 2), (4, 2, 1), (8, 2, 2), (16, 2, 4)),  # 64
)
_QMV_CONFIGS = (
    [triton.Config({"BN": 4, "SB": 2}, num_warps=4)]
    if _INTERPRET
    else [triton.Config({"BN": bn, "SB": sb}, num_warps=w) for bn, sb, w in QMV_SHAPES]
)
# Values per thread each type may take (see above): Q4_K/Q5_K load one scale word per superblock, Q6_K four
# scales, the 32-value blocks eight.
_QMV_VALUES = {Q4_K: (32, 64), Q5_K: (32, 64), Q6_K: (16, 32), Q8_0: (16,), Q4_0: (16,), Q5_0: (16,)}


def qmv_configs(configs: list[triton.Config], named_args: dict[str, object], **kwargs: int) -> list[triton.Config]:
    """The configurations of `_QMV_CONFIGS` that suit the type being multiplied and the length of K (autotune's
    early prune): no more superblocks a step than K rounds up to, in powers of two (a short K, e.g. 512 = two
    superblocks, would leave the lanes of a wider step idle)."""
    allowed = _QMV_VALUES[kwargs["QT"]]
    typed = [c for c in configs if c.kwargs["BN"] * c.kwargs["SB"] * 8 // c.num_warps in allowed]
    superblocks = triton.next_power_of_2(triton.cdiv(int(named_args["K"]), 256))  # type: ignore[call-overload]
    most = max(superblocks, min(c.kwargs["SB"] for c in typed))
    return [c for c in typed if c.kwargs["SB"] <= most]


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


@triton.jit
def _f16(ptr, mask):
    return tl.load(ptr.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _u8(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _i8(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)


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


_MAGIC = tl.constexpr(0x4B000000)  # the bits of 2.0**23: OR-ed with an integer below 2**23, a float 2**23 + it


@triton.jit
def _field(t, bits: tl.constexpr, zero: tl.constexpr):
    """(t & bits) - zero * lowest bit of `bits`, as f32, for t = some bits | _MAGIC: the code stays in place
    (a nibble at bits 12..15 reads as 4096 * code; the caller folds 1 / 4096 into its scale). Exact, and two
    full-rate instructions where an int-to-float conversion runs at a fraction of the rate."""
    return (t & (_MAGIC | bits)).to(tl.float32, bitcast=True) - (8388608.0 + zero * (bits & -bits))


@triton.jit
def _w16(ptr, idx, mask):
    """16-bit words idx of the bytes at ptr (2-byte aligned), zero-extended to int32."""
    return tl.load(ptr.to(tl.pointer_type(tl.uint16)) + idx, mask=mask, other=0).to(tl.int32)


@triton.jit
def _x_pairs(x_row, idx, mask):
    """x[2 idx] and x[2 idx + 1] in f32, read as one 32-bit (16-bit x) or 64-bit (f32 x) word each."""
    xt = x_row.dtype.element_ty
    if xt == tl.float32:
        u = tl.load(x_row.to(tl.pointer_type(tl.uint64)) + idx, mask=mask, other=0)
        lo = (u & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
        return lo, (u >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
    u = tl.load(x_row.to(tl.pointer_type(tl.uint32)) + idx, mask=mask, other=0)
    if xt == tl.bfloat16:
        return (u << 16).to(tl.float32, bitcast=True), (u & 0xFFFF0000).to(tl.float32, bitcast=True)
    lo = (u & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, (u >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k_scale_min_words(w1, w2, w3, s):
    """6-bit scale and min of sub-blocks s (0..7) from the 12-byte field of Q4_K/Q5_K read as three int32
    words (byte i of the field is byte i % 4 of word i // 4)."""
    sh = 8 * (s % 4)
    b1 = (w1 >> sh) & 0xFF
    b2 = (w2 >> sh) & 0xFF
    b3 = (w3 >> sh) & 0xFF
    lo = s < 4
    sc = tl.where(lo, b1 & 63, (b3 & 15) | ((b1 >> 6) << 4))
    mn = tl.where(lo, b2 & 63, (b3 >> 4) | ((b2 >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _qmv_step(acc, rows, row_ok, kb, x_row, bcast, K, QT: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr):
    """acc [BN, SB, D2, D3] plus x * W over superblocks kb ([1, SB, 1, 1]; 256 values each) of the rows
    ([BN, 1, 1, 1] uint8 pointers); nothing past K or for rows not ok.

    Element (a, c) of the tile is one 16-bit word of codes (two bytes, so two to four values) and the x
    pairs it multiplies: every load has the tile's shape and its contiguous last axis (x's pointers are
    broadcast over the rows by `bcast`, zeros [BN, 1, 1, 1]), so Triton gives them one register layout and
    each thread finds its x next to its codes. Scales are loaded per sub-block, [BN, SB, D2 or 1, 1]."""
    a = tl.arange(0, D2)[None, None, :, None]
    c = tl.arange(0, D3)[None, None, None, :]
    if QT == 12 or QT == 13:  # Q4_K / Q5_K: d, dmin f16, 12 bytes of scales/mins, (Q5_K: qh[32]), 128 bytes
        # of nibbles; byte i of 32-byte group a: value i of sub-block 2a (low nibble) and of 2a + 1 (high).
        # Superblocks are 16-byte aligned: the words of a thread load as 16-byte vectors. Here (a, c): group
        # a, bytes 2c and 2c + 1.
        ok = row_ok & (kb < K // 256)
        blk = rows + kb * (144 if QT == 12 else 176)
        q = _w16(blk, (8 if QT == 12 else 24) + a * 16 + c, ok)
        if QT == 12:
            lo = q | _MAGIC
            hi = lo
            CODE: tl.constexpr = 0xF
        else:  # bit s of qh[i]: 5th bit of value i of sub-block s, placed above each nibble
            qh = _w16(blk, 8 + c + 0 * a, ok)
            lo = (q & 0x0F0F) | (((qh >> (2 * a)) & 0x0101) << 4) | _MAGIC
            hi = (q & 0xF0F0) | (((qh >> (2 * a + 1)) & 0x0101) << 8) | _MAGIC
            CODE: tl.constexpr = 0x1F
        words = (blk + 4).to(tl.pointer_type(tl.int32))
        w1 = tl.load(words, mask=ok, other=0)
        w2 = tl.load(words + 1, mask=ok, other=0)
        w3 = tl.load(words + 2, mask=ok, other=0)
        d = _f16(blk, ok)
        dmin = _f16(blk + 2, ok)
        sc_lo, m_lo = _k_scale_min_words(w1, w2, w3, 2 * a)
        sc_hi, m_hi = _k_scale_min_words(w1, w2, w3, 2 * a + 1)
        s_lo = d * sc_lo
        s_hi = d * sc_hi
        m_lo *= dmin
        m_hi *= dmin
        xi = kb * 128 + a * 32 + c + bcast
        x0, x1 = _x_pairs(x_row, xi, ok)
        x2, x3 = _x_pairs(x_row, xi + 16, ok)
        acc += (_field(lo, CODE, 0) * s_lo - m_lo) * x0
        acc += (_field(lo, CODE << 8, 0) * (s_lo * (1 / 256)) - m_lo) * x1
        acc += (_field(hi, CODE << 4, 0) * (s_hi * (1 / 16)) - m_hi) * x2
        acc += (_field(hi, CODE << 12, 0) * (s_hi * (1 / 4096)) - m_hi) * x3
    elif QT == 14:  # Q6_K: ql[128], qh[64], int8 scales[16], d f16; 210-byte superblocks: 2-byte aligned
        # value 128h + 32j + l (h: half, j: 0..3, l: 0..31): nibble j // 2 of ql[64h + 32 (j % 2) + l], bits
        # 2j of qh[32h + l] above it, minus 32; scale[8h + 2j + l // 16]. Here a = 2h + l // 16, c: bytes
        # l = 16 (a % 2) + 2c and l + 1.
        ok = row_ok & (kb < K // 256)
        blk = rows + kb * 210
        h = a // 2
        i = h * 32 + (a % 2) * 8 + c  # word of l in ql
        ql0 = _w16(blk, i, ok)
        ql1 = _w16(blk, i + 16, ok)
        qh = _w16(blk, 64 + h * 16 + (a % 2) * 8 + c, ok)
        t0 = (ql0 & 0x0F0F) | ((qh & 0x0303) << 4) | _MAGIC
        t1 = (ql1 & 0x0F0F) | ((qh & 0x0C0C) << 2) | _MAGIC
        t2 = (ql0 & 0xF0F0) | ((qh & 0x3030) << 4) | _MAGIC
        t3 = (ql1 & 0xF0F0) | ((qh & 0xC0C0) << 2) | _MAGIC
        sc = blk + 192 + h * 8 + (a % 2)
        d = _f16(blk + 208, ok)
        xi = kb * 128 + h * 64 + (a % 2) * 8 + c + bcast
        x0, x1 = _x_pairs(x_row, xi, ok)
        s = d * _i8(sc, ok)
        acc += s * (_field(t0, 0x3F, 32) * x0 + _field(t0, 0x3F00, 32) * (1 / 256) * x1)
        x0, x1 = _x_pairs(x_row, xi + 16, ok)
        s = d * _i8(sc + 2, ok)
        acc += s * (_field(t1, 0x3F, 32) * x0 + _field(t1, 0x3F00, 32) * (1 / 256) * x1)
        x0, x1 = _x_pairs(x_row, xi + 32, ok)
        s = d * (1 / 16) * _i8(sc + 4, ok)
        acc += s * (_field(t2, 0x3F0, 32) * x0 + _field(t2, 0x3F000, 32) * (1 / 256) * x1)
        x0, x1 = _x_pairs(x_row, xi + 48, ok)
        s = d * (1 / 16) * _i8(sc + 6, ok)
        acc += s * (_field(t3, 0x3F0, 32) * x0 + _field(t3, 0x3F000, 32) * (1 / 256) * x1)
    else:  # 32-value blocks, d f16 first, 2-byte aligned; a: block of the superblock, c: bytes 2c, 2c + 1
        b = kb * 8 + a
        ok = row_ok & (b < K // 32)
        xi = b * 16 + c + bcast
        if QT == 8:  # Q8_0: d, 32 x int8 (+ 128: unsigned codes)
            blk = rows + b * 34
            t = (_w16(blk, 1 + c, ok) ^ 0x8080) | _MAGIC
            x0, x1 = _x_pairs(x_row, xi, ok)
            acc += _f16(blk, ok) * (_field(t, 0xFF, 128) * x0 + _field(t, 0xFF00, 128) * (1 / 256) * x1)
        else:  # Q4_0 / Q5_0: d, (Q5_0: qh u32, bit i: 5th bit of value i), 16 bytes: byte i holds value i
            # (low nibble) and value 16 + i (high), value = d * (code - 8 or 16)
            if QT == 2:
                blk = rows + b * 18
                q = _w16(blk, 1 + c, ok)
                lo = q | _MAGIC
                hi = lo
                CODE: tl.constexpr = 0xF
                zero: tl.constexpr = 8
            else:
                blk = rows + b * 22
                qh = _w16(blk, 1, ok) | (_w16(blk, 2, ok) << 16)
                q = _w16(blk, 3 + c, ok)
                h_lo = qh >> (2 * c)  # bits 0, 1: 5th bits of values 2c, 2c + 1
                h_hi = qh >> (16 + 2 * c)
                lo = (q & 0x0F0F) | ((h_lo & 1) << 4) | ((h_lo & 2) << 11) | _MAGIC
                hi = (q & 0xF0F0) | ((h_hi & 1) << 8) | ((h_hi & 2) << 15) | _MAGIC
                CODE: tl.constexpr = 0x1F
                zero: tl.constexpr = 16
            x0, x1 = _x_pairs(x_row, xi, ok)
            x2, x3 = _x_pairs(x_row, xi + 8, ok)
            part = _field(lo, CODE, zero) * x0 + _field(lo, CODE << 8, zero) * (1 / 256) * x1
            part += (_field(hi, CODE << 4, zero) * x2 + _field(hi, CODE << 12, zero) * (1 / 256) * x3) * (1 / 16)
            acc += _f16(blk, ok) * part
    return acc


@triton.autotune(
    configs=_QMV_CONFIGS,
    key=["N", "K", "QT", "HAS_IDS", "ROWS_TIER"],
    prune_configs_by={"early_config_prune": qmv_configs},
    cache_results=not _INTERPRET,
    do_bench=_TIMING,
)
@triton.jit(do_not_specialize=["ROWS_TIER"])
def _qmv(
    w_ptr, x_ptr, y_ptr, ids_ptr, N, K, row_bytes, expert_bytes, x_div, stride_x, stride_y, ROWS_TIER,
    QT: tl.constexpr, HAS_IDS: tl.constexpr, BN: tl.constexpr, SB: tl.constexpr,
):  # fmt: skip
    """y[r, n] = sum_k x[r // x_div, k] * W[e(r)][n, k]; output row r along grid axis 1 (zeros where e(r) < 0).
    Each program covers BN rows, SB superblocks (256 values) of each per loop step. ROWS_TIER (`qmv_rows_tier`
    of the grid's rows) is only part of the autotuning key: the best tile for one row is not the best for 128
    (one binary serves every tier)."""
    # Tile [BN, SB, D2, D3] of 16-bit words per superblock step (see _qmv_step).
    D2: tl.constexpr = 4 if QT == 12 or QT == 13 or QT == 14 else 8
    D3: tl.constexpr = 16 if QT == 12 or QT == 13 or QT == 8 else 8
    pid_n = tl.program_id(0)
    r = tl.program_id(1)
    w_base = w_ptr
    rn = pid_n * BN + tl.arange(0, BN)
    if HAS_IDS:
        e = tl.load(ids_ptr + r).to(tl.int64)
        if e < 0:  # a slot another part of a split computes (layers/moe.py split_routing): a row of zeros
            zeros = tl.zeros([BN], dtype=tl.float32)
            tl.store(y_ptr + r.to(tl.int64) * stride_y + rn, zeros.to(y_ptr.dtype.element_ty), mask=rn < N)
            return
        w_base += e * expert_bytes
    n4 = rn[:, None, None, None]
    rows = w_base + n4.to(tl.int64) * row_bytes
    x_row = x_ptr + (r // x_div).to(tl.int64) * stride_x
    kb = tl.arange(0, SB)[None, :, None, None]
    acc = tl.zeros([BN, SB, D2, D3], dtype=tl.float32)
    for kb0 in range(0, tl.cdiv(K, 256), SB):
        acc = _qmv_step(acc, rows, n4 < N, kb0 + kb, x_row, n4 * 0, K, QT, D2, D3)
    y = tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1)
    tl.store(y_ptr + r.to(tl.int64) * stride_y + rn, y.to(y_ptr.dtype.element_ty), mask=rn < N)


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


@triton.autotune(
    configs=_GQMM_CONFIGS, key=["N", "K", "QT", "BM", "IEEE"], cache_results=not _INTERPRET, do_bench=_TIMING
)
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
