"""Decode attention on the GPU (run on the device: `pytest -m gpu`): the Triton kernels of a decode step's
attention (`decode_attention`, which `attend_step` calls) for one query token, against the float path of
`attend` on the CPU, eagerly and replayed in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from tandem.cuda.decode_attention import decode_attention
from tandem.layers.attention import AttentionShape, attend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run with -m gpu on the device)"),
]

N_KEYS = 4096
POSITIONS = (0, 1, 63, 777, 1500, 4095)
SHAPES = {  # (shape, with sinks)
    "gqa4": (AttentionShape(16, 4, 128, 128, 128**-0.5, None), False),
    "window-softcap-sinks": (AttentionShape(8, 2, 64, 64, 0.125, sliding_window=1024, softcap=30.0), True),
    "d512": (AttentionShape(8, 1, 512, 512, 512**-0.5, None), False),  # Gemma 4 global layers' width
    "d80-dv96": (AttentionShape(12, 2, 80, 96, 80**-0.5, sliding_window=512), True),
}
DTYPES = {  # (query, cache)
    "bf16": (torch.bfloat16, torch.bfloat16),
    "bf16-f16": (torch.bfloat16, torch.float16),
    "f32-bf16": (torch.float32, torch.bfloat16),
    "f32": (torch.float32, torch.float32),
}


def _inputs(s: AttentionShape, with_sinks: bool, q_dtype: torch.dtype, cache_dtype: torch.dtype):
    g = torch.Generator().manual_seed(s.head_dim + s.n_heads)
    q = torch.randn(1, s.n_heads, s.head_dim, generator=g).to(q_dtype).cuda()
    keys = torch.randn(N_KEYS, s.n_kv_heads, s.head_dim, generator=g).to(cache_dtype).cuda()
    values = torch.randn(N_KEYS, s.n_kv_heads, s.value_dim, generator=g).to(cache_dtype).cuda()
    sinks = (torch.randn(s.n_heads, generator=g) * 2).cuda() if with_sinks else None
    return q, keys, values, sinks


def _decode(q, keys, values, positions: torch.Tensor, s: AttentionShape, sinks: torch.Tensor | None):
    return decode_attention(q, keys, values, positions, s.scale, s.sliding_window, s.softcap, sinks)


def _check(y: torch.Tensor, q, keys, values, p: int, s: AttentionShape, sinks: torch.Tensor | None) -> None:
    """Against `attend`'s float path (f32 on the CPU, on exact float64 copies of the inputs): f32 output to
    1e-5, 16-bit output within one unit in the last place in norm (see test_decode_attention_interpret)."""
    ref = attend(
        q.double().cpu(), keys.double().cpu(), values.double().cpu(), torch.tensor([p]), s,
        None if sinks is None else sinks.cpu(),
    )  # fmt: skip
    rel = ((y.double().cpu() - ref).norm() / ref.norm()).item()
    assert rel < (1e-5 if y.dtype == torch.float32 else torch.finfo(y.dtype).eps), (p, rel)


@pytest.mark.parametrize("dtypes", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("name", SHAPES)
def test_decode_matches_reference(name: str, dtypes: tuple[torch.dtype, torch.dtype]) -> None:
    s, with_sinks = SHAPES[name]
    q, keys, values, sinks = _inputs(s, with_sinks, *dtypes)
    for p in POSITIONS:
        y = _decode(q, keys, values, torch.tensor([p], device="cuda"), s, sinks)
        assert y.shape == (1, s.n_heads, s.value_dim) and y.dtype == q.dtype
        _check(y, q, keys, values, p, s, sinks)


@pytest.mark.parametrize("name", SHAPES)
def test_captured_decode_follows_positions(name: str) -> None:
    """Captured once, replayed at every position after changing `positions` in place (as CapturedStep does)."""
    s, with_sinks = SHAPES[name]
    q, keys, values, sinks = _inputs(s, with_sinks, torch.bfloat16, torch.bfloat16)
    positions = torch.zeros(1, dtype=torch.long, device="cuda")
    _decode(q, keys, values, positions, s, sinks)  # compiles the kernels before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = _decode(q, keys, values, positions, s, sinks)
    for p in reversed(POSITIONS):
        positions.fill_(p)
        graph.replay()
        _check(y, q, keys, values, p, s, sinks)
