"""The fused one-token delta-net step (cuda/delta_net.py) for a batch of sequences whose states lie in a slot pool:
each row's output, and its slot's new state, equal the same row stepped alone on a copy of that slot's state bit for
bit (the single-sequence path, which tests/test_delta_net_interpret.py and tests/test_gpu_delta_net.py hold to the
torch path); a padding row (slot -1) outputs zeros, and it and the slots outside the batch leave the pool untouched.
On the CPU under Triton's interpreter (CI has no GPU), and on CUDA (`pytest -m gpu`), there also captured in a CUDA
graph that is replayed with new slots."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # with a GPU the kernels compile: this module's gpu tests need them so
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

from delta_net_refs import make_layer  # noqa: E402

from tandem.layers.delta_net import DeltaNetShape, GatedDeltaNet  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is a dev dependency (pip install -e '.[dev]')")

from tandem.cuda.delta_net import gated_delta_step  # noqa: E402 (after the skip above)

N_SLOTS = 4
SLOTS = [2, 0, -1, 3]  # slot 1 is not in the batch; a padding row between the others
CASES = {  # Hv > Hk in each
    "grouped": DeltaNetShape(2, 4, 16, 16, 4, "grouped"),
    "tiled": DeltaNetShape(2, 4, 16, 16, 4, "tiled"),
    "odd-dims": DeltaNetShape(2, 6, 24, 40, 3, "tiled"),  # masked tiles, K - 1 = 2
}
REAL = DeltaNetShape(16, 32, 128, 128, 4, "tiled")  # Qwen3.5/3.6-35B-A3B: too slow for the interpreter
DTYPES = [torch.float32, torch.bfloat16]

_INTERPRETED = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
    reason="the interpreter run is for machines without a GPU; the cuda cases run on one (-m gpu)",
)
_ON_GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run with -m gpu on the device)"),
]
CPU_CASES = [pytest.param("cpu", shape, id=f"cpu-{name}", marks=_INTERPRETED) for name, shape in CASES.items()]
GPU_CASES = [
    pytest.param("cuda", shape, id=f"cuda-{name}", marks=_ON_GPU) for name, shape in [*CASES.items(), ("real", REAL)]
]


class Step:
    """One batched step's arguments on `device`: B = len(SLOTS) rows of random projection outputs in `dtype`
    (qkv and z rows strided: views of wider buffers; b and alpha interleaved, as Qwen3-Next's fused projection
    gives them), a layer's weights, and a pool of N_SLOTS distinct mid-sequence states. The pools are views past a
    guard slot (a padding row that wrote state through slot -1 would change it)."""

    def __init__(self, shape: DeltaNetShape, dtype: torch.dtype, device: str, seed: int) -> None:
        self.shape, self.dtype = shape, dtype
        self.layer: GatedDeltaNet = make_layer(shape, dtype, device, seed=seed)  # its weights; projections unused
        s, n = shape, len(SLOTS)
        self.qkv = torch.empty(n, s.conv_channels + 3, dtype=dtype, device=device)[:, : s.conv_channels]
        self.z = torch.empty(n, s.value_dim + 5, dtype=dtype, device=device)[:, : s.value_dim]
        ba = torch.empty(n, s.n_v_heads, 2, dtype=dtype, device=device)
        self.b, self.alpha = ba[..., 0], ba[..., 1]
        self.slots = torch.tensor(SLOTS, device=device)
        self.guarded_conv = torch.empty(1 + N_SLOTS, s.conv_kernel - 1, s.conv_channels, device=device)
        self.guarded_ssm = torch.empty(1 + N_SLOTS, s.n_v_heads, s.head_k_dim, s.head_v_dim, device=device)
        self.conv, self.ssm = self.guarded_conv[1:], self.guarded_ssm[1:]  # contiguous still
        self.randomize(torch.Generator().manual_seed(seed + 1))

    def randomize(self, g: torch.Generator) -> None:
        """New inputs and states, written in place (a captured graph reads these tensors)."""
        for x in (self.qkv, self.z, self.b, self.alpha, self.guarded_conv, self.guarded_ssm):
            x.copy_(torch.randn(x.shape, generator=g) * 2.0)

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the pools with their guard: slot s at index s + 1, the guard at slot -1's."""
        return self.guarded_conv.clone(), self.guarded_ssm.clone()

    def __call__(self, rows: slice, conv: torch.Tensor, ssm: torch.Tensor, slots: torch.Tensor | None) -> torch.Tensor:
        """The step of these rows on these states (pools with slots, else one sequence's)."""
        layer = self.layer
        return gated_delta_step(
            self.qkv[rows], self.z[rows], self.b[rows], self.alpha[rows], conv, ssm, layer.conv_weight,
            layer.dt_bias, layer.a, layer.norm, self.shape, layer.eps, self.dtype, slots,
        )  # fmt: skip


