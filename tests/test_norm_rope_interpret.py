"""The RMSNorm and rope kernels, run on the CPU by Triton's interpreter (CI has no GPU), against float64
references: strided views, chunked rows, scalar weights, partial rotary, fused q/k norms, bf16 and f32."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # on a GPU machine (pytest -m gpu collects this module too) the kernels compile
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

import pytest
from norm_rope_refs import ref_rms_norm, ref_rope

triton = pytest.importorskip("triton", reason="triton is a dev dependency (pip install -e '.[dev]')")
if os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available():
    pytest.skip("the interpreter run is for machines without a GPU; see tests/test_gpu.py", allow_module_level=True)

from tandem.cuda import norm_rope  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def assert_close(y: torch.Tensor, ref: torch.Tensor) -> None:
    """f32: 1e-6 relative to the element (or to the largest one, under cancellation); bf16: one bf16 ulp."""
    err = (y.double() - ref).abs()
    floor = 1e-6 * ref.abs().max()
    if y.dtype == torch.float32:
        bound = torch.clamp(1e-6 * ref.abs(), min=floor)
    else:
        _, e = torch.frexp(ref)
        bound = torch.clamp(torch.ldexp(torch.ones_like(ref), e - 8), min=floor)  # bf16: 8 significant bits
    assert bool((err <= bound).all()), f"max excess {(err / bound).max().item():.3g}"


def tables(n_pos: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    theta = torch.arange(n_pos, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(half) / half)
    return torch.cos(theta).float(), torch.sin(theta).float()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_rows(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 96, generator=g).to(dtype)
    w = torch.randn(96, generator=g)
    y = norm_rope.rms_norm_rows(x, w, 1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, ref_rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_views_and_scalar_weights(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    base = torch.randn(2, 5, 80, generator=g).to(dtype)
    for x in (base[:, 1:4, :64], base.transpose(0, 1)[:, :, 3:67], base[..., ::2]):  # strided rows and columns
        for w in (torch.randn(x.shape[-1], generator=g), torch.tensor(0.5), torch.ones(()), torch.full((1,), 2.0)):
            y = norm_rope.rms_norm_rows(x, w, 1e-5)
            assert y.shape == x.shape and y.is_contiguous()
            assert_close(y, ref_rms_norm(x, w, 1e-5))


def test_rms_norm_long_rows_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(norm_rope, "_MAX_BLOCK", 64)  # rows of 200: 4 chunks, the last one partial
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 200, generator=g)
    w = torch.randn(200, generator=g)
    assert_close(norm_rope.rms_norm_rows(x, w, 1e-6), ref_rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("head_dim", "dim"), [(64, 64), (96, 32), (512, 512)], ids=["full", "partial", "d512"])
def test_rope(dtype: torch.dtype, head_dim: int, dim: int) -> None:
    g = torch.Generator().manual_seed(head_dim + dim)
    cos, sin = tables(40, dim // 2)
    pos = torch.tensor([17, 18, 39])  # not starting at 0
    x = torch.randn(3, 2, head_dim, generator=g).to(dtype)
    y = norm_rope.rope_rows(x, pos, cos, sin)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, ref_rope(x.double(), pos, cos, sin))
    assert torch.equal(y[..., dim:], x[..., dim:])  # partial rotary: the rest is copied bit for bit


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_with_head_norm(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    cos, sin = tables(16, 16)
    pos = torch.tensor([5, 9], dtype=torch.int32)
    qkv = torch.randn(2, 3, 4, 80, generator=g).to(dtype)  # a fused projection [T, 3, H, 80]
    for x in (qkv[:, 1, :, 8:48], qkv[:, 2, :, ::2]):  # [T=2, H=4, Dh=40]: strided heads, then strided values
        for w in (torch.randn(40, generator=g), torch.ones(())):
            y = norm_rope.rope_rows(x, pos, cos, sin, w, 1e-6)
            assert_close(y, ref_rope(ref_rms_norm(x, w, 1e-6), pos, cos, sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_add_rms_norm_rows(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sum is torch's `x + h`; the norm is the one of that rounded sum, bit for bit."""
    g = torch.Generator().manual_seed(4)
    base = torch.randn(3, 2, 200, generator=g).to(dtype)
    h = torch.randn(3, 200, generator=g).to(dtype) * 8
    w = torch.randn(200, generator=g)
    for max_block in (norm_rope._MAX_BLOCK, 64):  # one pass, then 4 chunks with the last one partial
        monkeypatch.setattr(norm_rope, "_MAX_BLOCK", max_block)
        for x in (base[:, 0], base[:, 1, :]):  # contiguous rows, then strided ones
            total, normed = norm_rope.add_rms_norm_rows(x, h, w, 1e-6)
            assert total.dtype == normed.dtype == dtype and total.shape == normed.shape == x.shape
            if dtype == torch.bfloat16:  # the interpreter truncates f32 -> bf16 (a GPU rounds to nearest even)
                assert_close(total, (x.double() + h.double()))
            else:
                assert torch.equal(total, x + h)
            assert torch.equal(normed, norm_rope.rms_norm_rows(total, w, 1e-6))
            assert_close(normed, ref_rms_norm(total, w, 1e-6))



