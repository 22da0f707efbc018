"""The decode kernels on the GPU (run on the device: `pytest -m gpu`): the fused routing against torch's
routing and from a CUDA graph, the router logits' GEMV and the routers using it, and the GEMV with 16-bit
activations (read in pairs of values)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from qblocks import random_blocks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run with -m gpu on the device)"),
]


def _torch_route(
    logits: torch.Tensor, a: int, softmax_first: bool, renorm: bool, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """layers/moe.py's torch routing (its path for logits on the CPU)."""
    from tandem.layers.moe import SoftmaxTopKRouter, TopKSoftmaxRouter

    x = torch.ones(len(logits), 4)
    proj = lambda _: logits  # noqa: E731
    if softmax_first:
        r = SoftmaxTopKRouter(proj=proj, n_active=a, renormalize=renorm)(x)  # type: ignore[arg-type]
    else:
        r = TopKSoftmaxRouter(proj=proj, n_active=a, bias=bias)(x)  # type: ignore[arg-type]
    return r.ids, r.weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 5, 600])
def test_route_matches_torch(t: int, dtype: torch.dtype) -> None:
    from tandem.cuda.routing import route

    g = torch.Generator().manual_seed(t)
    bias = torch.randn(32, generator=g)
    cases = [(128, 8, True, False, None), (128, 8, True, True, None), (60, 4, True, True, None)]
    cases += [(32, 4, False, False, bias), (32, 4, False, False, None)]
    for e, a, softmax_first, renorm, b in cases:
        logits = (torch.randn(t, e, generator=g) * 2).to(dtype)
        ids, weights = route(logits.cuda(), a, softmax_first, renorm, None if b is None else b.cuda())
        assert ids.dtype == torch.int32
        ids, weights = ids.cpu().long(), weights.cpu()
        ref_ids, ref_w = _torch_route(logits, a, softmax_first, renorm, b)
        values = logits.float() + (0 if b is None else b)
        # the same chosen values (ties may pick other experts of equal value), weights within 1e-6
        assert torch.equal(values.gather(1, ids), values.gather(1, ref_ids).sort(dim=1, descending=True).values)
        assert (weights - ref_w.sort(dim=1, descending=True).values).abs().max() <= 1e-6, (e, a, softmax_first)
        if dtype == torch.float32:  # no ties: torch's order
            assert torch.equal(ids, ref_ids), (e, a, softmax_first)


