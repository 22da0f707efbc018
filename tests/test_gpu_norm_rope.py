"""RMSNorm and rope kernels on the device (`pytest -m gpu`): against float64 references, against the CPU
path, and replayed in a CUDA graph with new positions."""

from __future__ import annotations

import pytest
import torch
from norm_rope_refs import ref_rms_norm, ref_rope

from tandem.cuda.decode_attention import decode_attention
from tandem.cuda.norm_rope import store_rows
from tandem.layers.attention import AttentionShape, attend_step
from tandem.layers.norm import add_normed, add_rms_norm, rms_norm
from tandem.layers.rope import Rope, RopeSpec, YarnSpec
from tandem.state.batch import StepBatch
from tandem.state.kv_cache import KVPool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run with -m gpu on the device)"),
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# f16 has 11 significant bits, bf16 8: one ulp of the result (f32: 1e-6 relative).
_BITS = {torch.float16: 11, torch.bfloat16: 8}


def assert_close(y: torch.Tensor, ref: torch.Tensor) -> None:
    err = (y.double() - ref.double()).abs()
    floor = 1e-6 * ref.abs().max()
    if y.dtype == torch.float32:
        bound = torch.clamp(1e-6 * ref.abs(), min=floor)
    else:
        _, e = torch.frexp(ref.double())
        bound = torch.clamp(torch.ldexp(torch.ones_like(err), e - _BITS[y.dtype]), min=floor)
    assert bool((err <= bound).all()), f"max excess {(err / bound).max().item():.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm(dtype: torch.dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for rows, d in ((1, 4096), (5, 2880), (3, 8192 + 64), (64, 128)):  # one pass, padded, chunked, per head
        x = torch.randn(rows, d, device="cuda", generator=g).to(dtype)
        for w in (torch.randn(d, device="cuda", generator=g), torch.ones((), device="cuda")):
            y = rms_norm(x, w, 1e-6)
            assert y.dtype == dtype and y.shape == x.shape
            assert_close(y, ref_rms_norm(x, w, 1e-6))
    qkv = torch.randn(4, 3 * 8 * 128, device="cuda", generator=g).to(dtype)
    v = qkv.view(4, 3, 8, 128)[:, 2]  # a strided view, as a slice of a fused projection
    assert_close(rms_norm(v, torch.ones((), device="cuda"), 1e-6), ref_rms_norm(v, torch.ones(()), 1e-6))


