"""The decode-attention kernels, run on the CPU by Triton's interpreter (CI has no GPU): GQA, sliding
windows, softcapping, sinks, head dims up to 512 and not powers of two, the first and last position,
empty and partial splits, against float64 attention."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # on a GPU machine (pytest -m gpu collects this module too) the kernels compile
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

from dataclasses import dataclass

import pytest

triton = pytest.importorskip("triton", reason="triton is a dev dependency (pip install -e '.[dev]')")
if os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available():
    pytest.skip(
        "the interpreter run is for machines without a GPU; see tests/test_gpu_decode_attention.py",
        allow_module_level=True,
    )

from tandem.cuda.decode_attention import decode_attention  # noqa: E402 (after the skips above)

REL_TOL = 1e-5  # f32 output: f32 products and sums, against float64


@dataclass(frozen=True)
class Case:
    heads: int
    kv_heads: int
    d: int
    dv: int
    n_keys: int
    p: int
    window: int | None = None
    softcap: float | None = None
    sinks: bool = False


CASES = {
    "gqa4": Case(8, 2, 64, 64, 80, 70),
    "window": Case(4, 2, 32, 32, 96, 90, window=20),  # the valid keys start inside a tile
    "softcap": Case(4, 1, 48, 40, 64, 50, softcap=2.0),  # D, Dv no powers of two, differing
    "sinks": Case(8, 8, 16, 16, 40, 39, sinks=True),  # p = S - 1, no GQA
    "d512": Case(2, 1, 512, 512, 40, 33),
    "d128": Case(4, 1, 128, 128, 48, 47, window=32, softcap=5.0, sinks=True),
    "p0": Case(4, 2, 32, 32, 48, 0, sinks=True),
    "group20": Case(20, 1, 16, 16, 33, 30),  # two blocks of query heads per KV head, the second partial
}
# (query, cache) dtypes: one 16-bit type, two (tf32 products), f32 with a 16-bit cache, all f32
DTYPES = {
    "bf16": (torch.bfloat16, torch.bfloat16),
    "bf16-f16": (torch.bfloat16, torch.float16),
    "f32-bf16": (torch.float32, torch.bfloat16),
    "f32": (torch.float32, torch.float32),
}


def reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, p: int, case: Case, sinks: torch.Tensor | None
) -> torch.Tensor:
    """float64 masked softmax attention of q [1, H, D] at position p -> [1, H, Dv]."""
    group = case.heads // case.kv_heads
    k = keys.double().repeat_interleave(group, dim=1)  # [S, H, D]
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,shd->hs", q[0].double(), k) / case.d**0.5
    if case.softcap is not None:
        scores = torch.tanh(scores / case.softcap) * case.softcap
    j = torch.arange(case.n_keys)
    allowed = (j <= p) & ((p - j < case.window) if case.window is not None else True)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double()[:, None]], dim=1)
    probs = torch.softmax(scores, dim=1)[:, : case.n_keys]
    return torch.einsum("hs,shd->hd", probs, v)[None]


def _inputs(case: Case, q_dtype: torch.dtype, cache_dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, case.heads, case.d, generator=g).to(q_dtype)
    keys = torch.randn(case.n_keys, case.kv_heads, case.d, generator=g).to(cache_dtype)
    values = torch.randn(case.n_keys, case.kv_heads, case.dv, generator=g).to(cache_dtype)
    sinks = torch.randn(case.heads, generator=g) * 2 if case.sinks else None
    return q, keys, values, sinks


def _check(y: torch.Tensor, ref: torch.Tensor) -> None:
    """f32 output: REL_TOL. 16-bit output: within one unit in the last place in norm; rounding the exact
    output takes about a quarter, the rest is the probabilities' rounding to the cache's type before P.V
    (and here Triton's interpreter truncates f32 to bf16 where the GPU rounds to nearest)."""
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    assert rel < (REL_TOL if y.dtype == torch.float32 else torch.finfo(y.dtype).eps), rel


@pytest.mark.parametrize("dtypes", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_float64(case: Case, dtypes: tuple[torch.dtype, torch.dtype]) -> None:
    q, keys, values, sinks = _inputs(case, *dtypes, seed=case.n_keys + case.d)
    ref = reference(q, keys, values, case.p, case, sinks)
    positions = torch.tensor([case.p])
    for n_splits in (None, 1, 4):  # the default, one run, runs past the valid keys that stay empty
        y = decode_attention(
            q, keys, values, positions, case.d**-0.5, case.window, case.softcap, sinks, n_splits=n_splits
        )
        assert y.shape == (1, case.heads, case.dv) and y.dtype == q.dtype
        _check(y, ref)


def test_position_is_read_on_the_device() -> None:
    """One call's grid serves every position: the same tensors, positions changed in place."""
    case = CASES["window"]
    q, keys, values, _ = _inputs(case, torch.float32, torch.float32, seed=1)
    positions = torch.tensor([0])
    for p in (0, 5, 19, 20, 63, 95):
        positions.fill_(p)
        y = decode_attention(q, keys, values, positions, case.d**-0.5, case.window)
        _check(y, reference(q, keys, values, p, case, None))


@pytest.mark.parametrize("p", [23, 40, 47, 130])
def test_sliding_window_ring(p: int) -> None:
    """A sliding-window layer's ring of R rows (kv_cache.LayerKV: position j in row j % R, R >= window): the
    same attention as over every position, for positions before and past the first wrap."""
    window, rows = 20, 24
    case = Case(4, 2, 32, 32, p + 1, p, window=window, sinks=True)
    q, keys, values, sinks = _inputs(case, torch.float32, torch.float32, seed=p)
    ring_k = torch.full((rows, case.kv_heads, case.d), float("nan"))  # rows never written must not be read
    ring_v = torch.full((rows, case.kv_heads, case.dv), float("nan"))
    held = torch.arange(max(0, p + 1 - rows), p + 1)
    ring_k[held % rows], ring_v[held % rows] = keys[held], values[held]
    y = decode_attention(q, ring_k, ring_v, torch.tensor([p]), case.d**-0.5, window, None, sinks, n_splits=3)
    _check(y, reference(q, keys, values, p, case, sinks))
