"""The decode kernels on the GPU (run on the device: `pytest -m gpu`): the fused routing against torch's
routing and from a CUDA graph, and the GEMV with 16-bit activations (read in pairs of values)."""

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
        ids, weights = ids.cpu(), weights.cpu()
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
