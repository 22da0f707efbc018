"""Decode attention: one query token per sequence over its whole KV buffer, split along the keys
(flash-decoding).

The queries' positions live in device memory (a replayed CUDA graph steps them in place), so the grid is
fixed by the buffers' shapes and each program finds its share of the valid keys [lo, p] on the device. A
step holds one sequence (its buffer [S, G, D]) or a batch of B rows over a slot-indexed pool [N, R, G, D],
row b reading slot slots[b] (a device tensor too; slot < 0: a padding row, which reads nothing and returns
zeros); a row's programs compute exactly what the same row alone computes:
- `_decode_partials`, grid (KV heads x blocks of query heads, splits, rows): the valid keys are cut into
  `n_splits` equal runs of whole BLOCK_N tiles; a program runs the online softmax over its run for the
  query heads of one KV head (so each K/V tile is read once for the group) and writes its partial max,
  sum and unnormalised output. Programs whose run is empty (short contexts, padding) store nothing.
- `_decode_combine`, grid (query heads, rows): rescales the partials of the non-empty runs to a common max,
  adds the attention sink to the denominator, divides.

Products: q.k of two operands of one 16-bit type on tensor cores (exact products, f32 sums); of two
different 16-bit types in tf32 (both exact in tf32); with an f32 operand in full f32. Probabilities
meet 16-bit values in that type when the output is 16-bit too (as flash attention does: an error of
the order of the output's own rounding), else in f32.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# Triton's interpreter multiplies bf16 dot operands as their raw uint16 bits: there, every product takes
# f32 copies (of the probabilities still rounded to the values' type, as on the GPU).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

_PROGRAMS_PER_SM = 4  # stage-1 programs per SM at a full context: enough loads in flight to hide latency
_MAX_SPLITS = 256  # bounds the partials and the combine's one-shot load of the split maxima
_TILE_BYTES = 32 * 1024  # K + V bytes per tile (one pipeline stage of shared memory)
_SPLIT_CHUNK = 16  # partial outputs the combine adds per step


@triton.jit
def _split_range(pos_ptr, live, window, n_splits, BLOCK_N: tl.constexpr, POOL: tl.constexpr):
    """The positions [lo, hi) the query at position pos_ptr[0] attends to, and the length of one split's run.

    POOL: where not `live` (a padding row) the range is empty, and the run BLOCK_N long (not 0: the combine
    divides by it); a live row's range is never empty, so its run is BLOCK_N at least anyway."""
    p = tl.load(pos_ptr).to(tl.int32)
    hi = p + 1
    lo = tl.maximum(p + 1 - window, 0)
    if POOL:
        hi = tl.where(live, hi, lo)
    split_len = tl.cdiv(tl.cdiv(hi - lo, n_splits), BLOCK_N) * BLOCK_N
    if POOL:
        split_len = tl.maximum(split_len, BLOCK_N)
    return lo, hi, split_len


