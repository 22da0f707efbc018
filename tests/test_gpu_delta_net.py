"""The fused one-token delta-net step on the device (`pytest -m gpu`): `GatedDeltaNet` on CUDA (two Triton
kernels, cuda/delta_net.py) against the same layer's torch path on the CPU at the real models' shapes, and
the step captured in a CUDA graph: a replay gives what the eager step gives and advances the live state."""

from __future__ import annotations

import pytest
import torch
from delta_net_refs import HIDDEN, assert_close, layer_to, make_layer, random_state, set_inputs
from delta_net_refs import step as run_step

from tandem.layers.delta_net import DeltaNetShape, GatedDeltaNet

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run with -m gpu on the device)"),
]

STEPS = 4
CASES = {  # (shape, Qwen3-Next's fused beta/alpha projection)
    "qwen36-35b": (DeltaNetShape(16, 32, 128, 128, 4, "tiled"), False),  # Qwen3.5/3.6-35B-A3B
    "qwen35-122b": (DeltaNetShape(16, 64, 128, 128, 4, "tiled"), False),
    "qwen3next": (DeltaNetShape(16, 32, 128, 128, 4, "grouped"), True),
    "odd-dims": (DeltaNetShape(3, 6, 96, 80, 3, "grouped"), False),  # masked tiles, K - 1 = 2
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the layer's calls of the fused step (the test fails if the torch path ran instead)."""
    calls: list[int] = []
    fused = GatedDeltaNet._fused_step

    def counted(self: GatedDeltaNet, *args: object) -> torch.Tensor:
        calls.append(1)
        return fused(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(GatedDeltaNet, "_fused_step", counted)
    return calls


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", CASES)
def test_step_matches_torch_path(name: str, dtype: torch.dtype, fused_calls: list[int]) -> None:
    """Steps from a mid-sequence state: output and recurrent state within REL_TOL of the CPU torch path (plus
    one ulp of a 16-bit output), the conv state bit for bit."""
    shape, fused_ba = CASES[name]
    layer = make_layer(shape, dtype, "cuda", seed=len(name), fused_beta_alpha=fused_ba)
    state = random_state(shape, "cuda", seed=1)
    ref_state = random_state(shape, "cpu", seed=1)
    x = torch.zeros(1, HIDDEN, dtype=dtype, device="cuda")
    g = torch.Generator().manual_seed(2)
    for step in range(STEPS):
        set_inputs(layer, g)
        got = run_step(layer, x, state, pooled=True)
        ref = run_step(layer_to(layer, "cpu"), x.cpu(), ref_state)
        assert got.shape == (1, shape.value_dim) and got.dtype == dtype
        assert torch.equal(state.conv.cpu(), ref_state.conv), f"step {step}: conv state"
        assert_close(state.ssm, ref_state.ssm, f"step {step}: recurrent state")
        assert_close(got, ref, f"step {step}: output")
    assert len(fused_calls) == STEPS and state.length == ref_state.length == STEPS


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_step_in_cuda_graph(dtype: torch.dtype, fused_calls: list[int]) -> None:
    """Captured once (a pooled decode step, as the runner's graphs record it), replayed with new
    projection outputs written in place: each replay gives the eager step's output and state bit for bit, and
    the replayed state follows the CPU torch path."""
    shape, _ = CASES["qwen36-35b"]
    layer = make_layer(shape, dtype, "cuda", seed=3)
    state = random_state(shape, "cuda", seed=4)
    eager_state = state.snapshot()
    ref_state = random_state(shape, "cpu", seed=4)
    x = torch.zeros(1, HIDDEN, dtype=dtype, device="cuda")
    g = torch.Generator().manual_seed(5)
    set_inputs(layer, g)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture, on a copy of the state
        scratch = state.snapshot()
        run_step(layer, x, scratch, pooled=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_step(layer, x, state, pooled=True)
    state.length = 0
    assert torch.equal(state.ssm, eager_state.ssm), "capturing ran the step"
    for step in range(STEPS):
        set_inputs(layer, g)
        before = state.ssm.clone()
        graph.replay()
        eager = run_step(layer, x, eager_state, pooled=True)
        ref = run_step(layer_to(layer, "cpu"), x.cpu(), ref_state)
        assert not torch.equal(state.ssm, before), f"step {step}: the replay left the state as it was"
        assert torch.equal(out, eager), f"step {step}: replayed output"
        assert torch.equal(state.ssm, eager_state.ssm) and torch.equal(state.conv, eager_state.conv), step
        assert_close(state.ssm, ref_state.ssm, f"step {step}: replayed recurrent state")
        assert_close(out, ref, f"step {step}: replayed output against the torch path")
    assert state.length == 0 and eager_state.length == STEPS  # the replay counts nothing (the runner does)
    assert len(fused_calls) == 2 + STEPS  # warm-up, capture, eager steps: never the torch path
