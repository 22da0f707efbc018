"""Grouped-query attention with a KV cache, optional q/k/v norms, sliding windows, softcapping and
attention sinks.

Shapes: T = new tokens, S = cached positions (including the new ones), H = query heads,
G = KV heads, D = head dim.

With an f16 cache on the CPU, attention rounds as llama.cpp's CPU backend does without flash
attention (ggml-cpu: `mul_mat` through llamafile's tinyBLAS, `soft_max_ext`), in the vector width of the machine's
build (`_SIMD`: AVX-512's 16 float lanes, AVX2's 8; below for AVX-512):

- K.Q: the queries are converted to f16, so every product is exact in float32; with several query
  rows each output sums its products in 16 float32 lanes (lane i takes the products i, i+16, i+32, ...
  in order), then adds the lanes as `_mm512_reduce_add_ps` does; one row (decoding) goes through
  `ggml_vec_dot_f16` instead: 64 lanes, folded to 16 before the same reduction (AVX2 ends it with two `hadd`s);
- softmax: exp is ggml's vectorized `ggml_v_expf` (its own polynomial, not the C library's; AVX2's rounds its
  last step differently), each run of 16 exponentials is reduced as above and the runs are summed in double; the
  probabilities are the exponentials times the float 1/sum;
- P.V: the probabilities are converted to f16 and summed over positions as in K.Q.

Without softcap these run as llama.cpp's own nodes on ggml, for one query row (decoding) or many (prefill):
`ggml_attention` (`mul_mat` of the f16 keys, `soft_max_ext` with the sinks where the model has them, `mul_mat` of
the f16 values transposed, as llama.cpp's cache holds them); softcap is emulated in numpy/torch below
(`_attend_ggml`).

These are last-place differences, but the attention output feeds the 8-bit quantization of the output
projection's activations, where one unit in the last place can move a rounding by a whole step: matching
llama.cpp token for token needs them. An f32 (or bf16) cache keeps plain float32 products (with an f32
cache, what `transformers` computes, up to summation order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from tandem.cuda.streams import side_by_side
from tandem.layers.linear import Linear
from tandem.layers.norm import rms_norm
from tandem.layers.rope import Rope
from tandem.quant.ggml_ops import ATTENTION_THREADED_FROM, ggml_attention
from tandem.state.batch import RowSpans, StepBatch
from tandem.state.kv_cache import KV_PAD, KVPool, LayerKV

# On a GPU, a prompt chunk of at most this many (query, key) pairs attends row by row (`_row_spans`).
ROW_ATTENTION_PAIRS = 1 << 16
# Where a sliding-window layer keeps a ring of window + n_batch - 1 rows instead of every position.
RING_DEVICE_TYPES = ("cuda",)


@dataclass
class AttentionShape:
    n_heads: int
    n_kv_heads: int
    head_dim: int  # of queries and keys
    value_dim: int
    scale: float  # multiplies q.k
    sliding_window: int | None  # None: full causal attention
    softcap: float | None = None
    scale_queries: bool = False  # the scale multiplies the queries, not the scores (ModelConfig.scale_queries)

    def new_kv(
        self, n_slots: int, n_ctx: int, dtype: torch.dtype, device: torch.device | str, n_batch: int
    ) -> KVPool:
        """The KV buffers of every slot of a layer with this geometry: on a GPU, a sliding-window layer keeps a
        ring of window + n_batch - 1 rows (VRAM is what --cpu-moe users lack); on the CPU, every position, in the
        order whose sums reproduce llama.cpp's rounding (see the module docstring)."""
        window = self.sliding_window if torch.device(device).type in RING_DEVICE_TYPES else None
        return KVPool.allocate(
            n_slots, n_ctx, self.n_kv_heads, self.head_dim, self.value_dim, dtype, device, window, n_batch
        )


