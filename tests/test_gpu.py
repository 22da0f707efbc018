"""GPU path (run on the device: `pytest -m gpu`): kernels, placements, and the VRAM guarantee."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from qblocks import random_blocks

import tandem
from tandem.placement import expert_layer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run with -m gpu on the device)"),
]

NATIVE = [gguf.GGMLQuantizationType[n] for n in ("Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K")]


@pytest.mark.parametrize("qtype", NATIVE, ids=lambda q: q.name)
def test_kernels_match_dequantized_reference(qtype: gguf.GGMLQuantizationType) -> None:
    from tandem.cuda.qlinear import GPUQuantWeight, qmatmul, qmatmul_id

    rng = np.random.default_rng(int(qtype))
    n, k, e = 300, 1024 + 256, 6
    raw = random_blocks(qtype, (e, n, k), rng)
    ref_w = torch.from_numpy(np.stack([gguf.quants.dequantize(raw[i], qtype) for i in range(e)])).double()
    w = GPUQuantWeight(torch.from_numpy(raw.reshape(-1).copy()).cuda(), qtype, (e, n, k))
    w0 = GPUQuantWeight(w.data[: w.expert_bytes], qtype, (n, k))
    for m in (1, 5, 200):
        x = torch.randn(m, k, device="cuda")
        ref = x.double().cpu() @ ref_w[0].T
        for ieee, tol in ((True, 1e-5), (False, 1e-2)):
            y = qmatmul(x, w0, ieee=ieee).double().cpu()
            assert ((y - ref).norm() / ref.norm()).item() < tol, (m, ieee)
    for t, a in ((1, 4), (3, 2), (50, 4)):
        ids = torch.randint(0, e, (t, a), device="cuda")
        x = torch.randn(t, a, k, device="cuda")
        ref = torch.einsum("tak,tank->tan", x.double().cpu(), ref_w[ids.cpu()])
        y = qmatmul_id(x, w, ids, ieee=True).double().cpu()
        assert ((y - ref).norm() / ref.norm()).item() < 1e-5, (t, a)


PLACEMENTS = {
    "cpu": {"device": "cpu"},
    "all-gpu": {"device": "cuda"},
    "cpu-moe": {"device": "cuda", "cpu_moe": True},
    "n-cpu-moe-1": {"device": "cuda", "n_cpu_moe": 1},
}


def _greedy(path: Path, prompt: list[int], **flags: object) -> list[int]:
    with tandem.LLM(path, cache_type="f32", dtype="f32", threads=4, n_ctx=512, **flags) as llm:
        return llm.generate_ids(prompt, max_tokens=16, temperature=0)


@pytest.mark.parametrize("prompt_len", [5, 40])  # 40 >= 32: prefill streams CPU experts to the GPU
def test_greedy_tokens_identical_across_placements(tiny_qwen3moe_gguf: tuple[Path, Path], prompt_len: int) -> None:
    path = tiny_qwen3moe_gguf[1]
    prompt = torch.randint(4, 500, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    results = {name: _greedy(path, prompt, **flags) for name, flags in PLACEMENTS.items()}
    assert all(r == results["cpu"] for r in results.values()), results


@pytest.mark.parametrize("fixture", ["tiny_qwen3_gguf", "tiny_gemma3_gguf"])
def test_dense_models_greedy_identical_on_gpu(fixture: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(fixture)[1]
    prompt = list(range(10, 50))
    assert _greedy(path, prompt, device="cuda") == _greedy(path, prompt, device="cpu")


def test_bf16_logits_close_across_placements(tiny_qwen3moe_gguf: tuple[Path, Path]) -> None:
    path = tiny_qwen3moe_gguf[1]
    ids = list(range(5, 45))
    with tandem.LLM(path, device="cpu", cache_type="f32") as llm:
        ref = llm.logits(ids)
    for name in ("all-gpu", "cpu-moe", "n-cpu-moe-1"):
        with tandem.LLM(path, dtype="bf16", **PLACEMENTS[name]) as llm:
            got = llm.logits(ids)
        rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        print(f"{name}: relative L2 error of bf16 logits {rel:.2e}")
        # bf16 keeps 8 significant bits (2^-8 = 4e-3 per rounding); a few layers of them, not more.
        assert rel < 2e-2, (name, rel)


@pytest.mark.parametrize("name", ["all-gpu", "cpu-moe"])
def test_graph_decode_matches_eager(tiny_qwen3moe_gguf: tuple[Path, Path], name: str) -> None:
    path = tiny_qwen3moe_gguf[1]
    prompt = list(range(7, 19))
    runs = []
    for graphs in (False, True):
        with tandem.LLM(path, cache_type="f32", dtype="f32", cuda_graphs=graphs, **PLACEMENTS[name]) as llm:
            runs.append(llm.generate_ids(prompt, max_tokens=24, temperature=0))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("flags", [{"cpu_moe": True}, {"n_cpu_moe": 1}], ids=["cpu-moe", "n-cpu-moe-1"])
def test_vram_guarantee(tiny_qwen3moe_gguf: tuple[Path, Path], flags: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.runtime.loader import WeightLoader

    uploaded: list[str] = []
    real_upload = WeightLoader._upload

    def spy(self, info, device):  # every path from file bytes to CUDA storage goes through _upload
        uploaded.append(info.name)
        return real_upload(self, info, device)

    monkeypatch.setattr(WeightLoader, "_upload", spy)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with tandem.LLM(tiny_qwen3moe_gguf[1], device="cuda", n_ctx=256, **flags) as llm:
        llm.generate_ids(list(range(5, 45)), max_tokens=8, temperature=0)  # prefill (staged) + decode
        plan = llm.plan
        cpu_planned = {n for n, d in plan.devices.items() if d == "cpu"}
        assert cpu_planned and all(expert_layer(n) is not None or n == "token_embd.weight" for n in cpu_planned)
        assert not cpu_planned & set(uploaded), "a CPU-planned tensor was uploaded"
        assert all(llm.placed[n] == "cpu" for n in cpu_planned)
        peak = torch.cuda.max_memory_allocated() - base
        assert peak <= plan.gpu_bytes(), (peak, plan.gpu_bytes())
