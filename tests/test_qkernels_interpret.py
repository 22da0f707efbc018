"""The GPU kernels, run on the CPU by Triton's interpreter (CI has no GPU): every native block format,
plain products (GEMV and dequantize + GEMM paths) and selected-experts products (GEMV and grouped GEMM),
against float64 products with gguf's own dequantization."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # on a GPU machine (pytest -m gpu collects this module too) the kernels compile
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

import gguf
import numpy as np
import pytest
from qblocks import random_blocks

triton = pytest.importorskip("triton", reason="triton is a dev dependency (pip install -e '.[dev]')")
if os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available():
    pytest.skip("the interpreter run is for machines without a GPU; see tests/test_gpu.py", allow_module_level=True)

from tandem.cuda import qkernels as qk
from tandem.cuda.qlinear import GPUQuantWeight, qmatmul, qmatmul_id

TYPES = [gguf.GGMLQuantizationType[n] for n in ("Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K")]
# f32 products of f32-exact dequantized values: only summation order differs from float64.
REL_TOL = 1e-5


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_plain_products(qtype: gguf.GGMLQuantizationType, monkeypatch: pytest.MonkeyPatch) -> None:
    import tandem.cuda.qlinear as qlinear

    rng = np.random.default_rng(int(qtype))
    n, k = 24, 512 + (32 if qtype in (TYPES[0], TYPES[1], TYPES[2]) else 0)  # a K that is no multiple of 256
    raw = random_blocks(qtype, (n, k), rng)
    ref_w = torch.from_numpy(gguf.quants.dequantize(raw, qtype)).double()
    w = GPUQuantWeight(torch.from_numpy(raw.reshape(-1).copy()), qtype, (n, k))
    for m in (1, 3, 20):  # 20 rows take the dequantize + GEMM path, all rows in one slice
        x = torch.randn(m, k)
        assert _rel(qmatmul(x, w, ieee=True), x.double() @ ref_w.T) < REL_TOL, m
    monkeypatch.setattr(qlinear, "GPU_DEQUANT_CHUNK_BYTES", 10 * k * 4)  # slices of 10 rows: 10, 10 and 4
    x = torch.randn(20, k)
    assert _rel(qmatmul(x, w, ieee=True), x.double() @ ref_w.T) < REL_TOL


def test_dense_products_by_rows_and_l2(monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight larger than the GPU's L2 (an output head) is one tile of the grouped GEMM from
    QMV_MAX_ROWS_PAST_L2 + 1 rows to GQMM_MAX_BM (re-read from VRAM per row, `_qmv` costs more there; no float
    copy of it), then dequantized slices into cuBLAS; one that fits stays on `_qmv` up to QMV_MAX_ROWS. Every
    path gives the same product."""
    import tandem.cuda.qlinear as qlinear

    qtype = gguf.GGMLQuantizationType.Q6_K
    n, k = 24, 512
    raw = random_blocks(qtype, (n, k), np.random.default_rng(7))
    ref_w = torch.from_numpy(gguf.quants.dequantize(raw, qtype)).double()
    w = GPUQuantWeight(torch.from_numpy(raw.reshape(-1).copy()), qtype, (n, k))
    few, bm = qlinear.QMV_MAX_ROWS_PAST_L2, qlinear.GQMM_MAX_BM
    expected = {
        (True, few): "qmv", (True, few + 1): "grouped", (True, bm): "grouped", (True, bm + 1): "sliced",
        (False, qlinear.QMV_MAX_ROWS): "qmv", (False, qlinear.QMV_MAX_ROWS + 1): "sliced",
    }  # fmt: skip
    for (past_l2, m), kernel in expected.items():
        monkeypatch.setattr(qlinear, "_past_l2", lambda _w, past_l2=past_l2: past_l2)
        assert qlinear.dense_kernel(m, w) == kernel, (past_l2, m)
        x = torch.randn(m, k)
        assert _rel(qmatmul(x, w, ieee=True), x.double() @ ref_w.T) < REL_TOL, (past_l2, m)
    for m in (1, 5, 17):  # the grouped tile pads to 16 and 32 rows
        x = torch.randn(m, k)
        for kernel, product in qlinear.DENSE_PRODUCTS.items():
            assert _rel(product(x, w, True), x.double() @ ref_w.T) < REL_TOL, (kernel, m)


