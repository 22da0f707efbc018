"""The fused one-token delta-net step (cuda/delta_net.py), run on the CPU by Triton's interpreter (CI has no
GPU), against the layer's torch path: both head layouts, shared and unshared key heads, head dims and conv
kernels that are not powers of two, strided beta/alpha, a few steps carrying the state, f32 and bf16."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # on a GPU machine (pytest -m gpu collects this module too) the kernels compile
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

import pytest
from delta_net_refs import HIDDEN, assert_close, make_layer, random_state, set_inputs
from delta_net_refs import step as run_step

from tandem.layers.delta_net import DeltaNetShape

triton = pytest.importorskip("triton", reason="triton is a dev dependency (pip install -e '.[dev]')")
if os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available():
    pytest.skip(
        "the interpreter run is for machines without a GPU; see tests/test_gpu_delta_net.py", allow_module_level=True
    )

from tandem.cuda.delta_net import step_fits  # noqa: E402 (after the skips above)

STEPS = 3
CASES = {  # (shape, Qwen3-Next's fused beta/alpha projection)
    "grouped": (DeltaNetShape(2, 4, 16, 16, 4, "grouped"), False),  # the tiny test models' shape
    "tiled": (DeltaNetShape(2, 4, 16, 16, 4, "tiled"), False),
    "unshared": (DeltaNetShape(3, 3, 16, 16, 4, "tiled"), False),  # Hv == Hk
    "odd-dims": (DeltaNetShape(2, 6, 24, 40, 3, "tiled"), False),  # Dk, Dv, Hv/Hk = 3, K - 1 = 2: masked
    "odd-grouped": (DeltaNetShape(3, 6, 20, 12, 5, "grouped"), False),  # Dk > Dv, K - 1 = 4
    "fused-ba": (DeltaNetShape(2, 2, 16, 16, 4, "grouped"), True),  # beta, alpha: views of stride 2
    "fused-ba-copy": (DeltaNetShape(2, 4, 16, 16, 4, "grouped"), True),
}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", CASES)
def test_fused_step_matches_torch_path(name: str, dtype: torch.dtype) -> None:
    """Step by step from a mid-sequence state: the output (the out projection's input, in the layer's dtype)
    within REL_TOL of the torch path's (plus one ulp in bf16: besides, Triton's interpreter truncates casts to
    bf16 where the GPU rounds to nearest), the recurrent state within REL_TOL, the conv state (a shift of
    copies) bit for bit."""
    shape, fused_ba = CASES[name]
    assert step_fits(shape)
    layer = make_layer(shape, dtype, "cpu", seed=len(name), fused_beta_alpha=fused_ba)
    ref_state = random_state(shape, "cpu", seed=1)
    state = ref_state.snapshot()
    x = torch.zeros(1, HIDDEN, dtype=dtype)  # the projections ignore it
    g = torch.Generator().manual_seed(2)
    for step in range(STEPS):
        set_inputs(layer, g)
        ref = run_step(layer, x, ref_state)  # the sequence's own path: torch
        got = run_step(layer, x, state, pooled=True)  # a pooled decode step: the kernels
        assert got.shape == (1, shape.value_dim) and got.dtype == dtype
        assert torch.equal(state.conv, ref_state.conv), f"step {step}: conv state"
        assert_close(state.ssm, ref_state.ssm, f"step {step}: recurrent state")
        assert_close(got, ref, f"step {step}: output")
    assert ref_state.length == state.length == STEPS


def test_large_heads_do_not_fit() -> None:
    """State tiles beyond one program's registers are left to the torch path (GatedDeltaNet checks step_fits)."""
    assert step_fits(DeltaNetShape(16, 64, 128, 128, 4, "tiled"))  # Qwen3.5-122B
    assert not step_fits(DeltaNetShape(4, 8, 128, 256, 4))
