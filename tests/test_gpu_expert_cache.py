"""The expert cache on the GPU (issue 21; run on the device: `pytest -m gpu tests/test_gpu_expert_cache.py`).

- the split kernel and the skipping products on the device give their CPU forms;
- `--cpu-moe --moe-cache`: only the planned experts' rows are uploaded (no CPU-planned tensor whole), VRAM after
  load grows by the cache's bytes, the captured decode step gives the eager step's logits, and prefill (cached
  experts from VRAM, the rest streamed) and decode (cached on the GPU, the rest by ggml, with and without
  --pcie-experts) stay within rounding of --cpu-moe alone;
- `--gpu-memory`: the peak VRAM of load, prefill and decode, as the driver counts it, stays under the budget;
- routing statistics counted in the captured step (padding rows of a batch not counted), saved and placing the
  next start's cache;
- batched decode through the engine with cached experts.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run with -m gpu on the device)"),
]


@pytest.fixture(scope="module")
def q30(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A 2-layer synthetic Qwen3-30B-A3B (Q4_K/Q6_K experts, 128 experts, top-8); 1.2 GB of disk, given back when
    the module is done."""
    from tandem.synth.writer import synthesize

    path = synthesize("qwen3-30b-a3b", tmp_path_factory.mktemp("q30") / "q30.gguf", layers=2, fill="random").path
    yield path
    path.unlink(missing_ok=True)


def test_split_kernel_on_the_device_equals_the_torch_form() -> None:
    from tandem.cuda.routing import split_route
    from tandem.layers.moe import Routing, split_routing

    g = torch.Generator().manual_seed(0)
    for t, pcie in ((1, 0), (4, 3), (32, 0), (32, 2)):
        ids = torch.stack([torch.randperm(128, generator=g)[:8] for _ in range(t)]).to(torch.int32)
        w = torch.softmax(torch.randn(t, 8, generator=g), -1)
        slot_map = torch.full((128,), -1, dtype=torch.int32)
        cached = torch.randperm(128, generator=g)[:50]
        slot_map[cached] = torch.arange(50, dtype=torch.int32)
        ref = split_routing(Routing(ids, w), slot_map, pcie)
        (ri, rw), (ci, cw), n, pc = split_route(ids.cuda(), w.cuda(), slot_map.cuda(), pcie)
        assert torch.equal(ri.cpu(), ref.resident.ids) and torch.equal(rw.cpu(), ref.resident.weights)
        assert torch.equal(ci.cpu(), ref.cpu.ids) and torch.equal(cw.cpu(), ref.cpu.weights)
        assert torch.equal(n.cpu(), ref.cpu_counts)
        if pcie:
            assert pc is not None and ref.pcie is not None
            assert torch.equal(pc[0].cpu(), ref.pcie.ids) and torch.equal(pc[1].cpu(), ref.pcie.weights)


def test_products_skip_on_the_device() -> None:
    import gguf
    from qblocks import random_blocks

    from tandem.cuda.qlinear import GPUQuantWeight, qmatmul_id

    rng = np.random.default_rng(5)
    for qtype in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K):
        e, n, k = 12, 96, 512
        w = GPUQuantWeight(torch.from_numpy(random_blocks(qtype, (e, n, k), rng).reshape(-1).copy()).cuda(), qtype,
                           (e, n, k))  # fmt: skip
        for t, a in ((1, 8), (4, 8), (40, 8)):
            ids = torch.from_numpy(rng.integers(0, e, size=(t, a))).to(torch.int32).cuda()
            x = torch.randn(t, k, device="cuda")
            full = qmatmul_id(x, w, ids, ieee=True)
            holes = ids.clone()
            holes[:, ::3] = -1
            part = qmatmul_id(x, w, holes, ieee=True, skips=True)
            torch.cuda.synchronize()
            assert torch.equal(part[:, ::3], torch.zeros_like(part[:, ::3])), (qtype, t)
            keep = torch.ones(a, dtype=torch.bool)
            keep[::3] = False
            assert torch.allclose(part[:, keep], full[:, keep], rtol=1e-5, atol=1e-5), (qtype, t)


def _run(path: Path, **kwargs: object) -> tuple[torch.Tensor, dict[str, object]]:
    """Prefill 40 tokens (streamed), then 6 decode steps (the first eager, then replayed); logits and facts."""
    import tandem

    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    with tandem.LLM(path, device="cuda", dtype="f32", n_ctx=128, **kwargs) as llm:  # type: ignore[arg-type]
        loaded = torch.cuda.memory_allocated() - base
        engine = llm.engine
        logits = [engine.feed(list(range(300, 340))).float().cpu()]
        logits += [engine.append([t]).float().cpu() for t in (11, 22, 33, 44, 55, 66)]
        facts = {"loaded": loaded, "plan": llm.plan, "placed": dict(llm.placed), "notices": list(llm.notices)}
    return torch.stack(logits), facts


