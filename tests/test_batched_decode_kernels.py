"""The decode kernels over a batch of sequences held in a slot-indexed state pool: `decode_attention` with
`slots`, and `rope_rows` / `store_rows` writing into a pool's slots. A batched row must be bit for bit the
same row computed alone (the one-sequence path, itself checked against float64 in
test_decode_attention_interpret / test_norm_rope_interpret), padding rows (slot -1) must read and write
nothing, and every other row of the pool must stay as it was.

Without a GPU the kernels run under Triton's interpreter on the CPU (tiny shapes: it is slow); with one the
same tests run compiled on CUDA (`pytest -m gpu`), with a CUDA graph replayed over new slots and positions."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

triton = pytest.importorskip("triton", reason="triton is a dev dependency (pip install -e '.[dev]')")

from tandem.cuda import norm_rope  # noqa: E402 (after the interpreter is chosen above)
from tandem.cuda.decode_attention import decode_attention  # noqa: E402

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_ON_CPU = pytest.mark.skipif(not _INTERPRETED, reason="the interpreter run is for machines without a GPU")
_ON_GPU = pytest.mark.skipif(_INTERPRETED or not torch.cuda.is_available(), reason="needs a CUDA device (-m gpu)")
DEVICES = [pytest.param("cpu", marks=_ON_CPU), pytest.param("cuda", marks=[pytest.mark.gpu, _ON_GPU])]

N_SLOTS = 4
SLOTS = [2, 0, -1, 3]  # batch row -> pool slot; row 2 is padding, slot 1 belongs to no row
LIVE = [(b, slot) for b, slot in enumerate(SLOTS) if slot >= 0]
PAD_POSITION = 10**6  # a padding row's position: past every buffer and table, so any read of it would show


def _slots(device: str) -> torch.Tensor:
    return torch.tensor(SLOTS, dtype=torch.int64, device=device)


# ---------------------------------------------------------------------------------------------- attention

HEADS, KV_HEADS, D, DV = 4, 2, 32, 16
# name: (rows per slot R, window, positions of the batch rows, softcap, with sinks)
CASES = {
    "full": (24, None, [20, 5, PAD_POSITION, 23], None, False),  # different lengths, one the whole buffer
    "ring": (16, 12, [40, 3, PAD_POSITION, 17], None, True),  # rings of R < position, wrapped, and one not yet
    "softcap": (24, None, [9, 0, PAD_POSITION, 16], 2.0, False),  # position 0: a single key
}
DTYPES = {"f16": (torch.float16, torch.float16), "f32": (torch.float32, torch.float32)}  # (query, cache)


def _pool(rows: int, window: int | None, positions: list[int], cache_dtype: torch.dtype, g: torch.Generator):
    """keys [N, R, G, D], values [N, R, G, Dv]: random where a row's query may read its slot (positions in its
    window, position j in row j % R), NaN everywhere else (the slot of no row, rows outside the windows)."""
    keys = torch.full((N_SLOTS, rows, KV_HEADS, D), float("nan"))
    values = torch.full((N_SLOTS, rows, KV_HEADS, DV), float("nan"))
    for slot, p in zip(SLOTS, positions, strict=True):
        if slot >= 0:
            read = torch.arange(max(0, p + 1 - (window or rows)), p + 1) % rows
            keys[slot, read] = torch.randn(len(read), KV_HEADS, D, generator=g)
            values[slot, read] = torch.randn(len(read), KV_HEADS, DV, generator=g)
    return keys.to(cache_dtype), values.to(cache_dtype)


def _reference(q, keys, values, p: int, rows: int, window: int | None, softcap: float | None, sinks):
    """float64 attention of q [H, D] at position p over one slot's ring keys [R, G, D] -> [H, Dv]."""
    j = torch.arange(max(0, p + 1 - (window or rows)), p + 1)
    k = keys[j % rows].double().repeat_interleave(HEADS // KV_HEADS, dim=1)  # [L, H, D]
    v = values[j % rows].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("hd,lhd->hl", q.double(), k) * D**-0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if sinks is not None:
        scores = torch.cat([scores, sinks.double()[:, None]], dim=1)
    return torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=1)[:, : len(j)], v)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtypes", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_batched_rows_equal_rows_alone(case: tuple, dtypes: tuple[torch.dtype, torch.dtype], device: str) -> None:
    rows, window, positions, softcap, with_sinks = case
    q_dtype, cache_dtype = dtypes
    g = torch.Generator().manual_seed(rows + len(positions))
    keys, values = _pool(rows, window, positions, cache_dtype, g)
    q = torch.randn(len(SLOTS), HEADS, D, generator=g).to(q_dtype)
    host_sinks = torch.randn(HEADS, generator=g) * 2 if with_sinks else None
    host = (q, keys, values)  # the float64 reference's inputs
    q, keys, values = q.to(device), keys.to(device), values.to(device)
    sinks = None if host_sinks is None else host_sinks.to(device)
    pos = torch.tensor(positions, device=device)
    args = (D**-0.5, window, softcap, sinks)
    for n_splits in (1, 3, None):  # one run per row, runs that stay empty for the short rows, the default
        y = decode_attention(q, keys, values, pos, *args, n_splits=n_splits, slots=_slots(device))
        assert y.shape == (len(SLOTS), HEADS, DV) and y.dtype == q_dtype
        for b, (slot, p) in enumerate(zip(SLOTS, positions, strict=True)):
            if slot < 0:
                assert torch.equal(y[b], torch.zeros_like(y[b])), "a padding row is zeros"
                continue
            ref = _reference(host[0][b], host[1][slot], host[2][slot], p, rows, window, softcap, host_sinks)
            rel = ((y[b].cpu().double() - ref).norm() / ref.norm()).item()
            assert rel < (1e-5 if q_dtype == torch.float32 else torch.finfo(q_dtype).eps), (b, rel)
            if n_splits is not None:  # the same grid per row: the same arithmetic, bit for bit
                alone = decode_attention(q[b : b + 1], keys[slot], values[slot], pos[b : b + 1], *args, n_splits)
                assert torch.equal(y[b], alone[0]), (b, n_splits)