@triton.jit
def _tanh(x):
    """tanh from exp (the interpreter has no libdevice): within a few f32 ulps of 1 for any x."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _dot(a, b, acc, F32: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ b, on f32 copies of the operands where F32."""
    if F32:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _decode_partials(
    q_ptr, k_ptr, v_ptr, pos_ptr, slot_ptr, max_ptr, sum_ptr, part_ptr,
    n_keys, window, n_splits, scale, softcap, n_heads,
    stride_qb, stride_qh, stride_kn, stride_ks, stride_kg, stride_vn, stride_vs, stride_vg,
    GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    SOFTCAP: tl.constexpr, QK_F32: tl.constexpr, QK_PRECISION: tl.constexpr, ROUND_P: tl.constexpr,
    PV_F32: tl.constexpr, POOL: tl.constexpr,
):  # fmt: skip
    kv_head = tl.program_id(0) // HEAD_BLOCKS
    split = tl.program_id(1)
    row = tl.program_id(2)  # the batch row (0 for one sequence)
    live = True
    if POOL:  # the row's sequence is its slot of the pool
        slot = tl.load(slot_ptr + row)
        live = slot >= 0
        k_ptr += slot * stride_kn
        v_ptr += slot * stride_vn
    lo, hi, split_len = _split_range(pos_ptr + row, live, window, n_splits, BLOCK_N, POOL)
    start = lo + split * split_len
    end = tl.minimum(start + split_len, hi)  # <= start: nothing to do (the loop below is empty)
    rows = (tl.program_id(0) % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + rows  # [BLOCK_H] query heads of this KV head
    row_ok = (rows < GROUP) & (start < end)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    d_ok = d < D
    dv_ok = dv < DV
    q_row = q_ptr + row * stride_qb
    q = tl.load(q_row + heads[:, None] * stride_qh + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k_head = k_ptr + kv_head * stride_kg
    v_head = v_ptr + kv_head * stride_vg
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        key_rows = (n % n_keys).to(tl.int64)  # position -> row: a ring holds position j in row j % n_keys
        k_t = tl.load(
            k_head + key_rows[None, :] * stride_ks + d[:, None], mask=d_ok[:, None] & n_ok[None, :], other=0.0
        )  # [BLOCK_D, BLOCK_N]
        scores = _dot(q, k_t, tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32), QK_F32, QK_PRECISION) * scale
        if SOFTCAP:
            scores = _tanh(scores / softcap) * softcap
        scores = tl.where(n_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))  # finite: every tile holds a valid key
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])  # [BLOCK_H, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_head + key_rows[:, None] * stride_vs + dv[None, :], mask=n_ok[:, None] & dv_ok[None, :], other=0.0
        )  # [BLOCK_N, BLOCK_DV]
        if ROUND_P:
            p = p.to(v_ptr.dtype.element_ty)
        acc = _dot(p, v, acc * alpha[:, None], PV_F32, "ieee")
        m_i = m_new
    part = (row * n_heads + heads) * n_splits + split
    tl.store(max_ptr + part, m_i, mask=row_ok)
    tl.store(sum_ptr + part, l_i, mask=row_ok)
    tl.store(part_ptr + part[:, None] * DV + dv[None, :], acc, mask=row_ok[:, None] & dv_ok[None, :])


