"""Triton kernels for RMSNorm and rotary embeddings: one launch each where torch takes 3 to 10.

- `_rms_norm`: one row of the last dimension per program, f32 arithmetic, output in the input's dtype;
  optionally after a residual add, writing the sum too (one kernel for `x + h` and the norm);
- `_rope`: one head of one token per program (NEOX pairs (i, i + dim/2)), optionally after a per-head RMSNorm
  (q/k norms), cos/sin gathered at the token's position read on the device, so a captured CUDA graph
  replays with new positions; optionally written straight into a KV-cache row at that position (of one
  sequence's buffer, or of the slot, read on the device too, of a batch's pool of buffers);
- `_normed_residual`: a block's tail in one launch, x + post_norm(norm(a) + norm(b)) times a scale, every part
  optional (Gemma's sandwich norms around two FFN branches, or a post-norm and its residual add);
- `_store_rows`: rows cast into a buffer (or a pool's slots) at positions read on the device (values into
  the KV cache).

Both read strided inputs (views) directly and write contiguous outputs. They run on whatever device the
tensors are on, so Triton's interpreter (tests without a GPU) runs the same wrappers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Widest row chunk a norm program holds in registers; longer rows take two passes over chunks.
_MAX_BLOCK = 4096


@triton.jit
def _inv_rms(sum_sq, n, eps):
    """1 / sqrt(mean + eps), correctly rounded (as the CPU path's sqrtf and division)."""
    return tl.div_rn(1.0, tl.sqrt_rn(sum_sq / n + eps))


@triton.jit
def _row_values(x_row, h_row, offs, mask, x_stride, h_stride, sum_ptr, RESIDUAL: tl.constexpr):
    """Values offs of a row in f32: x, or with RESIDUAL x + h (f32 add, one rounding to sum's dtype, as torch
    adds: the norm then reads the rounded sum, as the unfused ops do)."""
    x = tl.load(x_row + offs * x_stride, mask=mask, other=0.0).to(tl.float32)
    if RESIDUAL:
        x += tl.load(h_row + offs * h_stride, mask=mask, other=0.0).to(tl.float32)
        x = x.to(sum_ptr.dtype.element_ty).to(tl.float32)
    return x


@triton.jit
def _rms_norm(
    x_ptr, h_ptr, w_ptr, sum_ptr, out_ptr, n_cols, x_stride_row, x_stride_col, h_stride_row, h_stride_col,
    w_stride, eps, RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, N_CHUNKS: tl.constexpr,
):  # fmt: skip
    """out[row] = v[row] / rms(v[row]) * w with v = x, or with RESIDUAL v = x + h, also written to sum (rows of
    n_cols values; x and h strided, sum and out contiguous)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride_row
    h_row = h_ptr + row * h_stride_row
    sum_row = sum_ptr + row * n_cols
    out_row = out_ptr + row * n_cols
    cols = tl.arange(0, BLOCK)
    if N_CHUNKS == 1:  # the row stays in registers: one read
        mask = cols < n_cols
        x = _row_values(x_row, h_row, cols, mask, x_stride_col, h_stride_col, sum_ptr, RESIDUAL)
        if RESIDUAL:
            tl.store(sum_row + cols, x.to(sum_ptr.dtype.element_ty), mask=mask)
        scale = _inv_rms(tl.sum(x * x, axis=0), n_cols, eps)
        w = tl.load(w_ptr + cols * w_stride, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_row + cols, (x * scale * w).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(N_CHUNKS):
            offs = c * BLOCK + cols
            mask = offs < n_cols
            x = _row_values(x_row, h_row, offs, mask, x_stride_col, h_stride_col, sum_ptr, RESIDUAL)
            if RESIDUAL:
                tl.store(sum_row + offs, x.to(sum_ptr.dtype.element_ty), mask=mask)
            acc += x * x
        scale = _inv_rms(tl.sum(acc, axis=0), n_cols, eps)
        for c in range(N_CHUNKS):  # the values again (the sum recomputed: reading it back would need a barrier)
            offs = c * BLOCK + cols
            mask = offs < n_cols
            x = _row_values(x_row, h_row, offs, mask, x_stride_col, h_stride_col, sum_ptr, RESIDUAL)
            w = tl.load(w_ptr + offs * w_stride, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_row + offs, (x * scale * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _normed(v, w_row, cols, mask, n_cols, w_stride, eps):
    """v / rms(v) * w in f32, as `_rms_norm` computes it (one chunk)."""
    scale = _inv_rms(tl.sum(v * v, axis=0), n_cols, eps)
    return v * scale * tl.load(w_row + cols * w_stride, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _normed_residual(
    x_ptr, a_ptr, wa_ptr, b_ptr, wb_ptr, wp_ptr, s_ptr, out_ptr, n_cols, x_stride, a_stride, b_stride,
    wa_stride, wb_stride, wp_stride, s_stride, eps_a, eps_b, eps_p,
    NORM_A: tl.constexpr, HAS_B: tl.constexpr, NORM_B: tl.constexpr, POST: tl.constexpr, SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """out[row] = (x + post(norm_a(a) + norm_b(b))) * s, each norm and s optional, every value f32 (rows of at
    most BLOCK contiguous values: one chunk), in the order and with the arithmetic of the unfused ops."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    h = tl.load(a_ptr + row * a_stride + cols, mask=mask, other=0.0)
    if NORM_A:
        h = _normed(h, wa_ptr, cols, mask, n_cols, wa_stride, eps_a)
    if HAS_B:
        b = tl.load(b_ptr + row * b_stride + cols, mask=mask, other=0.0)
        if NORM_B:
            b = _normed(b, wb_ptr, cols, mask, n_cols, wb_stride, eps_b)
        h = h + b
    if POST:
        h = _normed(h, wp_ptr, cols, mask, n_cols, wp_stride, eps_p)
    y = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0) + h
    if SCALE:
        y = y * tl.load(s_ptr + cols * s_stride, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, y, mask=mask)


