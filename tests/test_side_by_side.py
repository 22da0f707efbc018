"""cuda/streams.py side_by_side on the CPU (one after the other, in order) and its host-op guard: a projection
computed on the host is a boundary of the captured decode step and never goes to a side stream."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from qblocks import random_blocks

from tandem.cuda.streams import on_host, side_by_side
from tandem.layers.delta_net import FusedBetaAlpha, SplitBetaAlpha
from tandem.layers.linear import GGMLLinear
from tandem.quant.ggml_cpu import CPUKernels
from tandem.quant.ggml_weights import GGMLWeight
from tandem.weights.offload import HostLinear


def test_on_the_cpu_the_projections_run_in_order() -> None:
    calls: list[str] = []

    def projection(name: str, scale: float):  # type: ignore[no-untyped-def]
        def run(x: torch.Tensor) -> torch.Tensor:
            calls.append(name)
            return x * scale

        return run

    x = torch.randn(1, 8)
    out = side_by_side(x, projection("q", 1.0), projection("k", 2.0), projection("v", 3.0))
    assert calls == ["q", "k", "v"]
    assert all(torch.equal(o, x * s) for o, s in zip(out, (1.0, 2.0, 3.0), strict=True))


def test_host_projections_are_recognised_alone_and_inside_pairs() -> None:
    rng = np.random.default_rng(0)
    weight = GGMLWeight(random_blocks(Q.Q8_0, (8, 32), rng).reshape(-1).copy(), Q.Q8_0, (8, 32))
    host = HostLinear(GGMLLinear(weight, CPUKernels(1)))
    device_like = torch.nn.Identity()  # stands for a GPU linear: no `on_host`
    assert on_host(host) and not on_host(device_like)
    assert on_host(SplitBetaAlpha(beta=device_like, alpha=host))  # type: ignore[arg-type]
    assert not on_host(SplitBetaAlpha(beta=device_like, alpha=device_like))  # type: ignore[arg-type]
    assert on_host(FusedBetaAlpha(proj=host, n_k_heads=2))  # type: ignore[arg-type]
