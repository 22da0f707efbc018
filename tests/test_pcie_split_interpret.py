"""--pcie-experts on the CPU: the experts the GPU computes in place of ggml's (built by the loader over the host
blocks, their kernels run by Triton's interpreter) must give ggml's values, so that a token's experts split
between ggml and them mix to what ggml alone gives. The GPU test (test_gpu_offload.py) checks the logits."""

from __future__ import annotations

import ctypes
import os
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():  # on a GPU machine (pytest -m gpu collects this module too) the kernels compile
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

from pathlib import Path

import gguf
import numpy as np
import pytest
from loader_builds import record_builds
from qblocks import random_blocks

pytest.importorskip("triton", reason="triton is a dev dependency (pip install -e '.[dev]')")
if os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available():
    pytest.skip(
        "the interpreter run is for machines without a GPU; see tests/test_gpu_offload.py", allow_module_level=True
    )

import tandem
from tandem.convert import convert_hf
from tandem.cuda.qlinear import ggml_rounded_input
from tandem.layers.moe import GLUExperts, Routing
from tandem.placement import expert_layer
from tandem.quant.ggml_cpu import CPUKernels
from tandem.quant.ggml_weights import GGMLWeight
from tandem.weights.loader import _PCIeSource
from tandem.weights.offload import OffloadedExperts

TYPES = [gguf.GGMLQuantizationType[n] for n in ("Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K")]


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_rounded_inputs_give_ggml_products(qtype: gguf.GGMLQuantizationType, kernels: CPUKernels) -> None:
    """ggml rounds a product's input to Q8_0 or Q8_K blocks first: dequantized blocks times the input rounded
    the same way are ggml's product to f32 rounding; times the input as it is, ~1% away."""
    rng = np.random.default_rng(int(qtype))
    e, n, k = 3, 16, 512
    raw = random_blocks(qtype, (e, n, k), rng)
    w = torch.from_numpy(np.stack([gguf.quants.dequantize(raw[i], qtype) for i in range(e)])).double()
    x = torch.randn(4, k) * torch.rand(4, k) * 3
    ids = torch.tensor([[0, 2], [1, 1], [2, 0], [1, 2]], dtype=torch.int32)
    ggml = kernels.mul_mat_id(x, GGMLWeight(raw, qtype, (e, n, k)), ids)
    product = lambda xs: torch.einsum("tk,tank->tan", xs.double(), w[ids.long()])  # noqa: E731
    assert _rel(product(ggml_rounded_input(x, qtype)), ggml) < 1e-6
    assert _rel(product(x), ggml) > 1e-3


@pytest.mark.parametrize("fixture", ["tiny_qwen35moe_gguf", "tiny_gemma4_gguf", "tiny_gpt_oss_gguf"])
def test_pcie_experts_give_ggml_values(
    fixture: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each layer's experts as the loader builds them for --pcie-experts (over the host blocks, here without a
    GPU: the device views are the blocks themselves) computing the last of each token's experts, ggml the
    others: the mix is ggml's alone to f32 rounding. Before their inputs were rounded as ggml's and Gemma 4's
    GEGLU read ggml's table, one expert of two was ~1% away (logits 0.02 to 1.3 off on an H200)."""
    import tandem.cuda.host_memory as host_memory

    path = convert_hf(request.getfixturevalue(fixture)[0], tmp_path / "q8_0.gguf", "q8_0")
    builds = record_builds(monkeypatch)
    monkeypatch.setattr(host_memory, "device_view", lambda host, device: host)
    with tandem.LLM(path, device="cpu", n_ctx=32):
        assert builds
        for loader, _, build in builds:
            on_cpu = build(loader)  # ggml's graph on the file's blocks, as the CPU side of the split
            pcie = loader._ggml_valued(build(_PCIeSource(loader)))
            assert isinstance(on_cpu, GLUExperts) and isinstance(pcie, GLUExperts)
            n_experts, width = on_cpu.down.weight.shape[:2]  # type: ignore[attr-defined]
            gen = torch.Generator().manual_seed(len(builds))
            x = torch.randn(6, width, generator=gen)
            ids = torch.stack([torch.randperm(n_experts, generator=gen)[:2] for _ in range(6)]).to(torch.int32)
            weights = torch.softmax(torch.randn(6, 2, generator=gen), dim=-1)
            alone = on_cpu(x, Routing(ids, weights))
            split = on_cpu(x, Routing(ids[:, :1].contiguous(), weights[:, :1].contiguous()))
            split += pcie(x, Routing(ids[:, 1:], weights[:, 1:]))
            assert _rel(split, alone) < 1e-5


class _MemmoveCopies:
    """HostCopies on the CPU: the staging copies done at once (host and \"device\" memory are one)."""

    def enqueue(self, dst: int, src: int, n_bytes: int) -> None:
        ctypes.memmove(dst, src, n_bytes)

    def wait(self) -> None:
        pass