def _unfused_tail(x, a, a_norm, b, b_norm, post, scale):  # type: ignore[no-untyped-def]
    """The ops `normed_residual_rows` replaces, with the norm kernel the unfused path runs."""
    h = a if a_norm is None else norm_rope.rms_norm_rows(a, *a_norm)
    if b is not None:
        h = h + (b if b_norm is None else norm_rope.rms_norm_rows(b, *b_norm))
    if post is not None:
        h = norm_rope.rms_norm_rows(h, *post)
    y = x + h
    return y if scale is None else y * scale


def _ref_tail(x, a, a_norm, b, b_norm, post, scale):  # type: ignore[no-untyped-def]
    h = a.double() if a_norm is None else ref_rms_norm(a, *a_norm)
    if b is not None:
        h = h + (b.double() if b_norm is None else ref_rms_norm(b, *b_norm))
    if post is not None:
        h = ref_rms_norm(h, *post)
    y = x.double() + h
    return y if scale is None else y * scale.double()


@pytest.mark.parametrize("scale", ["none", "scalar", "vector"])
@pytest.mark.parametrize("parts", ["a", "norm(a)", "norm(a)+b", "a+norm(b)", "norm(a)+norm(b)"])
@pytest.mark.parametrize("post", [False, True], ids=["", "post"])
def test_normed_residual_rows(parts: str, post: bool, scale: str) -> None:
    """A block's tail in one kernel is the unfused ops bit for bit, and the float64 formula within f32 rounding:
    every combination of the branch norms, the second branch, the post-norm and the scale."""
    g = torch.Generator().manual_seed(7)
    d = 200
    x, a, b = (torch.randn(3, d, generator=g) * s for s in (4.0, 3.0, 20.0))
    wa, wb, wp = (torch.randn(d, generator=g) for _ in range(3))
    a_norm = (wa, 1e-6) if parts.startswith("norm(a)") else None
    has_b = "+" in parts
    b_norm = (wb, 1e-5) if parts.endswith("norm(b)") else None
    post_norm = (wp, 1e-6) if post else None
    s = {"none": None, "scalar": torch.tensor([0.375]), "vector": torch.randn(d, generator=g)}[scale]
    args = (x, a, a_norm, b if has_b else None, b_norm, post_norm, s)
    y = norm_rope.normed_residual_rows(*args)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert torch.equal(y, _unfused_tail(*args))
    assert_close(y, _ref_tail(*args))


CACHE_DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def assert_stored(cache: torch.Tensor, expected: torch.Tensor, src_dtype: torch.dtype) -> None:
    """Bit for bit, except f32 -> bf16, which the interpreter truncates (a GPU rounds to nearest even, as
    torch does): there within one bf16 ulp."""
    if src_dtype == torch.float32 and cache.dtype == torch.bfloat16:
        assert_close(cache, expected.double())
    else:
        assert torch.equal(cache, expected)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_into_cache_rows(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """Rope writing into a cache at the positions stores exactly what rope, a cast and index_copy_ store."""
    g = torch.Generator().manual_seed(5)
    cos, sin = tables(32, 16)
    kv = torch.randn(2, 3, 80, generator=g).to(dtype)
    x = kv[:, :, 4:52]  # [T=2, H=3, Dh=48]: strided heads; partial rotary (dim 32)
    pos = torch.tensor([7, 30])
    for norm, rows in ((None, 32), (torch.randn(48, generator=g), 32), (None, 12)):  # 12 rows: a ring, pos % 12
        cache = torch.randn(rows, 3, 48, generator=g).to(cache_dtype)
        rotated = norm_rope.rope_rows(x, pos, cos, sin, norm, 1e-6).to(cache_dtype)
        expected = cache.clone().index_copy_(0, pos % rows, rotated)
        assert norm_rope.rope_rows(x, pos, cos, sin, norm, 1e-6, into=cache) is cache
        assert_stored(cache, expected, dtype)  # the written rows, and every other row untouched


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_rows(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(6)
    v = torch.randn(1, 3, 2, 40, generator=g).to(dtype)[:, 1]  # [T=1, H=2, Dv=40], a strided view
    cache = torch.randn(16, 2, 40, generator=g).to(cache_dtype)
    expected = cache.clone().index_copy_(0, torch.tensor([9]), v.to(cache_dtype))
    assert norm_rope.store_rows(v, torch.tensor([9], dtype=torch.int32), cache) is cache
    assert_stored(cache, expected, dtype)
    expected.index_copy_(0, torch.tensor([5]), v.to(cache_dtype))  # position 37 of a 16-row ring: row 5
    norm_rope.store_rows(v, torch.tensor([37], dtype=torch.int32), cache)
    assert_stored(cache, expected, dtype)