@dataclass
class Attention:
    shape: AttentionShape
    q: Linear
    k: Linear
    v: Linear | None  # None: values are the key projection (before its norm and rope; Gemma 4 global layers)
    o: Linear
    rope: Rope
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    norm_eps: float = 1e-6
    v_norm: bool = False  # RMS-normalise values per head, without a weight (Gemma 4)
    sinks: torch.Tensor | None = None  # [H] learned logit of an extra "sink" key per head (gpt-oss)

    def new_state(
        self, n_slots: int, n_ctx: int, dtype: torch.dtype, device: torch.device | str, n_batch: int
    ) -> KVPool:
        return self.shape.new_kv(n_slots, n_ctx, dtype, device, n_batch)

    def __call__(self, x: torch.Tensor, batch: StepBatch, pool: KVPool) -> torch.Tensor:
        s = self.shape
        t = x.shape[0]
        q, k, *v = side_by_side(x, self.q, self.k, *([] if self.v is None else [self.v]))  # one token on a GPU: at once
        q = q.view(t, s.n_heads, s.head_dim)
        k = k.view(t, s.n_kv_heads, s.head_dim)
        v = v[0].view(t, s.n_kv_heads, s.value_dim) if v else k
        if self.v_norm:
            v = rms_norm(v, torch.ones((), dtype=torch.float32, device=v.device), self.norm_eps)
        out = attend_step(self, q, k, v, batch, pool, self.sinks)  # [T, H, Dv]
        return self.o(out.reshape(t, s.n_heads * s.value_dim))


class _QKNormed(Protocol):
    shape: AttentionShape
    rope: Rope
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    norm_eps: float