def test_moe_cache_uploads_only_the_planned_rows_and_matches_cpu_moe(q30: Path) -> None:
    from tandem.weights.loader import WeightLoader

    uploaded: list[str] = []
    real_upload = WeightLoader._upload

    def spy(self, info, device):  # type: ignore[no-untyped-def]
        uploaded.append(info.name)
        return real_upload(self, info, device)

    WeightLoader._upload = spy  # type: ignore[method-assign]
    try:
        runs = {}
        for pcie, graphs in ((0, False), (0, True), (3, True)):
            runs[(pcie, graphs)], facts = _run(q30, cpu_moe=True, moe_cache="100MiB", pcie_experts=pcie,
                                               cuda_graphs=graphs)  # fmt: skip
        # after the others: the first load in a process also makes what the process keeps (seen 0.6 MiB more)
        cpu_moe, plain = _run(q30, cpu_moe=True)
    finally:
        WeightLoader._upload = real_upload  # type: ignore[method-assign]
    plan = facts["plan"]
    cache = plan.expert_cache  # type: ignore[attr-defined]
    assert cache.layers and 0 < cache.bytes <= 100 * 2**20
    cpu_planned = {n for n, d in plain["placed"].items() if d == "cpu"}  # type: ignore[union-attr]
    assert not cpu_planned & set(uploaded), "a CPU-planned tensor was uploaded whole"
    assert facts["placed"] == plain["placed"]  # the tensors are where --cpu-moe put them
    grown = int(facts["loaded"]) - int(plain["loaded"])  # type: ignore[call-overload]
    assert cache.bytes <= grown <= cache.bytes + (32 << 20), (grown, cache.bytes)  # + slot maps, allocator rounding
    assert any(str(n).startswith("expert cache:") for n in facts["notices"])  # type: ignore[union-attr]
    eager, captured = runs[(0, False)], runs[(0, True)]
    assert (captured - eager).abs().max() <= 1e-5 * eager.abs().max(), (captured - eager).abs().amax(dim=1)
    for key, split in runs.items():
        per_row = (split - cpu_moe).abs().amax(dim=1).tolist()
        print(f"--moe-cache 100MiB {key} against --cpu-moe, max |logit diff| per row: {per_row}")
        # the cached experts compute as VRAM experts do (f32 products of unrounded inputs, ggml rounds them to
        # Q8_K): rounding-sized differences; a wrong slot or expert is off by the logits' own size
        assert (split - cpu_moe).abs().max() <= 1e-2 * cpu_moe.abs().max(), (key, per_row)