@pytest.mark.parametrize("fixture", ["tiny_qwen35moe_gguf", "tiny_gpt_oss_gguf"])
def test_staged_experts_mix_to_ggml_alone(
    fixture: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--pcie-experts in a batch (weights/offload.py ExpertStaging): the host part picks the step's most-used
    experts, copies their blocks into window slots and has ggml compute the other slots; the experts built over
    the window compute the staged ones. The two parts mix to ggml alone, on the prepared buffers of a captured
    step and eagerly; gpt-oss's expert biases are staged with their matrices."""
    import tandem.cuda.host_memory as host_memory

    path = convert_hf(request.getfixturevalue(fixture)[0], tmp_path / "q8_0.gguf", "q8_0")
    builds = record_builds(monkeypatch)
    monkeypatch.setattr(host_memory, "pinned_empty", lambda shape, dtype: torch.empty(shape, dtype=dtype))
    with tandem.LLM(path, device="cpu", n_ctx=32):
        assert builds
        for loader, layer, build in builds[:1]:  # the layers are alike (the interpreter is slow)
            infos = [i for n, i in loader.file.tensors.items() if expert_layer(n) == layer]
            slot_bytes = max(i.n_bytes for i in infos)  # a window of two experts' stacks: room for all of them
            window = SimpleNamespace(slot_bytes=slot_bytes, window=torch.zeros(2 * slot_bytes, dtype=torch.uint8))
            loader._copies, loader.pcie_experts = _MemmoveCopies(), 1
            made = loader._staged_experts(build, infos, window)
            assert made is not None
            staged, staging = made
            on_cpu = build(loader)
            offloaded = OffloadedExperts(on_cpu=on_cpu, streamed=None, stage_vectors=None, min_batch=33,
                                         pcie=staged, pcie_slots=1, staged=staged, staging=staging)  # fmt: skip
            assert offloaded.host_staged is not None
            n_experts, width = on_cpu.down.weight.shape[:2]  # type: ignore[attr-defined]
            gen = torch.Generator().manual_seed(layer)
            rows = 16
            x, ids, weights = torch.empty(rows, width), torch.empty(rows, 2, dtype=torch.int32), torch.empty(rows, 2)
            out = torch.empty(rows, width)
            bound = offloaded._bind_staged([x, ids, weights], out)  # the captured step's host part
            assert bound is not None
            for n in (5, 16):  # fewer rows: the eager host part, prepared per call
                x[:] = torch.randn(rows, width, generator=gen)
                ids[:] = torch.stack([torch.randperm(n_experts, generator=gen)[:2] for _ in range(rows)])
                ids[0] = ids[1]  # two rows alike: the most-used experts are shared
                weights[:] = torch.softmax(torch.randn(rows, 2, generator=gen), dim=-1)
                xs = [x[:n], ids[:n], weights[:n]]
                alone = on_cpu(xs[0], Routing(xs[1], xs[2]))
                before = staging.staged_total
                if n == rows:
                    bound()
                    cpu_part = out.clone()
                else:
                    cpu_part = offloaded._staged_cpu(xs)
                assert staging.staged_total > before
                slots = staging.slot_map[xs[1].long()]  # the host part wrote the step's slot map
                gpu_part = staged(xs[0], Routing(slots, torch.where(slots >= 0, xs[2], 0.0)))
                assert _rel(cpu_part + gpu_part, alone) < 1e-5, (n, _rel(cpu_part + gpu_part, alone))
                assert _rel(cpu_part, alone) > 1e-3  # each side computed a real part


def test_pcie_geglu_reads_ggml_table() -> None:
    """The experts' GEGLU for a quantized Gemma file reads ggml's f16 GELU table on any device: `gelu_tanh_ggml`
    does so on the CPU only, and on a GPU (the formula) it is up to ~1e-3 away, which the test above cannot see
    without one."""
    import torch.nn.functional as F

    from tandem.layers.activations import Gated, activation, swiglu_oai
    from tandem.layers.moe import GGMLValuedGLU

    gate, up = torch.randn(64, 256) * 4, torch.randn(64, 256)
    glu = GGMLValuedGLU(Gated(activation("gelu_tanh_ggml")), torch.device("cpu"))
    assert glu.ggml == "geglu"
    assert torch.equal(glu(gate, up), activation("gelu_tanh_ggml")(gate) * up)  # ggml's values (the CPU path)
    assert (glu(gate, up) - F.gelu(gate, approximate="tanh") * up).abs().max() > 1e-4  # not the formula's
    oai = GGMLValuedGLU(swiglu_oai, torch.device("cpu"))
    assert torch.equal(oai(gate, up), swiglu_oai(gate, up)) and oai.ggml_params == swiglu_oai.ggml_params