def check_batch(step: Step, out: torch.Tensor, before: tuple[torch.Tensor, torch.Tensor], slots: list[int]) -> None:
    """`out` and the pool after the batched step (`before` it: Step.snapshot) against each row stepped alone;
    the slots outside the batch and the guard as they were."""
    assert out.shape == (len(slots), step.shape.value_dim) and out.dtype == step.dtype
    conv, ssm = step.guarded_conv, step.guarded_ssm
    for row, slot in enumerate(slots):
        if slot < 0:
            assert torch.equal(out[row], torch.zeros_like(out[row])), f"padding row {row}: output not zeros"
            continue
        conv_alone, ssm_alone = before[0][slot + 1].clone(), before[1][slot + 1].clone()
        alone = step(slice(row, row + 1), conv_alone, ssm_alone, None)
        assert torch.equal(out[row : row + 1], alone), f"row {row} (slot {slot}): output"
        assert torch.equal(conv[slot + 1], conv_alone), f"row {row} (slot {slot}): conv state"
        assert torch.equal(ssm[slot + 1], ssm_alone), f"row {row} (slot {slot}): recurrent state"
        assert not torch.equal(ssm_alone, before[1][slot + 1]), f"row {row}: the step left its state as it was"
    for slot in sorted({-1, *range(N_SLOTS)} - {s for s in slots if s >= 0}):  # -1: the guard
        assert torch.equal(conv[slot + 1], before[0][slot + 1]), f"slot {slot}: conv state changed"
        assert torch.equal(ssm[slot + 1], before[1][slot + 1]), f"slot {slot}: recurrent state changed"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("device", "shape"), CPU_CASES + GPU_CASES)
def test_batch_rows_equal_rows_alone(device: str, shape: DeltaNetShape, dtype: torch.dtype) -> None:
    """One batched step over the pool, each row and its slot against the single-sequence step."""
    step = Step(shape, dtype, device, seed=shape.head_v_dim)
    before = step.snapshot()
    out = step(slice(None), step.conv, step.ssm, step.slots)
    check_batch(step, out, before, SLOTS)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [CASES["odd-dims"], REAL], ids=["odd-dims", "real"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run with -m gpu on the device)")
def test_batch_in_cuda_graph(shape: DeltaNetShape, dtype: torch.dtype) -> None:
    """Captured once, replayed with new inputs, states and slots written in place (the slots read on the device
    at each replay): each replay equals the rows stepped alone, as in the eager batch."""
    step = Step(shape, dtype, "cuda", seed=7)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture, on a copy of the pool
        step(slice(None), step.conv.clone(), step.ssm.clone(), step.slots)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    before = step.snapshot()
    with torch.cuda.graph(graph):
        out = step(slice(None), step.conv, step.ssm, step.slots)
    assert all(map(torch.equal, before, step.snapshot())), "capturing ran the step"
    g = torch.Generator().manual_seed(8)
    for slots in (SLOTS, [1, -1, 3, 0], [-1, 2, 1, -1]):
        step.randomize(g)
        step.slots.copy_(torch.tensor(slots))
        before = step.snapshot()
        graph.replay()
        check_batch(step, out, before, slots)