@triton.jit
def _rope(
    x_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, w_ptr, out_ptr, out_rows, head_dim, stride_t, stride_h, stride_d,
    w_stride, eps, HALF: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr, STORE: tl.constexpr,
    POOL: tl.constexpr,
):  # fmt: skip
    """out[t, h] = rotate(norm?(x[t, h])) at pos[t]; one (token, head) per program.

    STORE: out is a KV-cache buffer [R, H, Dh] and the result goes to its row pos[t] % R instead of row t;
    with POOL a pool [N, R, H, Dh], row slot[t] * R + pos[t] % R, nothing for slot[t] < 0 (padding)."""
    # Every lane d computes x[d] * cos + x[partner] * (+-sin): lanes past the rotated 2 * HALF get cos 1,
    # sin 0 and pass through (partial rotary).
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, BLOCK)
    in_head = d < head_dim
    rotated = d < 2 * HALF
    if POOL:  # a padding token loads nothing (its position need not lie in the tables) and stores nothing
        slot = tl.load(slot_ptr + t)
        in_head = in_head & (slot >= 0)
        rotated = rotated & (slot >= 0)
    first = d < HALF
    pair = tl.where(first, d, d - HALF)
    partner = tl.where(first, d + HALF, d - HALF)
    x_head = x_ptr + t * stride_t + h * stride_h
    x = tl.load(x_head + d * stride_d, mask=in_head, other=0.0).to(tl.float32)
    xp = tl.load(x_head + partner * stride_d, mask=rotated, other=0.0).to(tl.float32)
    if NORM:
        scale = _inv_rms(tl.sum(x * x, axis=0), head_dim, eps)
        x = x * scale * tl.load(w_ptr + d * w_stride, mask=in_head, other=0.0).to(tl.float32)
        xp = xp * scale * tl.load(w_ptr + partner * w_stride, mask=rotated, other=0.0).to(tl.float32)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    table = pos * HALF + pair
    cos = tl.load(cos_ptr + table, mask=rotated, other=1.0)
    sin = tl.load(sin_ptr + table, mask=rotated, other=0.0)
    out = x * cos + xp * tl.where(first, -sin, sin)  # x1*cos - x2*sin | x2*cos + x1*sin
    # Rounded to x's dtype first (a no-op unless STORE): the cache holds what rope-then-cast stored.
    out = out.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty)
    row = pos % out_rows if STORE else t
    if POOL:
        row += slot * out_rows
    tl.store(out_ptr + (row * tl.num_programs(1) + h) * head_dim + d, out, mask=in_head)