def test_gemv_candidates_suit_the_type_and_k() -> None:
    """The autotuner's early prune: each candidate's values per thread suit the type's scale loads, and no step
    takes more superblocks than K rounds up to (K = 512: two), so a short K is not tuned over idle lanes."""
    configs = [triton.Config({"BN": bn, "SB": sb}, num_warps=w) for bn, sb, w in qk.QMV_SHAPES]
    for qtype in TYPES:
        for k, most in ((256, 1), (512, 2), (768, 4), (2048, 8), (4096, 16), (5120, 16)):
            kept = qk.qmv_configs(configs, {"K": k}, QT=int(qtype))
            assert kept, (qtype, k)
            assert all(c.kwargs["BN"] * c.kwargs["SB"] * 8 // c.num_warps in qk._QMV_VALUES[qtype] for c in kept)
            smallest = min(c.kwargs["SB"] for c in kept)
            assert all(c.kwargs["SB"] <= max(most, smallest) for c in kept), (qtype, k)
        short = {(c.kwargs["BN"], c.num_warps) for c in qk.qmv_configs(configs, {"K": 512}, QT=int(qtype))}
        assert len(short) >= 3, qtype  # a short K still has rows-per-program and warps to choose from


def test_gemv_rows_tiers() -> None:
    from tandem.cuda.qlinear import qmv_rows_tier

    assert [qmv_rows_tier(r) for r in (1, 8, 9, 32, 33, 128)] == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_selected_experts(qtype: gguf.GGMLQuantizationType) -> None:
    rng = np.random.default_rng(100 + int(qtype))
    e, n, k = 5, 16, 256
    raw = random_blocks(qtype, (e, n, k), rng)
    ref_w = torch.from_numpy(np.stack([gguf.quants.dequantize(raw[i], qtype) for i in range(e)])).double()
    w = GPUQuantWeight(torch.from_numpy(raw.reshape(-1).copy()), qtype, (e, n, k))
    for t, a in ((1, 2), (20, 3)):  # 60 slots take the grouped GEMM path
        ids = torch.randint(0, e, (t, a), generator=torch.Generator().manual_seed(t))
        for x in (torch.randn(t, k), torch.randn(t, a, k)):
            xs = x.double()[:, None, :].expand(t, a, k) if x.dim() == 2 else x.double()
            ref = torch.einsum("tak,tank->tan", xs, ref_w[ids])
            y = qmatmul_id(x, w, ids, ieee=True)
            assert _rel(y, ref) < REL_TOL, (t, a, x.dim())
            assert torch.equal(qmatmul_id(x, w, ids.int(), ieee=True), y)  # int32 ids, as the GPU routing gives


def test_products_of_one_routing_share_its_grouping(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer's gate, up and down products (three weights, one ids tensor) group the slots once; a new ids tensor,
    or the same one changed in place, is grouped again, and every product stays exact."""
    import tandem.cuda.qlinear as qlinear

    calls = []
    align = qlinear._align_slots
    monkeypatch.setattr(qlinear, "_align_slots", lambda *a: calls.append(1) or align(*a))
    rng = np.random.default_rng(7)
    qtype, e, n, k, t, a = TYPES[0], 5, 16, 256, 20, 3
    raws = [random_blocks(qtype, (e, n, k), rng) for _ in range(3)]
    weights = [GPUQuantWeight(torch.from_numpy(r.reshape(-1).copy()), qtype, (e, n, k)) for r in raws]
    refs = [torch.from_numpy(np.stack([gguf.quants.dequantize(r[i], qtype) for i in range(e)])).double() for r in raws]
    x = torch.randn(t, k)
    xs = x.double()[:, None, :].expand(t, a, k)

    def products(ids: torch.Tensor) -> None:
        for w, ref_w in zip(weights, refs, strict=True):
            want = torch.einsum("tak,tank->tan", xs, ref_w[ids])
            assert _rel(qmatmul_id(x, w, ids, ieee=True), want) < REL_TOL

    ids = torch.randint(0, e, (t, a), generator=torch.Generator().manual_seed(1))
    products(ids)
    assert len(calls) == 1
    ids[0, 0] = (ids[0, 0] + 1) % e  # in place: grouped again
    products(ids)
    assert len(calls) == 2
    products(torch.randint(0, e, (t, a), generator=torch.Generator().manual_seed(2)))
    assert len(calls) == 3
    with torch.inference_mode():  # as the model runs: ids without a version counter, a new tensor per routing
        for seed in (3, 4):
            products(torch.randint(0, e, (t, a), generator=torch.Generator().manual_seed(seed)))
    assert len(calls) == 5


def _qmv(w: GPUQuantWeight, x: torch.Tensor, ids: torch.Tensor | None, bn: int, sb: int) -> torch.Tensor:
    """`_qmv` with one configuration (BN rows, SB superblocks per step), past the autotuner: y [R, N] f32 for
    x [T, K] (shared by the A slots of a token: R = T * A) or [R, K], ids [T, A] or None (R = T)."""
    n, k = w.n_out, w.n_in
    r = x.shape[0] if ids is None else ids.numel()
    x_div = r // x.shape[0]
    y = torch.empty(r, n)
    flat = torch.zeros(1, dtype=torch.int64) if ids is None else ids.reshape(-1)
    qk._qmv.fn[(triton.cdiv(n, bn), r)](
        w.data, x, y, flat, n, k, w.row_bytes, w.expert_bytes if ids is not None else 0, x_div, x.stride(0),
        y.stride(0), 0, QT=int(w.qtype), HAS_IDS=ids is not None, BN=bn, SB=sb,
    )  # fmt: skip
    return y


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_gemv_configurations(qtype: gguf.GGMLQuantizationType) -> None:
    """The decode GEMV's tile shapes: one row per program and several (N = 6: the last program of 4 rows
    partly past N), loop steps partly past K (3 superblocks, or 17 32-value blocks, in steps of 2), x in f32,
    bf16 and f16 (read in pairs of values), selected experts with x shared or per slot."""
    rng = np.random.default_rng(300 + int(qtype))
    e, n, k = 3, 6, 768 if qtype in TYPES[3:] else 544
    raw = random_blocks(qtype, (e, n, k), rng)
    ref_w = torch.from_numpy(np.stack([gguf.quants.dequantize(raw[i], qtype) for i in range(e)])).double()
    experts = GPUQuantWeight(torch.from_numpy(raw.reshape(-1).copy()), qtype, (e, n, k))
    plain = GPUQuantWeight(experts.data[: experts.expert_bytes], qtype, (n, k))
    x = torch.randn(1, k)
    for dtype, bn in ((torch.float32, 1), (torch.float32, 4), (torch.bfloat16, 4), (torch.float16, 4)):
        xd = x.to(dtype)
        assert _rel(_qmv(plain, xd, None, bn, 2), xd.double() @ ref_w[0].T) < REL_TOL, (dtype, bn)
    ids = torch.tensor([[2, 0]])
    for xe in (x, torch.randn(2, k)):  # shared by the token's two slots, or one row per slot
        xs = xe.double().expand(2, k) if xe.shape[0] == 1 else xe.double()
        ref = torch.einsum("rk,rnk->rn", xs, ref_w[ids.reshape(-1)])
        assert _rel(_qmv(experts, xe, ids, 4, 2), ref) < REL_TOL, xe.shape


class _ChunkStream:
    """A stand-in for weights/offload.py's ExpertStream: chunks of `per_chunk` experts, copied, that hold
    routed experts (trimmed to the first and last routed one, as ExpertStream does)."""

    def __init__(self, per_chunk: int) -> None:
        self.per_chunk = per_chunk
        self.seen: list[tuple[int, int]] = []

    def chunks(self, w: GPUQuantWeight, tiles_per_expert: list[int]):
        assert all(isinstance(c, int) for c in tiles_per_expert)
        for e0 in range(0, w.shape[0], self.per_chunk):
            used = [e for e in range(e0, min(e0 + self.per_chunk, w.shape[0])) if tiles_per_expert[e]]
            if used:
                c0, c1 = used[0], used[-1] + 1
                self.seen.append((c0, c1))
                data = w.data[c0 * w.expert_bytes : c1 * w.expert_bytes].clone()
                yield c0, c1, GPUQuantWeight(data, w.qtype, (c1 - c0, *w.shape[1:]))


def _skewed_ids(t: int, a: int, pool: list[int], heavy: int, seed: int) -> torch.Tensor:
    """ids [T, A] from `pool` (distinct per token), expert `heavy` in every token's first slot."""
    g = torch.Generator().manual_seed(seed)
    rest = [e for e in pool if e != heavy]
    picks = [[heavy] + [rest[i] for i in torch.randperm(len(rest), generator=g)[: a - 1].tolist()] for _ in range(t)]
    ids = torch.tensor(picks)
    return ids[:, torch.randperm(a, generator=g)]  # the heavy expert in any slot


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_grouped_experts(qtype: gguf.GGMLQuantizationType) -> None:
    """The grouped GEMM over blocks: K no multiple of 256 (32-blocks), N no multiple of BN, unused experts,
    an expert with more slots than a tile, x shared or per slot, exact f32 and bf16 products, and chunks of
    streamed experts equal to the resident product."""
    from tandem.cuda.qlinear import _tile_rows

    rng = np.random.default_rng(200 + int(qtype))
    e, n, k = 6, 40, 512 + (32 if qtype in TYPES[:3] else 0)
    raw = random_blocks(qtype, (e, n, k), rng)
    ref_w = torch.from_numpy(np.stack([gguf.quants.dequantize(raw[i], qtype) for i in range(e)])).double()
    w = GPUQuantWeight(torch.from_numpy(raw.reshape(-1).copy()), qtype, (e, n, k))
    t, a = 40, 2
    ids = _skewed_ids(t, a, pool=[0, 2, 3, 5], heavy=3, seed=int(qtype))  # experts 1 and 4 unused
    assert (ids == 3).sum() > _tile_rows(t * a, e)  # expert 3 spans two tiles
    stream = _ChunkStream(per_chunk=2)
    streamed = GPUQuantWeight(w.data, qtype, (e, n, k), stream=stream)
    for x in (torch.randn(t, k), torch.randn(t, a, k)):
        xs = x.double()[:, None, :].expand(t, a, k) if x.dim() == 2 else x.double()
        ref = torch.einsum("tak,tank->tan", xs, ref_w[ids])
        for ieee, tol in ((True, REL_TOL), (False, 1e-2)):
            y = qmatmul_id(x, w, ids, ieee=ieee)
            assert y.shape == (t, a, n) and y.dtype == x.dtype
            assert _rel(y, ref) < tol, (x.dim(), ieee)
            if x.dim() == 2:  # the streamed path: one launch per chunk of experts, the same tiles
                assert torch.equal(qmatmul_id(x, streamed, ids, ieee=ieee), y), ieee
    assert stream.seen[:3] == [(0, 1), (2, 4), (5, 6)]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_align_slots_invariants(dtype: torch.dtype) -> None:
    from tandem.cuda.qlinear import _align_slots, _max_tiles, _tile_rows

    g = torch.Generator().manual_seed(0)
    cases = [
        (torch.randint(0, 5, (70,), generator=g), 5, 16),  # several tiles per expert
        (torch.tensor([3, 3, 3, 0, 7, 3, 0, 3] * 5), 9, 16),  # unused experts, one over a tile
        (torch.arange(33) % 11, 11, 16),  # every expert 3 slots
        (torch.arange(20), 20, 16),  # one slot per expert: the bound is reached
        (torch.full((17,), 2), 4, 16),  # a single expert, 17 = one tile + 1
        (torch.randint(0, 40, (200,), generator=g), 40, _tile_rows(200, 40)),  # 32 rows a tile
    ]
    for flat, n_exp, tile in cases:
        flat = flat.to(dtype)
        r = flat.numel()
        tile_expert, slots, tiles = _align_slots(flat, n_exp, tile)
        n_max = _max_tiles(r, n_exp, tile)
        assert tile_expert.shape == (n_max,) and slots.shape == (n_max * tile,) and tiles.shape == (n_exp,)
        assert tile_expert.dtype == slots.dtype == tiles.dtype == torch.int32
        counts = torch.bincount(flat.long(), minlength=n_exp)
        want_tiles = (counts + tile - 1) // tile
        assert torch.equal(tiles.long(), want_tiles)
        n_used = int(want_tiles.sum())
        assert n_used <= n_max
        # used tiles first, in expert order, each expert's count of tiles; then unused tiles (-1, no slots)
        want_expert = torch.repeat_interleave(torch.arange(n_exp), want_tiles)
        assert torch.equal(tile_expert[:n_used].long(), want_expert)
        assert (tile_expert[n_used:] == -1).all() and (slots[n_used * tile :] == -1).all()
        rows = slots[: n_used * tile].view(n_used, tile).long()
        live = rows >= 0
        assert torch.equal(torch.sort(rows[live]).values, torch.arange(r))  # every slot exactly once
        assert (flat.long()[rows[live]] == tile_expert[:n_used, None].long().expand_as(rows)[live]).all()
        for ex in range(n_exp):  # an expert's slots in order, padding only at the end of its last tile
            mine = rows[tile_expert[:n_used] == ex].reshape(-1)
            c = int(counts[ex])
            assert torch.equal(mine[:c], (flat.long() == ex).nonzero().view(-1)) and (mine[c:] == -1).all()
    assert _max_tiles(20, 20, 16) == 20 and _max_tiles(4096, 128, 64) == 4096 // 64 + 126
    assert [_tile_rows(r, 128) for r in (40, 512, 2048, 4096, 32768)] == [16, 16, 32, 64, 64]
