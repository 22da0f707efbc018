"""--tp 2 on two GPUs (`pytest -m gpu` on a machine with 2 CUDA devices; docs/TENSOR_PARALLEL.md): the ranks' NCCL
all-reduces give --tp 1's greedy tokens, and no rank puts a CPU-planned tensor in its VRAM."""

from __future__ import annotations

import pytest
import torch

import tandem
from tandem.placement import expert_layer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs 2 CUDA devices (run with -m gpu on a 2-GPU machine)",
    ),
]

OPTS = {"cache_type": "f32", "dtype": "f32", "n_ctx": 256, "threads": 2}
FAMILIES = ["tiny_qwen3_gguf", "tiny_gemma3_gguf", "tiny_qwen3moe_gguf", "tiny_qwen35moe_gguf", "tiny_qwen3next_gguf",
            "tiny_gpt_oss_gguf", "tiny_gemma4_gguf"]  # fmt: skip
DENSE = {"tiny_qwen3_gguf", "tiny_gemma3_gguf"}


def _prompt(n: int) -> list[int]:
    return [5 + (7 * i) % 400 for i in range(n)]


@pytest.mark.parametrize("prompt_len", [5, 40])  # 40 > 32: prefill streams the CPU experts to each rank's GPU
@pytest.mark.parametrize("placement", ["all-gpu", "cpu-moe"])
@pytest.mark.parametrize("fixture", FAMILIES)
def test_greedy_tokens_with_tp_2_equal_tp_1_on_two_gpus(
    fixture: str, placement: str, prompt_len: int, request: pytest.FixtureRequest
) -> None:
    if placement == "cpu-moe" and fixture in DENSE:
        pytest.skip("a dense model has no experts to keep in host RAM")
    path = request.getfixturevalue(fixture)[1]
    flags = {"device": "cuda", "cpu_moe": placement == "cpu-moe", **OPTS}
    prompt = _prompt(prompt_len)
    with tandem.LLM(path, **flags) as llm:
        want = llm.generate_ids(prompt, max_tokens=12, temperature=0)
    with tandem.LLM(path, tp=2, **flags) as llm:
        assert [r["device"] for r in llm.tp.reports()] == ["cuda:0", "cuda:1"]  # type: ignore[union-attr]
        assert llm.generate_ids(prompt, max_tokens=12, temperature=0) == want


HOST_EXPERTS = {"cpu-moe": {"cpu_moe": True}, "n-cpu-moe-1": {"n_cpu_moe": 1},
                "ot": {"override_tensor": [r"blk\.1\.ffn_.*_exps=cpu"]}}  # fmt: skip


@pytest.mark.parametrize("flags", HOST_EXPERTS.values(), ids=HOST_EXPERTS.keys())
@pytest.mark.parametrize("fixture", ["tiny_qwen3moe_gguf", "tiny_qwen35moe_gguf", "tiny_gemma4_gguf"])
def test_no_rank_uploads_a_cpu_planned_tensor(fixture: str, flags: dict, request: pytest.FixtureRequest) -> None:
    """Every rank records every upload (weights/tp.py): none of them is a tensor its plan keeps in host RAM, the
    weights read back from every rank are where its plan put them, and each rank's GPU memory after prefill (staged)
    and decode stays within its plan's."""
    path = request.getfixturevalue(fixture)[1]
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(0)
    base = torch.cuda.memory_allocated(0)
    with tandem.LLM(path, device="cuda", tp=2, **OPTS, **flags) as llm:
        assert llm.tp is not None
        llm.generate_ids(_prompt(40), max_tokens=8, temperature=0)
        reports = llm.tp.reports()
        for rank, report in zip(llm.tp.plan.ranks, reports, strict=True):
            plan = rank.plan
            cpu_planned = {n for n, d in plan.devices.items() if d == "cpu"}
            assert cpu_planned and {n for n in cpu_planned if expert_layer(n) is not None}
            assert not cpu_planned & set(report["uploaded"]), f"rank {rank.rank} uploaded a CPU-planned tensor"
            placed = report["placed"]
            assert all(placed[n] == plan.devices[n] for n in placed), rank.rank
            peak = report["peak_gpu_bytes"] - (base if rank.rank == 0 else 0)
            assert peak <= plan.gpu_bytes(), (rank.rank, peak, plan.gpu_bytes())
