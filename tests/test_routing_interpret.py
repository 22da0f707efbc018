"""The GPU routing kernels, run on the CPU by Triton's interpreter (CI has no GPU): the fused routing against
the torch routing of the routers in layers/moe.py (the path it replaces on the GPU), and the router logits'
GEMV against a float64 product."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # on a GPU machine (pytest -m gpu collects this module too) the kernels compile
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

import pytest

triton = pytest.importorskip("triton", reason="triton is a dev dependency (pip install -e '.[dev]')")
if os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available():
    pytest.skip("the interpreter run is for machines without a GPU; see tests/test_gpu.py", allow_module_level=True)

from tandem.cuda.routing import mix_experts, route, router_logits  # noqa: E402
from tandem.layers.moe import NormedSoftmaxTopKRouter, Routing, SoftmaxTopKRouter, TopKSoftmaxRouter  # noqa: E402

WEIGHT_TOL = 1e-6


def _torch_routing(
    logits: torch.Tensor, a: int, softmax_first: bool, renorm: bool, bias: torch.Tensor | None
) -> Routing:
    """The routers' own torch path (logits on the CPU), fed the logits through a stand-in projection."""
    proj = lambda _: logits  # noqa: E731
    x = torch.ones(logits.shape[0], 4)
    if not softmax_first:
        return TopKSoftmaxRouter(proj=proj, n_active=a, bias=bias)(x)  # type: ignore[arg-type]
    return SoftmaxTopKRouter(proj=proj, n_active=a, renormalize=renorm)(x)  # type: ignore[arg-type]


def _check(
    logits: torch.Tensor, a: int, softmax_first: bool, renorm: bool = False, bias: torch.Tensor | None = None
) -> tuple[Routing, Routing]:
    """The kernel's ids and weights against torch's: the same chosen values (as sorted lists) and weights
    within WEIGHT_TOL, ids distinct and ordered by value (descending), the lower expert first on ties.
    Returns both routings for order checks."""
    ids, weights = route(logits, a, softmax_first, renorm, bias)
    ref = _torch_routing(logits, a, softmax_first, renorm, bias)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.shape == weights.shape == (len(logits), a)
    values = logits.float() + (0 if bias is None else bias.float())  # what the experts are picked by
    for t in range(len(logits)):
        mine, theirs = values[t, ids[t]], values[t, ref.ids[t]]
        assert len(set(ids[t].tolist())) == a
        assert torch.equal(mine, theirs.sort(descending=True).values), t
        order = sorted(range(a), key=lambda j: (-mine[j].item(), ids[t, j].item()))
        assert order == list(range(a)), t
        assert (weights[t] - ref.weights[t].sort(descending=True).values).abs().max() <= WEIGHT_TOL, t
    return Routing(ids=ids, weights=weights), ref


@pytest.mark.parametrize("renorm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 5])
def test_softmax_then_top(t: int, dtype: torch.dtype, renorm: bool) -> None:
    """Qwen (renormalised or not) and Gemma 4 (renormalised): E = 128, A = 8, and E = 60 (not a power of two)."""
    g = torch.Generator().manual_seed(t + 10 * renorm)
    for e, a in ((128, 8), (60, 4)):
        logits = (torch.randn(t, e, generator=g) * 2).to(dtype)
        mine, ref = _check(logits, a, softmax_first=True, renorm=renorm)
        if dtype == torch.float32:  # no ties: torch's order exactly
            assert torch.equal(mine.ids, ref.ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 5])
def test_top_then_softmax_with_bias(t: int, dtype: torch.dtype) -> None:
    """gpt-oss: E = 32, A = 4, a bias added to the logits before the pick, softmax over the A picked."""
    g = torch.Generator().manual_seed(100 + t)
    logits = torch.randn(t, 32, generator=g).to(dtype)
    bias = torch.randn(32, generator=g)
    mine, ref = _check(logits, 4, softmax_first=False, bias=bias)
    if dtype == torch.float32:
        assert torch.equal(mine.ids, ref.ids)
    _check(logits, 4, softmax_first=False)  # no bias


