"""A GPU step of several sequences through a delta-net layer (`GatedDeltaNet._side_by_side`): the one-token
sequences by the pooled decode kernels, the prompt chunks side by side in padded lanes of one chunked rule per
group of lengths. Every sequence's output rows and its slot's new conv and recurrent state equal the same sequence
run alone by the single-sequence torch path (`_rule`: the recurrent rule for one token, the chunked one for more),
and a slot outside the step keeps its state. On the CPU (the decode kernels under Triton's interpreter) and on
CUDA (`pytest -m gpu`, through the layer's own dispatch)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # the decode kernels run under Triton's interpreter (must precede their import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from delta_net_refs import Fixed, assert_close, make_layer  # noqa: E402

from tandem.layers.delta_net import (  # noqa: E402
    DeltaNetPool,
    DeltaNetShape,
    DeltaNetState,
    GatedDeltaNet,
    SplitBetaAlpha,
    _recurrent_spans,
)
from tandem.layers.norm import rms_norm  # noqa: E402
from tandem.state.batch import SeqSpan, StepBatch  # noqa: E402

pytest.importorskip("triton", reason="triton is a dev dependency (pip install -e '.[dev]')")

N_SLOTS = 8
# (slot, tokens): one-token sequences between prompt chunks of 1, 2 and 3 chunks of 64 rows; lanes of one group
# of different lengths (3, 20 and 64 rows: two of them padded); slot 5 is not in the step
STEP = [(6, 3), (2, 1), (0, 70), (7, 64), (4, 1), (1, 130), (3, 20)]
SHAPES = {
    "grouped": DeltaNetShape(2, 4, 16, 16, 4, "grouped"),
    "odd-dims": DeltaNetShape(2, 6, 24, 40, 3, "tiled"),  # Dk != Dv, K - 1 = 2
}
ON_GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run with -m gpu on the device)"),
]
INTERPRETED = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter run is for machines without a GPU; cuda runs on one (-m gpu)"
)
CASES = [
    *(pytest.param("cpu", shape, torch.float32, id=f"cpu-{name}", marks=INTERPRETED) for name, shape in SHAPES.items()),
    *(
        pytest.param("cuda", shape, dtype, id=f"cuda-{name}-{dtype}", marks=ON_GPU)
        for name, shape in SHAPES.items()
        for dtype in (torch.float32, torch.bfloat16)
    ),
]


def _layer(shape: DeltaNetShape, dtype: torch.dtype, device: str, n_rows: int) -> GatedDeltaNet:
    """A layer whose projections return random rows [n_rows, N] in `dtype` (the out projection: identity)."""
    layer = make_layer(shape, dtype, device, seed=3)
    g = torch.Generator().manual_seed(4)

    def rows(n: int) -> Fixed:
        return Fixed((torch.randn(n_rows, n, generator=g) * 2.0).to(dtype).to(device))

    layer.qkv, layer.gate = rows(shape.conv_channels), rows(shape.value_dim)
    layer.beta_alpha = SplitBetaAlpha(beta=rows(shape.n_v_heads), alpha=rows(shape.n_v_heads))
    return layer


def _pool(shape: DeltaNetShape, device: str) -> DeltaNetPool:
    """N_SLOTS mid-sequence states, the recurrent ones contiguous [N, Hv, Dk, Dv] as a GPU's pool holds them."""
    g = torch.Generator().manual_seed(5)
    conv = torch.randn(N_SLOTS, shape.conv_kernel - 1, shape.conv_channels, generator=g).to(device)
    ssm = torch.randn(N_SLOTS, shape.n_v_heads, shape.head_k_dim, shape.head_v_dim, generator=g).to(device)
    pool = DeltaNetPool(conv, ssm, [DeltaNetState(conv[i], ssm[i]) for i in range(N_SLOTS)])
    for i, state in enumerate(pool.slots):
        state.length = 10 + i
    return pool


@pytest.mark.parametrize(("device", "shape", "dtype"), CASES)
def test_sequences_side_by_side_equal_each_alone(device: str, shape: DeltaNetShape, dtype: torch.dtype) -> None:
    spans, offset = [], 0
    for slot, n in STEP:
        spans.append(SeqSpan(slot, 10 + slot, n, offset))
        offset += n
    layer, pool = _layer(shape, dtype, device, offset), _pool(shape, device)
    x = torch.zeros(offset, 8, dtype=dtype, device=device)
    positions = torch.cat([torch.arange(p.start, p.start + p.n) for p in spans]).to(device)
    batch = StepBatch(ids=torch.zeros(offset, dtype=torch.long), positions=positions, spans=tuple(spans), decode=False)
    conv, ssm = pool.conv.clone(), pool.ssm.clone()

    if device == "cuda":
        out = layer(x, batch, pool)  # the layer's own dispatch to `_side_by_side`
    else:
        qkv = layer.qkv(x)
        out = layer._side_by_side(x, qkv, *layer.beta_alpha(x), batch, pool)
    recurrent = _recurrent_spans(batch, layer.chunk_size, by_row=True)
    assert recurrent.by_row is not None and len(recurrent.groups) == 3, "one-token rows and three groups of lanes"
    assert [g.length for g in recurrent.groups] == [64, 70, 130]

    z = layer.gate(x)
    b, a = layer.beta_alpha(x)
    qkv = layer.qkv(x)
    for p in spans:
        alone = DeltaNetState(conv[p.slot], ssm[p.slot])  # views: the rule updates the copies
        o = layer._rule(qkv[p.rows], b[p.rows], a[p.rows], alone, p.n)
        gate = z[p.rows].view(p.n, shape.n_v_heads, shape.head_v_dim).float()
        ref = (rms_norm(o, layer.norm, layer.eps) * F.silu(gate)).flatten(1).to(dtype)
        assert_close(out[p.rows], ref, f"slot {p.slot} ({p.n} tokens): output")
        assert_close(pool.conv[p.slot], conv[p.slot], f"slot {p.slot}: conv state")
        assert_close(pool.ssm[p.slot], ssm[p.slot], f"slot {p.slot}: recurrent state")
    assert torch.equal(pool.conv[5], conv[5]) and torch.equal(pool.ssm[5], ssm[5]), "slot 5 is not in the step"