@triton.jit
def _store_rows(
    x_ptr, pos_ptr, slot_ptr, out_ptr, out_rows, head_dim, stride_t, stride_h, stride_d, BLOCK: tl.constexpr,
    POOL: tl.constexpr,
):  # fmt: skip
    """out[pos[t] % R, h] = x[t, h] in out's dtype (one rounding, as `Tensor.to`), out [R, H, Dh]; with POOL
    out [N, R, H, Dh] and row slot[t] * R + pos[t] % R, nothing for slot[t] < 0 (padding); one (token, head)
    per program."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, BLOCK)
    mask = d < head_dim
    row = tl.load(pos_ptr + t).to(tl.int64) % out_rows
    if POOL:  # a padding token loads and stores nothing
        slot = tl.load(slot_ptr + t)
        mask = mask & (slot >= 0)
        row += slot * out_rows
    x = tl.load(x_ptr + t * stride_t + h * stride_h + d * stride_d, mask=mask)
    tl.store(out_ptr + (row * tl.num_programs(1) + h) * head_dim + d, x.to(out_ptr.dtype.element_ty), mask=mask)


def _w_stride(w: torch.Tensor) -> int:
    return 0 if w.numel() == 1 else w.stride(-1)  # a scalar weight (0-dim or [1]) is broadcast


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dimension, in f32, returned in x's dtype.

    weight: [D] or a scalar tensor (0-dim or [1]) of any float dtype."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_norm(x, None, weight, eps, out, out)
    return out


def add_rms_norm_rows(
    x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + h, rms_norm(x + h)) in one kernel, both in x's dtype: the sum rounded once as torch's `x + h`
    rounds it (x and h of one dtype and shape), the norm computed from that rounded sum as `rms_norm_rows`."""
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_norm(x, h, weight, eps, total, out)
    return total, out


def normed_residual_fits(x: torch.Tensor, rows: list[torch.Tensor], vectors: list[torch.Tensor]) -> bool:
    """Whether `normed_residual_rows` takes these: x and the rows f32 of one shape, of at most one chunk, with
    contiguous last dimensions; the weights and scale on x's device, [D] or scalars."""
    n = x.shape[-1]
    return (
        0 < n <= _MAX_BLOCK
        and all(r.dtype == torch.float32 and r.shape == x.shape and r.stride(-1) == 1 for r in (x, *rows))
        and all(t.device == x.device for t in (*rows, *vectors))
        and all(v.numel() in (1, n) and v.is_floating_point() for v in vectors)
    )