def test_ties() -> None:
    """Equal logits inside the top A: the same experts and weights as torch, the lower expert first; equal
    logits across the A-th place (torch picks any of them): the lowest experts."""
    logits = torch.zeros(2, 16)
    logits[0, [9, 2, 5]] = 3.0
    logits[0, [11, 4]] = 1.0
    logits[1, [7, 3, 12]] = 2.0
    for softmax_first in (True, False):
        mine, _ = _check(logits, 4, softmax_first)
        assert mine.ids[0].tolist() == [2, 5, 9, 4]
        assert mine.ids[1].tolist() == [3, 7, 12, 0]


def test_gemma4_router_reference() -> None:
    """NormedSoftmaxTopKRouter's torch path (which the kernel replaces on the GPU) is softmax, top A,
    renormalised: the kernel with renormalisation matches it."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 128, generator=g)
    router = NormedSoftmaxTopKRouter(proj=lambda _: logits, input_scale=torch.ones(4), n_active=8, eps=1e-6)  # type: ignore[arg-type]
    ref = router(torch.randn(3, 4, generator=g))
    ids, weights = route(logits, 8, softmax_first=True, renormalize=True)
    assert torch.equal(ids, ref.ids)
    assert (weights - ref.weights).abs().max() <= WEIGHT_TOL


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize(("n", "k"), [(128, 2048), (60, 200), (1, 2048)])
def test_router_logits(n: int, k: int, m: int, x_dtype: torch.dtype) -> None:
    """The router GEMV (f32 weight [N, K], x read in its own type) against float64: f32 sums of exact products
    stay within 1e-6 of the sum of |products| (N = 60, K = 200: row and column tails; M = 16: several weight rows
    per program, K in steps; N = 1: a shared expert's gate, layers/shared_expert.py)."""
    g = torch.Generator().manual_seed(n + k + m)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(m, k, generator=g).to(x_dtype)
    y = router_logits(x, w)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    ref = x.double() @ w.double().T
    assert ((y.double() - ref).abs() <= 1e-6 * (x.double().abs() @ w.double().abs().T)).all()


def test_router_logits_16bit_weight_strided_rows() -> None:
    """A bf16 weight, and x rows that are a slice of wider rows (a row stride other than K)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(60, 200, generator=g).to(torch.bfloat16)
    x = torch.randn(3, 256, generator=g)[:, :200]
    ref = x.double() @ w.double().T
    assert ((router_logits(x, w).double() - ref).abs() <= 1e-6 * (x.double().abs() @ w.double().abs().T)).all()


@pytest.mark.parametrize("scale", [False, True], ids=["", "scale"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_mix_experts_is_the_torch_mixing(scale: bool, bias: bool) -> None:
    """The selected experts' rows scaled, biased and mixed in one kernel: torch's index, multiply, add and sum within
    f32 rounding, negative ids (a split's slots of other parts) indexing from the end as torch does, and columns
    past a program's block."""
    g = torch.Generator().manual_seed(3)
    t, a, d, e = 5, 4, 1100, 6
    out = torch.randn(t, a, d, generator=g)
    ids = torch.randint(-1, e, (t, a), generator=g, dtype=torch.int32)
    weights = torch.rand(t, a, generator=g)
    s = torch.rand(e, generator=g) + 0.5 if scale else None
    bb = torch.randn(e, d, generator=g) if bias else None
    y = mix_experts(out, ids, weights, s, bb)
    ref = out.double()
    if s is not None:
        ref = ref * s.double()[ids.long()].unsqueeze(-1)
    if bb is not None:
        ref = ref + bb.double()[ids.long()]
    ref = (ref * weights.double().unsqueeze(-1)).sum(dim=1)
    assert y.shape == (t, d) and y.dtype == torch.float32
    assert torch.allclose(y.double(), ref, rtol=1e-6, atol=1e-5 * ref.abs().max().item())