SPECS = {
    "full": (RopeSpec(base=1e4, dim=128), 128),
    "partial": (RopeSpec(base=1e7, dim=64), 256),
    "d512": (RopeSpec(base=1e6, dim=512), 512),
    "yarn": (RopeSpec(base=15e4, dim=64, scale=1 / 32, yarn=YarnSpec(n_ctx_orig=4096)), 64),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", SPECS)
def test_rope(name: str, dtype: torch.dtype) -> None:
    spec, head_dim = SPECS[name]
    rope = Rope(spec, "cuda")
    rope.reserve(4096, "cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    pos = torch.tensor([0, 1, 2000, 4095], device="cuda")
    x = torch.randn(4, 6, head_dim, device="cuda", generator=g).to(dtype)
    cos, sin = rope._cos, rope._sin
    assert_close(rope.apply(x, pos), ref_rope(x, pos, cos, sin))
    w = torch.randn(head_dim, device="cuda", generator=g)
    assert_close(rope.apply(x, pos, w, 1e-6), ref_rope(ref_rms_norm(x, w, 1e-6), pos, cos, sin))
    if dtype == torch.float32:  # the CPU path (ggml's rounding) agrees to f32 rounding
        cpu = Rope(spec).apply(x.cpu(), pos.cpu())
        assert_close(rope.apply(x, pos).cpu(), cpu.double())


def test_rope_in_cuda_graph() -> None:
    """The decode step is captured once and replayed with new positions, read on the device."""
    spec, head_dim = SPECS["partial"]
    rope = Rope(spec, "cuda")
    rope.reserve(1024, "cuda")
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(1, 4, head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(head_dim, device="cuda", generator=g)
    pos = torch.zeros(1, dtype=torch.long, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        rope.apply(x, pos, w, 1e-6)
        rms_norm(x, w, 1e-6)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rope.apply(x, pos, w, 1e-6)
        normed = rms_norm(x, w, 1e-6)
    for p in (5, 777, 1023):
        pos.fill_(p)
        x.copy_(torch.randn(x.shape, device="cuda", generator=g))
        graph.replay()
        assert_close(out, ref_rope(ref_rms_norm(x, w, 1e-6), pos, rope._cos, rope._sin))
        assert_close(normed, ref_rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rms_norm(dtype: torch.dtype) -> None:
    """One kernel: the sum bit for bit torch's `x + h`, the norm the one of that rounded sum."""
    g = torch.Generator(device="cuda").manual_seed(3)
    for rows, d in ((1, 4096), (5, 2880), (3, 8192 + 64)):  # one pass, padded, chunked
        x = torch.randn(rows, d, device="cuda", generator=g).to(dtype)
        h = (torch.randn(rows, d, device="cuda", generator=g) * 8).to(dtype)
        w = torch.randn(d, device="cuda", generator=g)
        total, normed = add_rms_norm(x, h, w, 1e-6)
        assert torch.equal(total, x + h)
        assert torch.equal(normed, rms_norm(x + h, w, 1e-6))  # same arithmetic as the unfused norm kernel
        assert_close(normed, ref_rms_norm(x + h, w, 1e-6))


@pytest.mark.parametrize("d", [2816, 4096, 640])
def test_block_tail_in_one_kernel(d: int) -> None:
    """`add_normed` on CUDA (one kernel: Gemma 4's two normed FFN branches, post-norm, residual add and layer scale)
    is the ops' own chain and the float64 formula within f32 rounding (not bit for bit: inside one kernel the
    compiler contracts a product and the sum after it into one FMA)."""
    g = torch.Generator(device="cuda").manual_seed(5)
    x, a, b = (torch.randn(4, d, device="cuda", generator=g) * s for s in (4.0, 3.0, 20.0))
    wa, wb, wp = (torch.randn(d, device="cuda", generator=g) for _ in range(3))
    scale = torch.tensor([0.4], device="cuda")
    y = add_normed(x, [(a, (wa, 1e-6)), (b, (wb, 1e-6))], (wp, 1e-6), scale)
    unfused = (x + rms_norm(rms_norm(a, wa, 1e-6) + rms_norm(b, wb, 1e-6), wp, 1e-6)) * scale
    assert_close(y, unfused.double())
    ref = (x.double() + ref_rms_norm(ref_rms_norm(a, wa, 1e-6) + ref_rms_norm(b, wb, 1e-6), wp, 1e-6)) * 0.4
    assert_close(y, ref)
    assert_close(add_normed(x, [(a, (wa, 1e-6))]), x.double() + ref_rms_norm(a, wa, 1e-6))  # a post-norm, its add


@pytest.mark.parametrize("cache_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rope_into_cache(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """Rope writing k into its cache row, and v stored by one kernel, store what rope, casts and
    index_copy_ store, bit for bit."""
    spec, head_dim = SPECS["partial"]
    rope = Rope(spec, "cuda")
    rope.reserve(512, "cuda")
    g = torch.Generator(device="cuda").manual_seed(4)
    pos = torch.tensor([300], device="cuda")
    kv = torch.randn(1, 2, 4, head_dim, device="cuda", generator=g).to(dtype)
    k, v = kv[:, 0], kv[:, 1]  # strided views, as slices of a fused projection
    w = torch.randn(head_dim, device="cuda", generator=g)
    fused = KVPool.allocate(2, 512, 4, head_dim, head_dim, cache_dtype, "cuda")
    plain = KVPool.allocate(2, 512, 4, head_dim, head_dim, cache_dtype, "cuda")
    slots = torch.tensor([1], device="cuda")
    assert rope.apply(k, pos, w, 1e-6, into=fused.k, slots=slots) is fused.k
    store_rows(v, pos, fused.v, slots=slots)
    plain.slot(1).store(300, rope.apply(k, pos, w, 1e-6), v)
    assert torch.equal(fused.k, plain.k) and torch.equal(fused.v, plain.v)


class _Layer:
    """What `attend_step` reads of an attention layer."""

    def __init__(self, rope: Rope, head_dim: int, q_norm: torch.Tensor, k_norm: torch.Tensor) -> None:
        self.shape = AttentionShape(8, 2, head_dim, head_dim, head_dim**-0.5, None)
        self.rope, self.q_norm, self.k_norm, self.norm_eps = rope, q_norm, k_norm, 1e-6


def test_fused_kv_store_in_cuda_graph() -> None:
    """The decode step's rope-into-cache and value store, captured once and replayed at two positions: the
    cache rows and the attention output are those of the unfused ops."""
    spec, head_dim = SPECS["full"]
    rope = Rope(spec, "cuda")
    rope.reserve(1024, "cuda")
    g = torch.Generator(device="cuda").manual_seed(5)
    layer = _Layer(rope, head_dim, *torch.randn(2, head_dim, device="cuda", generator=g))
    q = torch.randn(1, 8, head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(1, 2, head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(1, 2, head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
    batch = StepBatch.build([(1, 0, [0])], torch.device("cuda"))  # a pooled decode step of slot 1
    pos = batch.positions
    pool = KVPool.allocate(2, 1024, 2, head_dim, head_dim, torch.float16, "cuda")
    plain = KVPool.allocate(2, 1024, 2, head_dim, head_dim, torch.float16, "cuda").slot(1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture (this writes row 0 of the cache)
        attend_step(layer, q, k, v, batch, pool)
    torch.cuda.current_stream().wait_stream(stream)
    plain.store(0, rope.apply(k, pos, layer.k_norm, 1e-6), v)  # the same row 0 in the reference cache
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend_step(layer, q, k, v, batch, pool)
    for p in (3, 700):
        pos.fill_(p)
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, device="cuda", generator=g))
        graph.replay()
        plain.store(p, rope.apply(k, pos, layer.k_norm, 1e-6), v)
        assert torch.equal(pool.k[1], plain.k) and torch.equal(pool.v[1], plain.v) and not pool.k[0].any()
        q_rot = rope.apply(q, pos, layer.q_norm, 1e-6)
        assert torch.equal(out, decode_attention(q_rot, plain.k, plain.v, pos, layer.shape.scale))