@pytest.mark.gpu
@_ON_GPU
def test_captured_batch_follows_slots_and_positions() -> None:
    """Captured once, replayed after changing slots and positions in place (rows joining, leaving, moving)."""
    rows, window, scale = 16, 12, D**-0.5
    g = torch.Generator().manual_seed(7)
    keys = torch.randn(N_SLOTS, rows, KV_HEADS, D, generator=g).half().cuda()
    values = torch.randn(N_SLOTS, rows, KV_HEADS, DV, generator=g).half().cuda()
    q = torch.randn(len(SLOTS), HEADS, D, generator=g).half().cuda()
    slots, pos = _slots("cuda"), torch.tensor([40, 3, 0, 17], device="cuda")
    decode_attention(q, keys, values, pos, scale, window, n_splits=2, slots=slots)  # compiles before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = decode_attention(q, keys, values, pos, scale, window, n_splits=2, slots=slots)
    for new_slots, new_pos in (([-1, 3, 1, 0], [0, 90, 2, 15]), ([1, -1, -1, 2], [11, 0, 0, 33])):
        slots.copy_(torch.tensor(new_slots))
        pos.copy_(torch.tensor(new_pos))
        graph.replay()
        for b, slot in enumerate(new_slots):
            if slot < 0:
                assert torch.equal(y[b], torch.zeros_like(y[b]))
                continue
            alone = decode_attention(q[b : b + 1], keys[slot], values[slot], pos[b : b + 1], scale, window, n_splits=2)
            assert torch.equal(y[b], alone[0]), (new_slots, b)


# -------------------------------------------------------------------------------------- rope and store rows

POOL_ROWS, ROPE_HEADS, HEAD_DIM, ROPE_DIM = 12, 3, 48, 32  # partial rotary: the last 16 dims pass through
ROPE_POSITIONS = [9, 30, PAD_POSITION, 5]  # 30: a ring's row 6; the padding row's position lies in no table
CACHE_DTYPES = [torch.float16, torch.float32]


def _tables(n_pos: int, half: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    theta = torch.arange(n_pos, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(half) / half)
    return torch.cos(theta).float().to(device), torch.sin(theta).float().to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rope_rows_into_pool_slots(dtype: torch.dtype, cache_dtype: torch.dtype, device: str) -> None:
    g = torch.Generator().manual_seed(11)
    cos, sin = _tables(32, ROPE_DIM // 2, device)
    kv = torch.randn(len(SLOTS), ROPE_HEADS, 64, generator=g).to(dtype).to(device)
    x = kv[:, :, 8:56]  # [T, H, Dh]: strided heads, as a slice of a fused projection
    pos, slots = torch.tensor(ROPE_POSITIONS, device=device), _slots(device)
    for norm in (None, torch.randn(HEAD_DIM, generator=g).to(device)):
        pool = torch.randn(N_SLOTS, POOL_ROWS, ROPE_HEADS, HEAD_DIM, generator=g).to(cache_dtype).to(device)
        expected = pool.clone()
        for t, slot in LIVE:  # each live token alone into its slot's buffer [R, H, Dh]: the one-sequence path
            norm_rope.rope_rows(x[t : t + 1], pos[t : t + 1], cos, sin, norm, 1e-6, into=expected[slot])
        assert norm_rope.rope_rows(x, pos, cos, sin, norm, 1e-6, into=pool, slots=slots) is pool
        assert torch.equal(pool, expected)  # the written rows, and every other row (padding's none) untouched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_store_rows_into_pool_slots(dtype: torch.dtype, cache_dtype: torch.dtype, device: str) -> None:
    g = torch.Generator().manual_seed(12)
    v = torch.randn(len(SLOTS), 2, ROPE_HEADS, 40, generator=g).to(dtype).to(device)[:, 1]  # [T, H, Dv] strided
    pos, slots = torch.tensor(ROPE_POSITIONS, device=device), _slots(device)
    pool = torch.randn(N_SLOTS, POOL_ROWS, ROPE_HEADS, 40, generator=g).to(cache_dtype).to(device)
    expected = pool.clone()
    for t, slot in LIVE:  # each live token alone into its slot's buffer: the one-sequence path
        norm_rope.store_rows(v[t : t + 1], pos[t : t + 1], expected[slot])
    assert norm_rope.store_rows(v, pos, pool, slots) is pool
    assert torch.equal(pool, expected)
