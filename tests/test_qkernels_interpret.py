"""The GPU kernels, run on the CPU by Triton's interpreter (CI has no GPU): every native block format,
plain products (GEMV and dequantize + GEMM paths) and selected-experts products (GEMV and grouped GEMM),
against float64 products with gguf's own dequantization."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

import gguf
import numpy as np
import pytest
import torch
from qblocks import random_blocks

triton = pytest.importorskip("triton", reason="triton is a dev dependency (pip install -e '.[dev]')")
if os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available():
    pytest.skip("the interpreter run is for machines without a GPU; see tests/test_gpu.py", allow_module_level=True)

from tandem.cuda.qlinear import GPUQuantWeight, qmatmul, qmatmul_id

TYPES = [gguf.GGMLQuantizationType[n] for n in ("Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K")]
# f32 products of f32-exact dequantized values: only summation order differs from float64.
REL_TOL = 1e-5


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_plain_products(qtype: gguf.GGMLQuantizationType) -> None:
    rng = np.random.default_rng(int(qtype))
    n, k = 24, 512 + (32 if qtype in (TYPES[0], TYPES[1], TYPES[2]) else 0)  # a K that is no multiple of 256
    raw = random_blocks(qtype, (n, k), rng)
    ref_w = torch.from_numpy(gguf.quants.dequantize(raw, qtype)).double()
    w = GPUQuantWeight(torch.from_numpy(raw.reshape(-1).copy()), qtype, (n, k))
    for m in (1, 3, 20):  # 20 rows take the dequantize + GEMM path
        x = torch.randn(m, k)
        assert _rel(qmatmul(x, w, ieee=True), x.double() @ ref_w.T) < REL_TOL, m


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
            assert _rel(qmatmul_id(x, w, ids, ieee=True), ref) < REL_TOL, (t, a, x.dim())