def test_route_in_cuda_graph() -> None:
    from tandem.cuda.routing import route

    logits = torch.randn(1, 128, device="cuda")
    route(logits, 8, True, True)  # compiled before the capture, as the decode step does
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, weights = route(logits, 8, True, True)
    for seed in range(3):
        logits.copy_(torch.randn(1, 128, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        want_ids, want_w = route(logits, 8, True, True)
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_router_logits_matches_float64(m: int, x_dtype: torch.dtype, w_dtype: torch.dtype) -> None:
    """The router GEMV against float64, within 1e-6 of the sum of |products|; E = 128 and 60, D = 2048 and 200."""
    from tandem.cuda.routing import router_logits

    g = torch.Generator().manual_seed(m)
    for n, k in ((128, 2048), (60, 200)):
        w = torch.randn(n, k, generator=g).to(w_dtype)
        x = torch.randn(m, k, generator=g).to(x_dtype)
        y = router_logits(x.cuda(), w.cuda()).cpu()
        assert y.dtype == torch.float32 and y.shape == (m, n)
        ref = x.double() @ w.double().T
        assert ((y.double() - ref).abs() <= 1e-6 * (x.double().abs() @ w.double().abs().T)).all(), (n, k)


def test_routers_with_dense_proj() -> None:
    """The three routers over a DenseLinear on the GPU (decode: the GEMV; prefill: cuBLAS) pick the experts of
    the same logits computed in float64, and capture in a CUDA graph."""
    from tandem.cuda.weights import DenseLinear
    from tandem.layers.moe import NormedSoftmaxTopKRouter, SoftmaxTopKRouter, TopKSoftmaxRouter

    g = torch.Generator().manual_seed(0)
    proj = DenseLinear(torch.randn(128, 2048, generator=g).cuda())
    routers = [
        SoftmaxTopKRouter(proj=proj, n_active=8, renormalize=True),
        TopKSoftmaxRouter(proj=proj, n_active=4, bias=torch.randn(128, generator=g).cuda()),
        NormedSoftmaxTopKRouter(proj=proj, input_scale=torch.ones(2048, device="cuda"), n_active=8, eps=1e-6),
    ]
    for t in (1, 40):
        x = torch.randn(t, 2048, generator=g).to(torch.bfloat16).cuda()
        for router in routers:
            r = router(x)
            assert r.ids.dtype == torch.int32 and r.weights.shape == (t, router.n_active)
            xs = x.double()
            if isinstance(router, NormedSoftmaxTopKRouter):
                xs = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + 1e-6)
            logits = xs @ proj.weight.double().T
            if isinstance(router, TopKSoftmaxRouter):
                logits = logits + router.bias.double()
            want = logits.topk(router.n_active, dim=-1).values
            got = logits.gather(1, r.ids.long())
            assert (got - want).abs().max() <= 1e-3 * logits.abs().max(), type(router).__name__
    x = torch.randn(1, 2048, device="cuda").to(torch.bfloat16)
    router = routers[0]
    router(x)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        r = router(x)
    for seed in range(3):
        x.copy_(torch.randn(1, 2048, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        want = router(x)
        assert torch.equal(r.ids, want.ids) and torch.equal(r.weights, want.weights)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_16bit_activations(qtype: Q, dtype: torch.dtype) -> None:
    """The GEMV on bf16/f16 x equals the f32 GEMV on the same values, up to the output's rounding."""
    from tandem.cuda.qlinear import GPUQuantWeight, qmatmul

    n, k = 520, 2048 + 256
    raw = random_blocks(qtype, (n, k), np.random.default_rng(int(qtype)))
    w = GPUQuantWeight(torch.from_numpy(raw.reshape(-1).copy()).cuda(), qtype, (n, k))
    x = torch.randn(2, k, device="cuda").to(dtype)
    want = qmatmul(x.float(), w)
    got = qmatmul(x, w).float()
    assert ((got - want).norm() / want.norm()).item() < 4e-3


def test_autotune_timing_is_the_gpus_alone() -> None:
    """cuda/autotune.py graph_bench: twice the bytes take about twice the time, the quantiles are ordered, and a
    thread that keeps the interpreter busy while the candidates are timed (as ggml's host ops or a compiler keep
    the CPU busy) does not enter the figure."""
    import threading

    from tandem.cuda.autotune import graph_bench

    src = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    half = lambda: dst[: 32 << 20].copy_(src[: 32 << 20])  # noqa: E731
    full = lambda: dst.copy_(src)  # noqa: E731
    t_half, t_full = graph_bench(half), graph_bench(full)
    assert isinstance(t_half, float) and isinstance(t_full, float)
    assert 1.6 < t_full / t_half < 2.4, (t_half, t_full)
    q50, q20, q80 = graph_bench(full, (0.5, 0.2, 0.8))  # type: ignore[misc]
    assert q20 <= q50 <= q80
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(10_000))

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        busy = graph_bench(full)
    finally:
        stop.set()
        thread.join()
    assert busy < 1.25 * t_full, (busy, t_full)


def test_autotune_timing_beside_another_threads_cuda_calls() -> None:
    """A host op of an eager step (ggml's experts, their copies) makes CUDA calls from another thread while a
    kernel met for the first time is tuned: each timing still returns, and the graph timing stays the rule for
    the next ones (a capture another thread's call broke is tried again, then that one candidate is timed by
    Triton's benchmark)."""
    import threading

    from tandem.cuda import autotune

    src = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    stop = threading.Event()

    def host_op() -> None:  # a copy to the device, a product and a copy back, on a stream of its own
        side = torch.cuda.Stream()
        while not stop.is_set():
            with torch.cuda.stream(side):
                torch.ones(1 << 16).to("cuda", non_blocking=True).sum().item()

    thread = threading.Thread(target=host_op)
    thread.start()
    try:
        times = [autotune.graph_bench(lambda: dst.copy_(src)) for _ in range(5)]
    finally:
        stop.set()
        thread.join()
    assert all(isinstance(t, float) and t > 0 for t in times), times
    assert not autotune._fallback
