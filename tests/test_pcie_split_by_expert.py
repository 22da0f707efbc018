"""--pcie-experts in a batch: the split by expert (weights/offload.py `split_by_expert`) gives each side only its
own experts to read, and the two sides' mixes add to the whole. Plain torch, on any machine; the GPU tests
(test_gpu_offload.py) run it inside the captured step."""

from __future__ import annotations

import pytest
import torch

from tandem.layers.moe import Routing
from tandem.weights.offload import pcie_side, split_by_expert


def _mix(x: torch.Tensor, w: torch.Tensor, r: Routing) -> torch.Tensor:
    """sum over a token's slots of weight * W[expert] x: a stand-in for the routed experts."""
    return torch.einsum("ta,taed,td->te", r.weights.double(), w[r.ids.long()], x)


@pytest.mark.parametrize(("n_experts", "n_active", "k"), [(128, 8, 3), (32, 4, 1), (64, 8, 7), (8, 2, 1)])
def test_split_by_expert(n_experts: int, n_active: int, k: int) -> None:
    g = torch.Generator().manual_seed(n_experts + k)
    t, d = 16, 5
    ids = torch.stack([torch.randperm(n_experts, generator=g)[:n_active] for _ in range(t)]).to(torch.int32)
    every = torch.arange(n_experts)
    ids[0] = every[~pcie_side(every, k, n_active)][:n_active]  # a token with CPU-side experts only
    weights = torch.rand(t, n_active, generator=g)
    routing = Routing(ids=ids, weights=weights)
    cpu, gpu = split_by_expert(routing, k)
    assert cpu.ids.shape == gpu.ids.shape == ids.shape and cpu.ids.dtype == ids.dtype
    # Each side names only experts it computes: its own, its fillers among them.
    assert not pcie_side(cpu.ids, k, n_active).any() and pcie_side(gpu.ids, k, n_active).all()
    # Every slot's weight is on exactly the side of its expert; fillers weigh 0.
    on_gpu = pcie_side(ids, k, n_active)
    assert torch.equal(torch.where(on_gpu, gpu.weights, cpu.weights), weights)
    assert torch.equal(torch.where(on_gpu, cpu.weights, gpu.weights), torch.zeros_like(weights))
    assert (gpu.weights[0] == 0).all()  # token 0 has no GPU-side expert: its GPU row is all filler
    # The GPU takes k / n_active of the experts, evenly spread.
    assert int(pcie_side(every, k, n_active).sum()) == n_experts * k // n_active
    w = torch.randn(n_experts, d, d, generator=g, dtype=torch.float64)
    x = torch.randn(t, d, generator=g, dtype=torch.float64)
    assert torch.allclose(_mix(x, w, cpu) + _mix(x, w, gpu), _mix(x, w, routing), rtol=1e-12, atol=1e-12)