def test_gpu_memory_budget_holds_by_the_driver(q30: Path, tmp_path: Path) -> None:
    """--gpu-memory bounds what the driver shows for the process: `tandem bench` in a process of its own (the CUDA
    context included: its baseline is read before it touches the GPU) through load, a prefill of 200 tokens and
    decode, at budgets between --cpu-moe's plan and the whole model's. Run alone (device_compare.sh's serial
    tests, by the name): another process's memory on the GPU would count."""
    import json
    import subprocess
    import sys

    from tandem.gguf import open_gguf
    from tandem.models import read_config
    from tandem.placement import PlacementRequest, RuntimeShape, plan_placement

    f = open_gguf(q30)
    cfg = read_config(f)
    shape = RuntimeShape(n_ctx=256)
    everything = plan_placement(f, cfg, PlacementRequest.from_flags(device="cuda"), shape).gpu_bytes()
    floor = plan_placement(f, cfg, PlacementRequest.from_flags(device="cuda", cpu_moe=True), shape).gpu_bytes()
    for k, budget in enumerate((floor + (everything - floor) // 3, floor + 2 * (everything - floor) // 3)):
        report = tmp_path / f"budget{k}"
        cmd = [sys.executable, "-m", "tandem.cli.main", "bench", "-m", str(q30), "--device", "cuda", "-c", "256",
               "--gpu-memory", str(int(budget)), "--pp", "200", "--tg", "8", "--reps", "1",
               "--report", str(report)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        row = json.loads((report / "report.json").read_text())["rows"][0]
        assert row["status"] == "ok" and row["vram_source"], row
        notices = row["runs"][0]["notices"]
        print(f"--gpu-memory {budget >> 20} MiB: the driver {row['vram_used_bytes'] >> 20} MiB, torch's peak "
              f"{row['vram_torch_peak_bytes'] >> 20} MiB; {notices}")
        assert row["vram_used_bytes"] <= budget, (row["vram_used_bytes"], budget, notices)
        assert row["vram_torch_peak_bytes"] <= budget - (512 << 20), (row["vram_torch_peak_bytes"], budget)


def test_routing_counts_in_the_captured_step_and_the_next_start(q30: Path, tmp_path: Path) -> None:
    import tandem
    from tandem.placement import ExpertStats

    stats = tmp_path / "stats.json"
    with tandem.LLM(q30, device="cuda", n_ctx=128, cpu_moe=True, moe_cache="50MiB", expert_stats=stats) as llm:
        llm.engine.feed(list(range(200, 220)))  # 20 rows
        for t in range(6):  # 6 decode steps, eager then replayed
            llm.engine.append([t + 3])
        counts = llm.routing_counts.read()  # type: ignore[union-attr]
    assert counts.sum(dim=1).tolist() == [(20 + 6) * 8] * 2
    saved = ExpertStats.open(stats, llm.file, llm.config)
    assert saved.total == 2 * 26 * 8 and np.array_equal(saved.counts, counts.numpy())
    with tandem.LLM(q30, device="cuda", n_ctx=128, n_parallel=4, cpu_moe=True, moe_cache="50MiB",
                    expert_stats=stats) as llm:  # fmt: skip
        cache = llm.plan.expert_cache
        assert "--expert-stats" in cache.source
        for layer, ids in cache.layers.items():  # the most picked experts of the first run
            picked = saved.counts[layer]
            assert picked[list(ids)].min() >= np.sort(picked)[-len(ids)], layer
        # a batch of 3 in the graph of 4: the padding row is not counted
        before = llm.routing_counts.read().sum().item()  # type: ignore[union-attr]
        from tandem.runtime.sampling import Sampler, SamplingParams

        seqs = [llm.engine.add_request([5 + i, 9, 13], Sampler(SamplingParams(temperature=0)), 5, frozenset())
                for i in range(3)]  # fmt: skip
        while llm.engine.has_work:
            llm.engine.step()
        assert all(s.n_output == 5 for s in seqs)
        after = llm.routing_counts.read().sum().item()  # type: ignore[union-attr]
        assert after - before == 2 * 8 * 3 * (3 + 4)  # 3 prompt rows and 4 decode steps each, 2 layers


def test_batched_decode_with_cached_experts(q30: Path) -> None:
    """Four sequences decoding together with cached experts (the captured 4-row graph) give each one's tokens
    alone (f32)."""
    import tandem
    from tandem.runtime.sampling import Sampler, SamplingParams

    prompts = [[100 + 7 * i, 200 + i, 300, 17 + i] for i in range(4)]
    with tandem.LLM(q30, device="cuda", n_ctx=64, n_parallel=4, dtype="f32", cpu_moe=True, moe_cache="60MiB") as llm:
        alone = [llm.generate_ids(p, max_tokens=6, temperature=0) for p in prompts]
        seqs = [llm.engine.add_request(p, Sampler(SamplingParams(temperature=0)), 6, frozenset()) for p in prompts]
        while llm.engine.has_work:
            llm.engine.step()
        together = [list(s.output) for s in seqs]
    assert together == [list(a) for a in alone]


def test_online_replacement_in_captured_decode(q30: Path) -> None:
    """--moe-cache-refresh 2: counts pushed towards experts outside the cache make the refresher swap them in
    between captured decode steps (copies on its side stream, slot maps flipped at step boundaries); the logits stay
    within rounding of --cpu-moe's, step after step."""
    import tandem

    tokens = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122, 133]
    runs = []
    for flags in ({"cpu_moe": True}, {"cpu_moe": True, "moe_cache": "40MiB", "moe_cache_refresh": 2}):
        with tandem.LLM(q30, device="cuda", dtype="f32", n_ctx=128, **flags) as llm:  # type: ignore[arg-type]
            engine = llm.engine
            logits = [engine.feed(list(range(300, 310))).float().cpu()]
            refresher = llm.expert_refresher
            if refresher is not None:
                for s in refresher.layers:  # make every uncached expert look hot
                    outside = [e for e in range(128) if e not in s.cached]
                    llm.routing_counts.counts[s.layer, outside[:4]] += 10_000  # type: ignore[union-attr]
            for t in tokens:
                logits.append(engine.append([t]).float().cpu())
            if refresher is not None:
                assert refresher.swaps >= 2, refresher.swaps
                for s in refresher.layers:
                    assert sorted(e for e in range(128) if s.slot_map[e].item() >= 0) == sorted(s.cached)
            runs.append(torch.stack(logits))
    cpu_moe, refreshed = runs
    per_row = (refreshed - cpu_moe).abs().amax(dim=1).tolist()
    assert (refreshed - cpu_moe).abs().max() <= 1e-2 * cpu_moe.abs().max(), per_row
