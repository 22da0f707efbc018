"""The host op's hand-off kernels (cuda/host_copy.py), run on the CPU by Triton's interpreter (CI has no GPU):
the values a host op's buffers receive and give back are exactly torch's casts. On the device,
tests/test_gpu_offload.py runs them over page-locked memory, eager and captured."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is a dev dependency (pip install -e '.[dev]')")
if os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available():
    pytest.skip(
        "the interpreter run is for machines without a GPU; see tests/test_gpu_offload.py", allow_module_level=True
    )

from tandem.cuda.host_copy import BLOCK, from_host, to_host  # noqa: E402


@pytest.mark.parametrize("rows", [1, 3])
def test_to_host_casts_each_input_into_its_buffer(rows: int) -> None:
    """A routed-experts op's three inputs (hidden states in bf16, ids, weights) in one launch: each buffer gets
    its input cast to the buffer's type, bit for bit, and nothing past its end (widths > and < BLOCK)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, BLOCK + 40, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 128, (rows, 8), generator=g, dtype=torch.int32)
    weights = torch.rand(rows, 8, generator=g)
    sentinel = -7.0
    bufs = [torch.full((rows + 1, x.shape[1]), sentinel), torch.full((rows + 1, 8), -7, dtype=torch.int32),
            torch.full((rows + 1, 8), sentinel)]  # fmt: skip
    to_host([x, ids, weights], [b[:rows] for b in bufs])
    assert torch.equal(bufs[0][:rows], x.float())
    assert torch.equal(bufs[1][:rows], ids)
    assert torch.equal(bufs[2][:rows], weights)
    assert all((b[rows:] == sentinel).all() for b in bufs)


def test_to_host_one_input_and_a_strided_one() -> None:
    """One input (a host linear's): the unused pairs write nothing; a strided input is copied as its values."""
    x = torch.randn(4, 6)[:, ::2]
    buf = torch.zeros(4, 3)
    to_host([x], [buf])
    assert torch.equal(buf, x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_from_host_gives_the_result_cast(dtype: torch.dtype) -> None:
    """The result [T, D] f32 back in the model's type, as `.to(dtype)` rounds it; bf16 within one ulp, as the
    interpreter truncates f32 -> bf16 where a GPU rounds to nearest even (exact there: test_gpu_offload.py)."""
    src = torch.randn(2, 3 * BLOCK + 5) * 100
    out = from_host(src, torch.device("cpu"), dtype)
    assert out.dtype == dtype and out.shape == src.shape
    if dtype != torch.bfloat16:
        assert torch.equal(out, src.to(dtype))
        return
    _, e = torch.frexp(src.double())
    assert bool(
        ((out.double() - src.double()).abs() < torch.ldexp(torch.ones_like(e, dtype=torch.double), e - 8)).all()
    )
    assert (out == src.to(dtype)).float().mean() > 0.4  # the truncations that rounding keeps