def normed_residual_rows(
    x: torch.Tensor,
    a: torch.Tensor,
    a_norm: tuple[torch.Tensor, float] | None,
    b: torch.Tensor | None = None,
    b_norm: tuple[torch.Tensor, float] | None = None,
    post_norm: tuple[torch.Tensor, float] | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """(x + post(norm_a(a) + norm_b(b))) * scale in one kernel (each norm a (weight, eps), each part optional):
    f32 rows of one shape, the weights and scale [D] or scalar tensors (see `normed_residual_fits`); f32 out."""
    n = x.shape[-1]
    rows = [t.reshape(-1, n) for t in (x, a, a if b is None else b)]
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    unused = (x, 0.0)  # any pointer where a part is absent
    wa, eps_a = a_norm or unused
    wb, eps_b = b_norm or unused
    wp, eps_p = post_norm or unused
    s = x if scale is None else scale
    block = triton.next_power_of_2(n)
    _normed_residual[(rows[0].shape[0],)](
        rows[0], rows[1], wa, rows[2], wb, wp, s, out, n, *(r.stride(0) for r in rows),
        *(_w_stride(w) for w in (wa, wb, wp, s)), eps_a, eps_b, eps_p,
        NORM_A=a_norm is not None, HAS_B=b is not None, NORM_B=b_norm is not None, POST=post_norm is not None,
        SCALE=scale is not None, BLOCK=block, num_warps=max(1, min(8, block // 512)),
    )  # fmt: skip
    return out


def _launch_norm(
    x: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor, eps: float, total: torch.Tensor, out: torch.Tensor
) -> None:
    """`_rms_norm` over the rows of x (+ h into total, when h is given) into out."""
    n = x.shape[-1]
    x_rows = x.reshape(-1, n)  # a view whenever the leading dimensions merge
    h_rows = x_rows if h is None else h.reshape(-1, n)  # not read without a residual
    block = min(triton.next_power_of_2(n), _MAX_BLOCK)
    _rms_norm[(x_rows.shape[0],)](
        x_rows, h_rows, weight, total, out, n, *x_rows.stride(), *h_rows.stride(), _w_stride(weight), eps,
        RESIDUAL=h is not None, BLOCK=block, N_CHUNKS=triton.cdiv(n, block), num_warps=max(1, min(8, block // 512)),
    )  # fmt: skip


def _rows_into(x: torch.Tensor, into: torch.Tensor, slots: torch.Tensor | None) -> int:
    """R, the rows of one sequence's buffer: into is [R, H, Dh], or with slots [T] a pool [N, R, H, Dh] (the
    kernels address either as contiguous [*, H, Dh] rows)."""
    dims = 3 if slots is None else 4
    shapes = (tuple(into.shape), tuple(x.shape))
    assert into.is_contiguous() and into.dim() == dims and into.shape[-2:] == x.shape[1:], shapes
    assert slots is None or slots.shape == x.shape[:1], (tuple(slots.shape), tuple(x.shape))
    return into.shape[-3]


def rope_rows(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    into: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """NEOX rotation of x [T, H, Dh] at `positions` [T] (a device tensor, never read on the host), with
    contiguous f32 tables cos/sin [P, dim/2] (dim <= Dh: the dimensions past dim pass through; positions
    must lie in the tables: nothing checks them on the device), in x's dtype.

    norm: an RMSNorm weight [Dh] (or scalar) applied per head before rotating, in f32 (no rounding between).
    into: a contiguous buffer [R, H, Dh] (a KV cache): the rotated token t goes to its row positions[t] % R (a
    sliding-window ring; R is the context for a full cache), rounded to x's dtype then to into's (as rotating
    then casting), and `into` is returned.
    slots (with into; [T] int64, a device tensor): into is a contiguous pool [N, R, H, Dh] of sequences' buffers
    and token t goes to row positions[t] % R of slot slots[t]; a token whose slot is negative is padding: it
    reads nothing (its position may lie outside the tables) and stores nothing."""
    t, h, dh = x.shape
    half = cos.shape[1]
    if into is None:
        assert slots is None, "slots name the rows of `into`"
        out = torch.empty((t, h, dh), dtype=x.dtype, device=x.device)
        rows = t
    else:
        rows = _rows_into(x, into, slots)
        out = into
    block = triton.next_power_of_2(dh)
    w = x if norm is None else norm  # any pointer when there is no norm
    _rope[(t, h)](
        x, positions, positions if slots is None else slots, cos, sin, w, out, rows, dh, *x.stride(),
        0 if norm is None else _w_stride(norm), eps,
        HALF=half, BLOCK=block, NORM=norm is not None, STORE=into is not None, POOL=slots is not None,
        num_warps=max(1, block // 256),
    )  # fmt: skip
    return out


def store_rows(
    x: torch.Tensor, positions: torch.Tensor, into: torch.Tensor, slots: torch.Tensor | None = None
) -> torch.Tensor:
    """into[positions[t] % R] = x[t] in into's dtype (x [T, H, Dh], strided; into contiguous [R, H, Dh]; positions
    a device tensor, never read on the host, distinct modulo R): one kernel for
    `index_copy_(0, positions % R, x.to(...))`.

    slots ([T] int64, a device tensor): into is a contiguous pool [N, R, H, Dh] and token t goes to row
    positions[t] % R of slot slots[t], none where the slot is negative (a padding token)."""
    t, h, dh = x.shape
    rows = _rows_into(x, into, slots)
    block = triton.next_power_of_2(dh)
    _store_rows[(t, h)](
        x, positions, positions if slots is None else slots, into, rows, dh, *x.stride(), BLOCK=block,
        POOL=slots is not None, num_warps=max(1, block // 256),
    )  # fmt: skip
    return into