@triton.jit
def _decode_combine(
    max_ptr, sum_ptr, part_ptr, pos_ptr, slot_ptr, sinks_ptr, out_ptr,
    n_keys, window, n_splits, stride_ob, stride_oh,
    DV: tl.constexpr, HAS_SINKS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_DV: tl.constexpr, POOL: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0)
    row = tl.program_id(1)  # the batch row (0 for one sequence)
    live = True
    if POOL:
        live = tl.load(slot_ptr + row) >= 0
    lo, hi, split_len = _split_range(pos_ptr + row, live, window, n_splits, BLOCK_N, POOL)
    n_active = tl.cdiv(hi - lo, split_len)  # the splits that stored partials (none for a padding row)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < n_active
    first = (row * tl.num_programs(0) + head) * n_splits
    m = tl.load(max_ptr + first + s, mask=s_ok, other=float("-inf"))
    m_max = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m_max = tl.maximum(m_max, sink)
    if POOL:  # a padding row: a finite max and a total of 1, so that it returns 0 / 1 (no inf - inf, no 0 / 0)
        m_max = tl.where(live, m_max, 0.0)
    total = tl.sum(tl.exp(m - m_max) * tl.load(sum_ptr + first + s, mask=s_ok, other=0.0), 0)
    if HAS_SINKS:
        total += tl.exp(sink - m_max)
    if POOL:
        total = tl.where(live, total, 1.0)
    dv = tl.arange(0, BLOCK_DV)
    dv_ok = dv < DV
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for c0 in range(0, n_active, CHUNK):
        c = c0 + tl.arange(0, CHUNK)
        c_ok = c < n_active
        w = tl.exp(tl.load(max_ptr + first + c, mask=c_ok, other=float("-inf")) - m_max)
        rows = part_ptr + (first + c)[:, None] * DV + dv[None, :]
        acc += tl.sum(w[:, None] * tl.load(rows, mask=c_ok[:, None] & dv_ok[None, :], other=0.0), 0)
    out_row = out_ptr + row * stride_ob + head * stride_oh
    tl.store(out_row + dv, (acc / total).to(out_ptr.dtype.element_ty), mask=dv_ok)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _tile(block_d: int, block_dv: int, itemsize: int) -> tuple[int, int]:
    """Keys per tile (a power of two, 16 to 64, K + V within _TILE_BYTES) and warps."""
    if _INTERPRET:  # small tiles: the tests' short buffers still span several tiles per split
        return 16, 4
    fit = _TILE_BYTES // ((block_d + block_dv) * itemsize)
    block_n = max(16, min(64, 1 << (fit.bit_length() - 1)))
    return block_n, 4 if block_d + block_dv <= 256 else 8


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    n_splits: int | None = None,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of queries q [B, H, D], row b at position positions[b] (positions [B], a device tensor,
    never read here), over keys j <= positions[b], and positions[b] - j < window if given.

    One sequence (slots None, B = 1): keys [S, G, D] / values [S, G, Dv], position j in row j % S (a ring when
    S < the position). A batch: keys [N, R, G, D] / values [N, R, G, Dv], a pool of N sequences' buffers, and
    slots [B] (int64, on the device): row b reads slot slots[b], position j in its row j % R; a row whose slot
    is negative is padding (a graph captured for more rows than the step has): it reads nothing and its
    output row is zeros. A row's output is bit for bit the one of the same row alone, for the same n_splits.

    scale multiplies q.k; softcap: scores -> tanh(scores / softcap) * softcap; sinks [H]: one extra logit
    per head in the denominator. n_splits (None: enough to fill the GPU with B rows at full buffers) fixes the
    grid. Returns [B, H, Dv] in q's dtype; no host sync, so it can be captured in a CUDA graph."""
    batch, n_heads, d = q.shape
    pool = slots is not None
    if pool:
        assert keys.dim() == values.dim() == 4 and slots.shape == positions.shape == (batch,), "a batch over a pool"
    else:
        assert keys.dim() == values.dim() == 3 and batch == 1, "one sequence: q [1, H, D] over keys [S, G, D]"
    n_keys, n_kv, _ = keys.shape[-3:]
    dv = values.shape[-1]
    group = n_heads // n_kv
    assert keys.stride(-1) == 1 and values.stride(-1) == 1, "the cache's rows are contiguous"
    q = q.contiguous()
    block_h = min(16, triton.next_power_of_2(group))
    head_blocks = triton.cdiv(group, block_h)
    block_d, block_dv = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(dv))
    block_n, warps = _tile(block_d, block_dv, keys.element_size())
    if n_splits is None:  # fewer splits per row as rows fill the GPU
        wanted = triton.cdiv(_PROGRAMS_PER_SM * _sm_count(q.device), batch * n_kv * head_blocks)
        n_splits = max(1, min(wanted, triton.cdiv(n_keys, block_n), _MAX_SPLITS))
    assert batch * n_heads * n_splits * dv < 2**31, "the partials are addressed in int32"
    f32 = torch.float32
    part_max = torch.empty(batch, n_heads, n_splits, dtype=f32, device=q.device)
    part_sum = torch.empty(batch, n_heads, n_splits, dtype=f32, device=q.device)
    part_out = torch.empty(batch, n_heads, n_splits, dv, dtype=f32, device=q.device)
    out = torch.empty(batch, n_heads, dv, dtype=q.dtype, device=q.device)
    window = n_keys if window is None else window
    q32, k32, v32 = (t.element_size() == 4 for t in (q, keys, values))
    # (slot, row, head) strides: one sequence's buffer is the only slot
    k_strides = keys.stride()[:3] if pool else (0, *keys.stride()[:2])
    v_strides = values.stride()[:3] if pool else (0, *values.stride()[:2])
    slot_ptr = slots if pool else positions  # any pointer: not read for one sequence
    _decode_partials[(n_kv * head_blocks, n_splits, batch)](
        q, keys, values, positions, slot_ptr, part_max, part_sum, part_out,
        n_keys, window, n_splits, scale, 1.0 if softcap is None else softcap, n_heads,
        q.stride(0), q.stride(1), *k_strides, *v_strides,
        GROUP=group, HEAD_BLOCKS=head_blocks, D=d, DV=dv,
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv, SOFTCAP=softcap is not None,
        QK_F32=_INTERPRET or q32 or q.dtype != keys.dtype, QK_PRECISION="ieee" if q32 or k32 else "tf32",
        ROUND_P=not (q32 or v32), PV_F32=_INTERPRET or q32 or v32, POOL=pool,
        num_warps=warps, num_stages=2,
    )  # fmt: skip
    _decode_combine[(n_heads, batch)](
        part_max, part_sum, part_out, positions, slot_ptr, part_max if sinks is None else sinks, out,
        n_keys, window, n_splits, out.stride(0), out.stride(1),
        DV=dv, HAS_SINKS=sinks is not None, BLOCK_N=block_n, BLOCK_S=triton.next_power_of_2(n_splits),
        CHUNK=_SPLIT_CHUNK, BLOCK_DV=block_dv, POOL=pool,
    )  # fmt: skip
    return out