def attend_step(
    layer: _QKNormed,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: StepBatch,
    pool: KVPool,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """From a step's fresh projections q [T, H, D], k [T, G, D], v [T, G, Dv]: the layer's q/k norms and rope,
    k and v into each sequence's cache, attention over it -> [T, H, Dv]. Shared by the attention layers.

    A pooled decode step (on a GPU) runs as one batch over the pool (`_pooled_decode`); otherwise each
    sequence's rows attend over its own slot, one sequence after the other, except on a GPU the one-token
    sequences and short prompt chunks: those attend together, row by row, as in a pooled step (`_row_spans`)."""
    if batch.pooled:
        if batch.decode:
            return _pooled_decode(layer, q, k, v, batch, pool, sinks)
        return _pooled_chunk(layer, q, k, v, batch, pool, sinks)
    q = layer.rope.apply(q, batch.positions, layer.q_norm, layer.norm_eps)  # norm + rope: one kernel on CUDA
    k = layer.rope.apply(k, batch.positions, layer.k_norm, layer.norm_eps)  # (row by row: all rows at once)
    by_rows = _row_spans(batch) if q.is_cuda else None
    if by_rows is not None and by_rows.every_row:
        return _attend_rows(layer, q, k, v, batch.positions, pool, sinks, by_rows.slots)
    out = None
    if by_rows is not None:
        out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
        rows = by_rows.rows
        out[rows] = _attend_rows(layer, q[rows], k[rows], v[rows], batch.positions[rows], pool, sinks, by_rows.slots)
    outs = []
    for span in batch.spans:
        if by_rows is not None and span.offset in by_rows.offsets:
            continue
        rows, cache = span.rows, pool.slot(span.slot)
        keys, values, first = cache.store(span.start, k[rows], v[rows])  # [S, G, D] from position `first`
        attended = attend(q[rows], keys, values, batch.positions[rows], layer.shape, sinks, first, cache)
        if out is None:
            outs.append(attended)
        else:
            out[rows] = attended
    if out is not None:
        return out
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _row_spans(batch: StepBatch) -> RowSpans | None:
    """The spans of a step (on a GPU) that attend row by row, as a pooled decode step's rows do: every
    one-token sequence, and every chunk whose queries times keys are at most ROW_ATTENTION_PAIRS (short
    prompts: their per-sequence attention would cost a dozen small launches each, which for 16 prompts were most
    of their prefill's ~48,000 kernels; docs/PERFORMANCE.md). None when no span does. Made once per step."""
    if batch.attention_rows is None:
        spans = [s for s in batch.spans if s.n == 1 or s.n * (s.start + s.n) <= ROW_ATTENTION_PAIRS]
        rows = slots = None
        if spans:
            device = batch.positions.device
            rows = torch.tensor([r for s in spans for r in range(s.offset, s.offset + s.n)], device=device)
            slots = torch.tensor([s.slot for s in spans for _ in range(s.n)], device=device)
        every = len(spans) == len(batch.spans)
        batch.attention_rows = RowSpans(frozenset(s.offset for s in spans), rows, slots, every)
    return batch.attention_rows if batch.attention_rows.offsets else None


def _attend_rows(
    layer: _QKNormed,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    pool: KVPool,
    sinks: torch.Tensor | None,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Rows of a step (q and k roped), each of its slot's sequence at its position: their keys and values into
    the pool, then each row's attention over its slot's keys up to its own position (causal by position, so a
    chunk's rows see each other as they should), in one launch each, as a pooled decode step computes them (a
    sequence decodes by the same kernel in either kind of step). A chunk's rows are at most n_batch, so a
    sliding-window ring (window + n_batch - 1 rows) still holds every key its first row sees."""
    from tandem.cuda.decode_attention import decode_attention
    from tandem.cuda.norm_rope import store_rows

    s = layer.shape
    store_rows(k, positions, pool.k, slots=slots)
    store_rows(v, positions, pool.v, slots=slots)
    return decode_attention(q, pool.k, pool.v, positions, s.scale, s.sliding_window, s.softcap, sinks, slots=slots)


def _pooled_decode(
    layer: _QKNormed,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: StepBatch,
    pool: KVPool,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One token per sequence on a GPU, every sequence at once, by device tensors only (capturable): the k
    kernel writes each row's key into its slot's cache row itself, v goes to its row, then flash-decoding over
    each row's slot. Padding rows (slot -1) write and read nothing."""
    from tandem.cuda.decode_attention import decode_attention
    from tandem.cuda.norm_rope import store_rows

    s, positions, slots = layer.shape, batch.positions, batch.slots
    q = layer.rope.apply(q, positions, layer.q_norm, layer.norm_eps)
    layer.rope.apply(k, positions, layer.k_norm, layer.norm_eps, into=pool.k, slots=slots)
    store_rows(v, positions, pool.v, slots=slots)
    return decode_attention(q, pool.k, pool.v, positions, s.scale, s.sliding_window, s.softcap, sinks, slots=slots)


def _pooled_chunk(
    layer: _QKNormed,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: StepBatch,
    pool: KVPool,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One sequence's prompt chunk on a GPU by device tensors only (capturable, as a pooled decode step)."""
    assert batch.slots is not None
    q = layer.rope.apply(q, batch.positions, layer.q_norm, layer.norm_eps)
    k = layer.rope.apply(k, batch.positions, layer.k_norm, layer.norm_eps)
    return attend_chunk(layer.shape, q, k, v, batch.positions, batch.slots, batch.key_rows, pool, sinks)


def attend_chunk(
    s: AttentionShape,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    key_rows: int,
    pool: KVPool,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """A chunk of one sequence (q and k roped; every row's slot the same): keys and values into the slot's rows,
    then attention over the first `key_rows` rows of its buffer, or its whole ring, each row's position computed
    on the device and the rows a query may not see masked -> [T, H, Dv]. The ring holds window + n_batch - 1
    rows: every key a chunk's queries see."""
    from tandem.cuda.norm_rope import store_rows

    store_rows(k, positions, pool.k, slots=slots)
    store_rows(v, positions, pool.v, slots=slots)
    n_rows = pool.rows if pool.window is not None else min(key_rows, pool.rows)
    slot = slots[:1]
    keys = pool.k[:, :n_rows].index_select(0, slot)[0]  # [S, G, D]: the slot's rows, copied (S is small)
    values = pool.v[:, :n_rows].index_select(0, slot)[0]
    row = torch.arange(n_rows, device=q.device)
    if pool.window is None:
        key_pos = row
    else:  # a ring: row r holds the latest position = r (mod R) up to the chunk's last; negative: never written
        last = positions[-1:]
        key_pos = last - (last - row) % n_rows
    allowed = _allowed(positions, key_pos, s.sliding_window) & (key_pos >= 0)
    return _masked_attention(q, keys, values, allowed, s, sinks)


def _allowed(positions: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[T, S]: whether the query at positions[t] sees the key at key_pos[s] (causal, within the window)."""
    distance = positions.unsqueeze(1) - key_pos.unsqueeze(0)
    allowed = distance >= 0
    if window is not None:
        allowed &= distance < window
    return allowed


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    s: AttentionShape,
    sinks: torch.Tensor | None = None,
    first: int = 0,
    cache: LayerKV | None = None,
) -> torch.Tensor:
    """Causal (optionally windowed) softmax attention of one sequence's queries q [T, H, D] over keys/values
    [S, G, D], those of positions first, first + 1, ...

    `sinks` [H]: one extra logit per head in the softmax denominator, attending to nothing. `cache`: the buffer
    keys and values are (a prefix of), whose rows and transposed values the CPU attention reads
    (`LayerKV.attention_rows`)."""
    group = s.n_heads // s.n_kv_heads
    n_keys = keys.shape[0]
    # The queries are the last T of the keys' positions. From an empty cache without a window (a prompt that
    # fits one batch) that is plain causal attention: no mask to build, and SDPA may take its flash kernel.
    from_start = s.sliding_window is None and first == 0 and n_keys == q.shape[0]
    if q.is_cuda and s.softcap is None and sinks is None and from_start:
        return _sdpa(q, keys, values, None, s, group)
    allowed = _allowed(positions, first + torch.arange(n_keys, device=q.device), s.sliding_window)  # [T, S]
    if keys.dtype is torch.float16 and not q.is_cuda:
        if s.softcap is None:
            source = _cache_source(keys, values, first, cache)
            return _attend_ggml_nodes(q, source, allowed.cpu().numpy(), s, sinks)
        return _attend_ggml(q, keys, values, allowed, s, sinks)
    return _masked_attention(q, keys, values, allowed, s, sinks)


def _masked_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor,
    s: AttentionShape,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Softmax attention of q [T, H, D] over keys/values [S, G, D] where `allowed` [T, S], in float32 (torch's
    fused kernel on a GPU where there is no softcap or sink) -> [T, H, Dv]."""
    group = s.n_heads // s.n_kv_heads
    if q.is_cuda and s.softcap is None and sinks is None:  # one fused kernel instead of a dozen
        return _sdpa(q, keys, values, allowed, s, group)
    qh = q.float().transpose(0, 1)  # [H, T, D]
    kh = keys.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [H, S, D]
    vh = values.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [H, S, Dv]
    scores = torch.matmul(qh, kh.transpose(1, 2)) * s.scale  # [H, T, S]
    if s.softcap is not None:
        scores = torch.tanh(scores / s.softcap) * s.softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)  # [H, T, 1]
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, vh).transpose(0, 1).to(q.dtype)  # [T, H, Dv]


def _sdpa(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor | None,
    s: AttentionShape,
    group: int,
) -> torch.Tensor:
    """torch's fused attention of q [T, H, D] over keys/values [S, G, D] -> [T, H, Dv] in q's dtype: masked by
    `allowed` [T, S], or causal (T == S) without it. With a half-precision cache the queries are rounded to the
    cache's type, as llama.cpp's flash attention rounds them (its scores and softmax stay f32 inside the kernel),
    so that the flash kernel runs: float32 queries would take torch's slow math path.

    With a mask and grouped KV heads, the query heads of each KV head are one head's rows ([G, group*T, D], the
    mask repeated for each): torch's fused kernel that takes a mask (memory-efficient attention) has no grouped
    form, and its math path would hold every head's scores and probabilities in float32 (H x T x S each, above
    the plan's workspace for a prompt longer than -b) and the keys and values repeated per head."""
    work = keys.dtype if keys.dtype in (torch.float16, torch.bfloat16) else q.dtype
    t, n_heads, d = q.shape
    n_kv = keys.shape[1]
    fold = allowed is not None and group > 1
    queries = q.to(work)
    if fold:  # row r*T + i of KV head g: query head g*group + r at row i
        queries = queries.view(t, n_kv, group, d).permute(1, 2, 0, 3).reshape(n_kv, group * t, d).unsqueeze(0)
        mask = allowed.repeat(group, 1).view(1, 1, group * t, -1)
    else:
        queries = queries.transpose(0, 1).unsqueeze(0)
        mask = None if allowed is None else allowed.view(1, 1, *allowed.shape)
    out = F.scaled_dot_product_attention(
        queries,
        keys.to(work).transpose(0, 1).unsqueeze(0),
        values.to(work).transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=allowed is None,
        scale=s.scale,
        enable_gqa=group > 1 and not fold,
    )  # [1, H, T, Dv], or folded [1, G, group*T, Dv]
    if fold:
        return out[0].view(n_kv, group, t, -1).permute(2, 0, 1, 3).reshape(t, n_heads, -1).to(q.dtype)
    return out[0].transpose(0, 1).to(q.dtype)


# -- llama.cpp's CPU arithmetic (f16 cache) ---------------------------------------------------------
# In numpy (small steps: its per-call cost is a fraction of torch's), large sums in torch (one pass per
# step over lane-major blocks, on all threads).

@dataclass(frozen=True)
class _SimdLayout:
    """How this machine's ggml (and llama.cpp built for it) lays its float32 sums out in vector registers."""

    lanes: int  # floats per register: tinyBLAS's KN and the softmax's runs (16: AVX-512, 8: AVX2)

    @property
    def avx2(self) -> bool:
        """AVX2's reductions and exp: `ggml_vec_dot_f16` ends with two `_mm_hadd_ps`, `ggml_v_expf` with an FMA."""
        return self.lanes == 8

    @property
    def step(self) -> int:
        """ggml_vec_dot_f16's step: 4 registers."""
        return 4 * self.lanes


def _simd_layout() -> _SimdLayout:
    """AVX-512 where tandem's ggml is built with it (a native build: the machine's), else AVX2's."""
    import ggml

    return _SimdLayout(lanes=16 if ggml.ggml_cpu_has_avx512() else 8)


_SIMD = _simd_layout()
_CHUNK_ELEMENTS = 1 << 22  # bound on the [lanes, ...] partial-sum arrays (16 MiB)
_SMALL = 1 << 16  # partial sums smaller than this are added in numpy, larger ones in torch
_ROWS_PER_CHUNK = 128  # a prompt's query rows per ggml attention call: each chunk reads only the keys it sees


def _reduce_register(acc: np.ndarray) -> np.ndarray:
    """Sum the first dimension (one register's float32 lanes) as ggml's horizontal sums do (GCC's
    `_mm512_reduce_add_ps`, tinyBLAS's and the softmax's `hsum` of an AVX register): halves down to four lanes,
    then (0 + 2) + (1 + 3)."""
    while acc.shape[0] > 4:
        half = acc.shape[0] // 2
        acc = acc[half:] + acc[:half]
    return (acc[0] + acc[2]) + (acc[1] + acc[3])


def _lane_sums(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Dot products from step-major operands a, b [steps, lanes, ...] (broadcast over the trailing
    dimensions; float32 holding f16 values): each lane sums its products in step order (exact
    products, so the fused multiply-adds are plain additions), then the lanes are added as ggml does.

    `_SIMD.step` lanes are `ggml_vec_dot_f16`'s 4 registers, folded as (0 + 2) + (1 + 3) and then reduced as
    GGML_F32x16_REDUCE / GGML_F32x8_REDUCE do; `_SIMD.lanes` lanes are tinyBLAS's one register."""
    shape = np.broadcast_shapes(a.shape[1:], b.shape[1:])
    if math.prod(shape) < _SMALL:  # numpy: a fraction of torch's per-call cost
        acc = a[0] * b[0]
        for i in range(1, a.shape[0]):
            acc += a[i] * b[i]
    else:  # torch: one pass per step (addcmul), on all threads
        acc_t = torch.zeros(shape, dtype=torch.float32)
        a_t, b_t = torch.from_numpy(a), torch.from_numpy(b)
        for i in range(a.shape[0]):
            acc_t.addcmul_(a_t[i], b_t[i])
        acc = acc_t.numpy()
    n = _SIMD.lanes
    if acc.shape[0] == _SIMD.step:
        acc = (acc[0:n] + acc[2 * n : 3 * n]) + (acc[n : 2 * n] + acc[3 * n : 4 * n])
        if _SIMD.avx2:  # low half + high half, then two horizontal adds: (0 + 1) + (2 + 3)
            t = acc[0:4] + acc[4:8]
            return (t[0] + t[1]) + (t[2] + t[3])
    return _reduce_register(acc)


def _step_major(x: np.ndarray, axis: int, lanes: int) -> np.ndarray:
    """x with dimension `axis` (a multiple of `lanes` long) split into [steps, lanes] and moved to the
    front, as a contiguous float32 copy: [steps, lanes, <the other dimensions>]."""
    axis = axis % x.ndim
    split = x.reshape(*x.shape[:axis], -1, lanes, *x.shape[axis + 1 :])
    return np.moveaxis(split, (axis, axis + 1), (0, 1)).astype(np.float32, order="C")


def _f32(hex_literal: str) -> np.float32:
    return np.float32(float.fromhex(hex_literal))


_EXP = {k: _f32(v) for k, v in {
    "round": "0x1.8p23", "log2e": "0x1.715476p+0", "ln2_hi": "0x1.62e4p-1", "ln2_lo": "0x1.7f7d1cp-20",
    "c5": "0x1.0e4020p-7", "c4": "0x1.573e2ep-5", "c3": "0x1.555e66p-3", "c2": "0x1.fffdb6p-2",
    "c1": "0x1.ffffecp-1",
}.items()}  # fmt: skip
_EXP64 = {k: np.float64(v) for k, v in _EXP.items()}


def _fma(a: np.ndarray, b: np.ndarray | np.float64, c: np.ndarray | np.float64 | float) -> np.ndarray:
    """float32 fused multiply-add a * b + c of float32 values, rounded once (in float64 a * b is exact)."""
    return (np.asarray(a, dtype=np.float64) * b + c).astype(np.float32)


def ggml_expf(x: np.ndarray) -> np.ndarray:
    """exp(x) as ggml's `ggml_v_expf` (ggml-cpu/vec.h) computes it for float32 x, in its AVX-512 version or its
    AVX2 one (`_SIMD`): the same reduction and polynomial, rounded differently at the end."""
    c, c64 = _EXP, _EXP64
    n = _fma(x, c64["log2e"], c64["round"]) - c["round"]
    b = _fma(-n, c64["ln2_lo"], _fma(-n, c64["ln2_hi"], x).astype(np.float64))
    u = b * b
    b64 = b.astype(np.float64)
    inner = _fma(_fma(b64, c64["c5"], c64["c4"]), u, _fma(b64, c64["c3"], c64["c2"]))
    big = np.abs(n) > 192
    if not _SIMD.avx2:
        j = _fma(inner, u, _fma(b64, c64["c1"], 1.0))
        with np.errstate(over="ignore", under="ignore"):  # _mm512_scalef_ps: j * 2^n, rounded once
            res = np.ldexp(j.astype(np.float64), np.clip(n, -512, 512).astype(np.int32)).astype(np.float32)
    else:  # j * 2^n + 2^n, one fused multiply-add; past |n| > 126 in two factors, the second rounded apart
        j = _fma(inner, u, (c["c1"] * b).astype(np.float64))
        n_int = np.clip(np.nan_to_num(n), -200, 200).astype(np.int32)
        wide = np.abs(n_int) > 126
        with np.errstate(over="ignore", under="ignore"):
            k = np.ldexp(np.float64(1.0), np.where(wide, 0, n_int))
            res = _fma(j, k, k)
            if wide.any():
                shift = np.where(n_int <= 0, -125, 127)
                s2 = np.ldexp(np.float64(1.0), n_int - shift)
                res = np.where(wide, _fma(j, s2, s2) * np.ldexp(np.float32(1.0), shift).astype(np.float32), res)
    if big.any():
        res = np.where(big, np.where(n <= 0, np.float32(0), np.float32(np.inf)), res)
    return res


def _softmax_ggml(scores: np.ndarray, sinks: np.ndarray | None) -> np.ndarray:
    """ggml's `soft_max_ext` over the last dimension (a multiple of 16; -inf where masked).

    sinks (or None): one extra logit per row, broadcast against scores[..., :1], in the denominator only."""
    mx = scores.max(-1, keepdims=True)
    if sinks is not None:
        mx = np.maximum(mx, sinks)
    with np.errstate(invalid="ignore"):
        e = ggml_expf(scores - mx)
    runs = np.moveaxis(e.reshape(*e.shape[:-1], -1, _SIMD.lanes), -1, 0)
    total = _reduce_register(runs).astype(np.float64).sum(-1, keepdims=True)
    if sinks is not None:  # expf (the C library's, correctly rounded here) of the sink's logit
        total = total + np.exp((sinks - mx).astype(np.float64)).astype(np.float32)
    return e * (1.0 / total).astype(np.float32)


def query_scaling(s: AttentionShape) -> tuple[bool, np.float32]:
    """(whether the queries are scaled, the factor left for the scores), as the family's llama.cpp graph does:
    Gemma 3 multiplies the queries before their f16 conversion (ggml_scale on Q), the others the scores in the
    softmax (`kq_scale`). Where the scale is not a power of two, the f16 roundings of q and of q * scale differ."""
    return s.scale_queries, np.float32(1.0 if s.scale_queries else s.scale)


def _cache_source(keys: torch.Tensor, values: torch.Tensor, first: int, cache: LayerKV | None) -> LayerKV:
    """Where ggml's attention reads keys and transposed values: the cache when keys/values are its buffer from
    position 0 (LayerKV.attention_rows), else a buffer of this call alone."""
    if cache is not None and cache.window is None and first == 0:
        return cache
    return LayerKV(k=keys, v=values)


def _attend_ggml_nodes(
    q: torch.Tensor, kv: LayerKV, allowed: np.ndarray, s: AttentionShape, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """With an f16 cache on the CPU (no softcap): llama.cpp's attention nodes on ggml over q [T, H, D], which
    round as `_attend_ggml` does, in a fraction of its time -> [T, H, Dv]. `allowed` [T, N]: which of the first N
    positions of `kv` each query row sees; `sinks` [H]: the heads' sink logits, or None.

    Keys and values are padded to a multiple of KV_PAD positions (masked), as llama.cpp's padded KV view: the
    padding decides where ggml's dot products and softmax switch from vector runs to a scalar tail. ggml reads
    the f16 rows and the transposed values of `kv` (LayerKV.attention_rows). Rows go through in chunks that bound
    the scores' memory, each over the keys its rows see, cut at multiples of KV_PAD positions (as `_attend_ggml`):
    the keys left out before and after have probability 0 and would only add zeros, in the same lanes, to every
    sum (a sliding window's layer reads its window, a prompt's first rows their prefix)."""
    t, n_keys = allowed.shape
    padded = -(-n_keys // KV_PAD) * KV_PAD
    scale_queries, kq_scale = query_scaling(s)
    q32 = q.detach().float().cpu().numpy()
    if scale_queries:
        q32 = q32 * np.float32(s.scale)
    q32 = q32.transpose(1, 0, 2)  # [H, T, D]: ggml's product converts it to f16, as llama.cpp's does
    k, vt = kv.attention_rows(n_keys, padded)
    k16, vt16 = k.numpy(), vt.numpy()
    mask = np.full((t, padded), -np.inf, dtype=np.float32)
    mask[:, :n_keys][allowed] = 0.0
    rows = max(1, min(_ROWS_PER_CHUNK, _CHUNK_ELEMENTS // (s.n_heads * padded)))
    sink = None if sinks is None else np.ascontiguousarray(sinks.detach().float().cpu().numpy())
    outs = []
    for r0 in range(0, t, rows):
        seen = np.flatnonzero(allowed[r0 : r0 + rows].any(0))  # a row sees at least its own position
        lo, hi = int(seen[0]) // KV_PAD * KV_PAD, -(-(int(seen[-1]) + 1) // KV_PAD) * KV_PAD
        n_rows = min(rows, t - r0)
        threads = torch.get_num_threads() if (hi - lo) * n_rows >= ATTENTION_THREADED_FROM else 1
        outs.append(ggml_attention(np.ascontiguousarray(q32[:, r0 : r0 + rows]), k16[lo:hi], vt16[..., lo:hi],
                                   np.ascontiguousarray(mask[r0 : r0 + rows, lo:hi]), float(kq_scale), threads,
                                   sink))  # fmt: skip
    out = torch.from_numpy(np.concatenate(outs, axis=1)).transpose(0, 1)  # [T, H, Dv]
    return out.to(device=q.device, dtype=q.dtype)


def _attend_ggml(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor,
    s: AttentionShape,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """`attend` with llama.cpp's CPU rounding for an f16 cache (see the module docstring)."""
    g, group = s.n_kv_heads, s.n_heads // s.n_kv_heads
    n_keys, t, d = keys.shape[0], q.shape[0], q.shape[-1]
    # llama.cpp runs one query row through ggml's own dot product (64 lanes), several through
    # tinyBLAS (16 lanes) when the shapes suit it: the summed dimension a multiple of 16, the rows
    # of the other side a multiple of 4
    kq_lanes = _SIMD.step if t == 1 or d % _SIMD.lanes else _SIMD.lanes
    pv_lanes = _SIMD.step if t == 1 or s.value_dim % 4 else _SIMD.lanes
    kq_full = d - d % kq_lanes  # ggml_vec_dot_f16 adds the products past it one by one, in double
    padded = -(-n_keys // KV_PAD) * KV_PAD  # positions past the cache's are masked (probability 0)
    scale_queries, score_scale = query_scaling(s)
    q32 = q.detach().float().cpu().numpy()
    if scale_queries:
        q32 = q32 * np.float32(s.scale)
    # f16 values as float32 (exact), grouped by KV head: query head h reads KV head h // group
    qg = q32.astype(np.float16).astype(np.float32).transpose(1, 0, 2).reshape(g, group, t, d)
    kh = keys.detach().cpu().numpy()  # [S, G, D] f16
    v_pad = np.zeros((padded, g, s.value_dim), dtype=np.float32)
    v_pad[:n_keys] = values.detach().cpu().numpy()
    v_steps = v_pad.reshape(-1, pv_lanes, g, 1, 1, s.value_dim)  # [steps, lanes, G, 1, 1, Dv]: step-major as is
    allow = allowed.cpu().numpy()
    mask = np.full((t, padded), -np.inf, dtype=np.float32)
    mask[:, :n_keys][allow] = 0.0
    sink = None if sinks is None else sinks.detach().float().cpu().numpy().reshape(g, group, 1, 1)
    out = np.empty((g, group, t, s.value_dim), dtype=np.float32)
    rows = max(1, _CHUNK_ELEMENTS // (s.n_heads * max(padded, s.value_dim) * max(kq_lanes, pv_lanes)))
    for r0 in range(0, t, rows):
        r1 = min(t, r0 + rows)
        # keys that no row of this chunk sees are left out, in whole steps: their probabilities are 0,
        # so they would only add zeros to the sums
        seen = np.flatnonzero(allow[r0:r1].any(0))
        width = -(-(int(seen[-1]) + 1 if len(seen) else 1) // KV_PAD) * KV_PAD
        n = min(width, n_keys)
        q_rows = qg[:, :, r0:r1]
        k_rows = kh[:n].transpose(1, 0, 2)  # [G, n, D]
        scores = np.zeros((g, group, r1 - r0, width), dtype=np.float32)
        if kq_full:  # [steps, lanes, G, group, t, 1] x [steps, lanes, G, 1, 1, n]
            a = _step_major(q_rows[..., :kq_full], -1, kq_lanes)[..., None]
            b = _step_major(k_rows[..., :kq_full], -1, kq_lanes)[:, :, :, None, None, :]
            scores[..., :n] = _lane_sums(a, b)
        if kq_full < d:  # added one by one in double (exact float32 products)
            total = scores[..., :n].astype(np.float64)
            for i in range(kq_full, d):
                prod = q_rows[..., i, None] * k_rows[:, None, None, :, i].astype(np.float32)
                total = total + prod.astype(np.float64)
            scores[..., :n] = total.astype(np.float32)
        if score_scale != 1.0:
            scores = scores * score_scale
        if s.softcap is not None:
            scores = np.tanh(scores / np.float32(s.softcap)) * np.float32(s.softcap)
        scores = scores + mask[r0:r1, :width]
        probs = _softmax_ggml(scores, sink).astype(np.float16)  # [G, group, t, S]
        p_steps = _step_major(probs, -1, pv_lanes)[..., None]  # [steps, lanes, G, group, t, 1]
        out[:, :, r0:r1] = _lane_sums(p_steps, v_steps[: width // pv_lanes])
    result = torch.from_numpy(out.reshape(s.n_heads, t, s.value_dim)).transpose(0, 1)
    return result.to(device=q.device, dtype=q.dtype)  # [T, H, Dv]
