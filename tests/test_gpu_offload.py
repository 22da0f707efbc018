"""Host ops and expert streaming on the GPU (run on the device: `pytest -m gpu`).

- HostCall: the CPU part of a host op runs while GPU work queued after `start` runs (overlap), eagerly
  and in a captured step, and its result is exact;
- ExpertStream: experts kept in host RAM, streamed through a two-slot window chunk by chunk, give the
  same products as the same experts resident in VRAM, for any routing (unused experts, one chunk, many).
"""

from __future__ import annotations

import gc
import time
from collections import Counter

import gguf
import numpy as np
import pytest
import torch
from qblocks import random_blocks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run with -m gpu on the device)"),
]

HOST_S = 0.05  # the host part of the test op
GPU_S = 0.05  # the GPU work queued while the host part runs


def _gpu_busy_cycles(seconds: float) -> int:
    """torch.cuda._sleep cycles that keep the GPU busy for about `seconds`."""
    torch.cuda._sleep(1_000_000)  # first launch outside the timing
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(100_000_000)
    torch.cuda.synchronize()
    return int(100_000_000 * seconds / (time.perf_counter() - start))


def _slow_double(xs: list[torch.Tensor]) -> torch.Tensor:
    time.sleep(HOST_S)
    return xs[0] * 2


def test_host_call_overlaps_gpu_work_eager_and_captured() -> None:
    from tandem.cuda.graphs import SegmentedGraph
    from tandem.weights.offload import HostCall

    cycles = _gpu_busy_cycles(GPU_S)
    host = HostCall(_slow_double)
    x = torch.arange(12, dtype=torch.float32, device="cuda").view(3, 4)

    def step() -> torch.Tensor:
        pending = host.start([x], x.shape, x.dtype)
        torch.cuda._sleep(cycles)  # GPU work that does not depend on the host part
        return pending() + 1

    def timed(fn) -> tuple[float, torch.Tensor]:  # type: ignore[no-untyped-def]
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return time.perf_counter() - start, out

    step()  # eager warm-up: makes the page-locked buffers
    eager_s, out = timed(step)
    assert torch.equal(out, x * 2 + 1)
    graph = SegmentedGraph()
    captured = graph.capture(step, [host])
    x.add_(1)  # the replay reads the live input
    replay_s, _ = timed(graph.replay)
    assert torch.equal(captured, x * 2 + 1)
    serial = HOST_S + GPU_S
    # Overlapped: about max(HOST_S, GPU_S); serial would be HOST_S + GPU_S.
    assert eager_s < 0.8 * serial, f"eager step took {eager_s:.3f} s: host and GPU parts did not overlap"
    assert replay_s < 0.8 * serial, f"replayed step took {replay_s:.3f} s: host and GPU parts did not overlap"


def test_host_call_without_overlap_is_exact_in_graph() -> None:
    from tandem.cuda.graphs import SegmentedGraph
    from tandem.weights.offload import HostCall

    host = HostCall(lambda xs: xs[0].float().sum(dim=1, keepdim=True) + xs[1].float())
    x = torch.randn(1, 8, device="cuda", dtype=torch.bfloat16)
    ids = torch.tensor([[3]], device="cuda", dtype=torch.int32)

    def step() -> torch.Tensor:
        return host([x, ids], (1, 1), torch.float32) * 3

    ref = step()
    graph = SegmentedGraph()
    out = graph.capture(step, [host])
    for k in range(3):
        x.copy_(torch.randn_like(x))
        ids.fill_(k)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.allclose(out, (x.float().sum(dim=1, keepdim=True) + k) * 3)
    assert ref.shape == (1, 1)


def test_flag_replay_survives_a_failing_host_step() -> None:
    """The graphs wait on the device for each host step's flag: a host step that fails must still release them
    and the ones after it (else the stream waits for ever), and the next replay is exact, with the host steps on
    the calling thread. Three host steps in a chain, the middle one failing: of the graphs after it (launched
    two ahead), one is launched and one not yet when it fails."""
    import threading

    from tandem.cuda.graphs import SegmentedGraph
    from tandem.weights.offload import HostCall

    fail = [False]
    ran_on: list[str] = []

    def double(xs: list[torch.Tensor]) -> torch.Tensor:
        ran_on.append(threading.current_thread().name)
        return xs[0] * 2

    def double_or_fail(xs: list[torch.Tensor]) -> torch.Tensor:
        if fail[0]:
            raise RuntimeError("host step failed")
        return double(xs)

    hosts = [HostCall(double), HostCall(double_or_fail), HostCall(double)]
    x = torch.arange(8, dtype=torch.float32, device="cuda").view(2, 4)

    def step() -> torch.Tensor:
        h = x
        for host in hosts:
            h = host([h + 1], x.shape, x.dtype)
        return h

    step()  # eager: makes the buffers and the flags
    graph = SegmentedGraph()
    out = graph.capture(step, hosts)
    assert graph.uses_flags, "this driver should run the stream memory operations HostFlag uses"
    assert len(graph.steps) == 4  # a graph per host step, and the last
    fail[0] = True
    with pytest.raises(RuntimeError, match="host step failed"):
        graph.replay()
    done = threading.Event()
    threading.Thread(target=lambda: (torch.cuda.synchronize(), done.set()), daemon=True).start()
    assert done.wait(10), "the graphs after the failed host step still wait for their flags"
    fail[0] = False
    for k in range(3):
        x.add_(k)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, (((x + 1) * 2 + 1) * 2 + 1) * 2)
    assert set(ran_on) == {threading.current_thread().name}  # ggml's OpenMP team stays the caller's (cuda/graphs.py)


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K], ids=str)
@pytest.mark.parametrize("slot_experts", [1, 3, 64])
def test_streamed_experts_equal_resident(qtype: gguf.GGMLQuantizationType, slot_experts: int) -> None:
    from tandem.cuda.host_memory import register_host
    from tandem.cuda.qlinear import GPUQuantWeight, qmatmul_id
    from tandem.weights.offload import ExpertStream

    rng = np.random.default_rng(7)
    e, n, k = 12, 96, 512
    raw = random_blocks(qtype, (e, n, k), rng).reshape(-1).copy()
    host = torch.from_numpy(raw)
    resident = GPUQuantWeight(host.cuda(), qtype, (e, n, k))
    reg = register_host(host.data_ptr(), host.numel(), read_only=False, owner=host, device=torch.device("cuda"))
    assert not isinstance(reg, str), reg
    stream = ExpertStream(slot_experts * resident.expert_bytes, 0, torch.device("cuda"))
    streamed = GPUQuantWeight(host, qtype, (e, n, k), stream=stream)
    for t, a, pool in ((40, 2, e), (64, 4, 5), (33, 1, 1)):  # all experts; only some; a single one
        ids = torch.from_numpy(rng.choice(pool, size=(t, a))).cuda() * (e // pool)
        x = torch.randn(t, k, device="cuda")
        for ieee in (True, False):
            want = qmatmul_id(x, resident, ids, ieee)
            got = qmatmul_id(x, streamed, ids, ieee)
            torch.cuda.synchronize()
            assert torch.equal(got, want), (t, a, pool, ieee)
    reg.close()


def test_streamed_experts_are_read_from_page_locked_file_memory(tiny_qwen3moe_gguf, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With experts in host RAM, prefill streams them from the file mapping page-locked in place (DMA at PCIe
    speed); the registration lives as long as the model, not just the loader. Q8_0 experts: a type the GPU
    kernels read, so they stream (F32 experts would prefill on the CPU)."""
    import gc

    import tandem
    from tandem.convert import convert_hf
    from tandem.weights.offload import OffloadedExperts

    path = convert_hf(tiny_qwen3moe_gguf[0], tmp_path / "tiny-q8_0.gguf", "q8_0")
    with tandem.LLM(path, device="cuda", cpu_moe=True, n_ctx=128) as llm:
        gc.collect()
        assert not any("bounce" in n for n in llm.notices), llm.notices
        experts = [getattr(b.ffn, "experts", None) for b in llm.model.blocks]
        offloaded = [e for e in experts if isinstance(e, OffloadedExperts)]
        assert offloaded and all(e.streamed is not None for e in offloaded)
        stream = offloaded[0].streamed.gate.weight.stream  # type: ignore[union-attr]
        assert stream.source_pin is not None
        llm.generate_ids(list(range(5, 45)), max_tokens=2, temperature=0)  # streams through the window


def test_repacked_cpu_experts_in_the_captured_step(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--repack-experts with --cpu-moe: the captured decode step's host ops read the repacked Q4_K copies (a
    2-layer synthetic Qwen3-30B-A3B, whose expert stacks are Q4_K/Q6_K), and the logits of prefill and of
    replayed decode steps stay close to the plain run's (f32 compute).

    Close, not equal to float32 rounding: on the same hidden state the repacked and the plain kernels now and then
    round a product differently by much more than their summation order would (the CPU path, 2-layer synthetic
    model, 60 decode steps, 2026-11-30: most steps within 1e-6, some single steps 2.9e-3 to 1.5e-2 of a largest
    logit of 4.75, the step after them exact again; on the H200 host, one step of five 7.4e-4 of 4.14 in three
    calls). Reading a wrong or stale buffer would be off by the logits' own size, so the bound is 1e-2 of the
    largest logit. That the captured path itself is exact is the next test's (captured = eager, repacked)."""
    import tandem
    from tandem.synth.writer import synthesize

    path = synthesize("qwen3-30b-a3b", tmp_path / "q30.gguf", layers=2, fill="random").path
    runs = []
    for repack in (False, True):
        with tandem.LLM(path, device="cuda", cpu_moe=True, dtype="f32", n_ctx=128, repack_experts=repack) as llm:
            assert any("expert stacks repacked" in n for n in llm.notices) == repack, llm.notices
            engine = llm.engine
            logits = [engine.feed([300, 1000, 77, 5]).float().cpu()]
            for token in (11, 22, 33, 44):  # the same tokens in both runs; the first step eager, then replayed
                logits.append(engine.append([token]).float().cpu())
            runs.append(torch.stack(logits))
    plain, repacked = runs
    per_row = (repacked - plain).abs().amax(dim=1).tolist()  # prefill, eager step, replayed steps
    assert (repacked - plain).abs().max() <= 1e-2 * plain.abs().max(), per_row


def test_repacked_cpu_experts_captured_equal_eager(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--repack-experts: replayed decode steps give the eager steps' logits (the same host ops on the same
    inputs), so a difference from the plain run (test above) is the repacked kernels' rounding, not the
    captured path (passed on the device whenever the test above failed its earlier 1e-4 bound)."""
    import tandem
    from tandem.synth.writer import synthesize

    path = synthesize("qwen3-30b-a3b", tmp_path / "q30.gguf", layers=2, fill="random").path
    runs = []
    for graphs in (False, True):
        with tandem.LLM(
            path, device="cuda", cpu_moe=True, dtype="f32", n_ctx=128, repack_experts=True, cuda_graphs=graphs
        ) as llm:
            engine = llm.engine
            logits = [engine.feed([300, 1000, 77, 5]).float().cpu()]
            logits += [engine.append([token]).float().cpu() for token in (11, 22, 33, 44)]
            runs.append(torch.stack(logits))
    eager, captured = runs
    per_row = (captured - eager).abs().amax(dim=1).tolist()
    assert (captured - eager).abs().max() <= 1e-5 * eager.abs().max(), per_row


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K], ids=str)
def test_pcie_experts_read_host_blocks_in_place(qtype: gguf.GGMLQuantizationType) -> None:
    """--pcie-experts: a device view of page-locked host blocks takes no VRAM, and the GPU kernels reading the
    blocks through it over PCIe give exactly the products of the same blocks copied to VRAM (the one-row kernel
    of decode and the grouped one of larger batches)."""
    from tandem.cuda.host_memory import device_view, register_host
    from tandem.cuda.qlinear import GPUQuantWeight, qmatmul_id

    rng = np.random.default_rng(11)
    e, n, k = 12, 96, 512
    host = torch.from_numpy(random_blocks(qtype, (e, n, k), rng).reshape(-1).copy())
    reg = register_host(host.data_ptr(), host.numel(), read_only=True, owner=host, device=torch.device("cuda"))
    assert not isinstance(reg, str), reg
    resident = GPUQuantWeight(host.cuda(), qtype, (e, n, k))
    before = torch.cuda.memory_allocated()
    view = device_view(host, torch.device("cuda"))
    assert torch.cuda.memory_allocated() == before and view.is_cuda and view.numel() == host.numel()
    over_pcie = GPUQuantWeight(view, qtype, (e, n, k))
    for t, a in ((1, 3), (2, 8), (20, 2)):  # decode; a few tokens; a batch past the one-row kernel (40 slots)
        ids = torch.from_numpy(rng.choice(e, size=(t, a))).cuda()
        x = torch.randn(t, k, device="cuda")
        for ieee in (True, False):
            want = qmatmul_id(x, resident, ids, ieee)
            got = qmatmul_id(x, over_pcie, ids, ieee)
            torch.cuda.synchronize()
            assert torch.equal(got, want), (t, a, ieee)
    del view, over_pcie
    reg.close()


def _live_cuda_tensors() -> Counter[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of every CUDA tensor Python holds: what a VRAM difference is made of."""
    return Counter((tuple(t.shape), t.dtype) for t in gc.get_objects() if isinstance(t, torch.Tensor) and t.is_cuda)


def _offloaded(llm) -> list:  # type: ignore[no-untyped-def]
    """The model's OffloadedExperts: each block's routed experts kept in host RAM (found through its FFN's
    branches: Gemma 4's routed one beside the dense one, Qwen3.5's beside the shared expert)."""
    from tandem.weights.offload import OffloadedExperts

    found = []
    for block in llm.model.blocks:
        ffn = block.ffn
        for branch in ("sparse", "routed"):
            ffn = getattr(ffn, branch, ffn)
        experts = getattr(ffn, "experts", None)
        if isinstance(experts, OffloadedExperts):
            found.append(experts)
    return found


def test_pcie_experts_in_the_captured_step(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--cpu-moe --pcie-experts 3 on a 2-layer synthetic Qwen3-30B-A3B (Q4_K/Q6_K experts, top-8): the plan and
    where the tensors are read back are those of --cpu-moe, loading takes no more VRAM, nothing CPU-planned is
    uploaded; the captured decode step gives the eager step's logits; and prefill (streamed) and decode logits
    stay close to the CPU-only run's (f32 compute).

    Close, not equal: ggml multiplies Q8_K-quantized activations where the GPU kernels read f32 ones, for the 3 of 8
    experts the GPU takes (the repacked test above sees ~1e-3 of the largest logit from such rounding); a wrong
    expert, slot or stale buffer is off by the logits' own size, so the bound is 1e-2 of the largest logit."""
    import tandem
    from tandem.synth.writer import synthesize
    from tandem.weights.loader import WeightLoader
    from tandem.weights.offload import OffloadedExperts

    path = synthesize("qwen3-30b-a3b", tmp_path / "q30.gguf", layers=2, fill="random").path
    uploaded: list[str] = []
    real_upload = WeightLoader._upload

    def spy(self, info, device):  # type: ignore[no-untyped-def]
        uploaded.append(info.name)
        return real_upload(self, info, device)

    WeightLoader._upload = spy  # type: ignore[method-assign]
    runs, loaded_bytes, placed, live = {}, {}, {}, {}
    try:
        for k, graphs in ((0, True), (3, False), (3, True)):
            gc.collect()  # what earlier tests left in reference cycles is freed now, not while this one loads
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            with tandem.LLM(path, device="cuda", cpu_moe=True, dtype="f32", n_ctx=128, pcie_experts=k,
                            cuda_graphs=graphs) as llm:  # fmt: skip
                loaded_bytes[k] = torch.cuda.memory_allocated() - base
                live[k] = _live_cuda_tensors()
                placed[k] = dict(llm.placed)
                offloaded = [b.ffn.experts for b in llm.model.blocks if isinstance(b.ffn.experts, OffloadedExperts)]
                assert len(offloaded) == 2 and all((e.pcie is not None) == (k > 0) for e in offloaded)
                assert any(n.startswith("--pcie-experts 3: in decode") for n in llm.notices) == (k > 0)
                engine = llm.engine
                logits = [engine.feed(list(range(300, 340))).float().cpu()]  # 40 tokens: streamed prefill
                logits += [engine.append([t]).float().cpu() for t in (11, 22, 33, 44, 55)]
                runs[(k, graphs)] = torch.stack(logits)
    finally:
        WeightLoader._upload = real_upload  # type: ignore[method-assign]
    cpu_planned = {n for n, d in placed[0].items() if d == "cpu"}
    assert cpu_planned and not cpu_planned & set(uploaded), "a CPU-planned tensor was uploaded"
    assert placed[3] == placed[0]
    assert loaded_bytes[3] == loaded_bytes[0], (loaded_bytes, live[3] - live[0], live[0] - live[3])
    eager, captured, cpu_only = runs[(3, False)], runs[(3, True)], runs[(0, True)]
    assert (captured - eager).abs().max() <= 1e-5 * eager.abs().max(), (captured - eager).abs().amax(dim=1)
    per_row = (captured - cpu_only).abs().amax(dim=1).tolist()
    print(f"--pcie-experts 3 against the CPU alone, max |logit diff| per row: {per_row}")
    assert (captured - cpu_only).abs().max() <= 1e-2 * cpu_only.abs().max(), per_row
    assert torch.equal(captured[0], cpu_only[0])  # prefill streams the experts either way: the same kernels


@pytest.mark.parametrize("fixture", ["tiny_qwen35moe_gguf", "tiny_gemma4_gguf", "tiny_gpt_oss_gguf"])
def test_pcie_experts_across_moe_archs(fixture: str, request: pytest.FixtureRequest, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--pcie-experts 1 on the other expert layouts, converted to Q8_0 (a type the GPU kernels read): Qwen3.5's
    routed experts beside its shared expert, Gemma 4's fused gate_up with per-expert output scales beside its
    dense branch, gpt-oss's biases (its expert vectors read over PCIe too). Captured decode logits stay within
    rounding of the CPU-only run's (f32 compute; bound as in the test above). Added after the session-11 device
    calls, where only the synthetic Qwen3-30B-A3B was checked with the flag."""
    from tandem.convert import convert_hf

    path = convert_hf(request.getfixturevalue(fixture)[0], tmp_path / "q8_0.gguf", "q8_0")
    _check_pcie_split(path, fixture, dtype="f32", cache_type="f32")


@pytest.mark.parametrize("fixture", ["tiny_gemma4_gguf", "tiny_gpt_oss_gguf"])
def test_pcie_experts_at_default_numerics(fixture: str, request: pytest.FixtureRequest, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The same at tandem's GPU defaults (bf16 products, f16 KV cache) on the two layouts whose split once gave
    wrong results (issue 17): the split changes only which side computes an expert, both giving ggml's values."""
    from tandem.convert import convert_hf

    path = convert_hf(request.getfixturevalue(fixture)[0], tmp_path / "q8_0.gguf", "q8_0")
    cpu_only, split = _check_pcie_split(path, fixture)
    assert torch.equal(split.argmax(dim=1), cpu_only.argmax(dim=1))


def _check_pcie_split(path, fixture: str, **flags) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Prefill of 5 tokens and 4 captured decode steps with --cpu-moe, without and with --pcie-experts 1: the
    split's logits within 1 % of the largest of the CPU-only run's; both runs' logits [5, V]."""
    import tandem

    runs = []
    for k in (0, 1):
        with tandem.LLM(path, device="cuda", cpu_moe=True, n_ctx=128, pcie_experts=k, **flags) as llm:
            assert any(n.startswith("--pcie-experts 1:") for n in llm.notices) == (k > 0)
            engine = llm.engine
            logits = [engine.feed([3, 17, 29, 41, 5]).float().cpu()]  # under 32 tokens: the CPU/PCIe split too
            logits += [engine.append([t]).float().cpu() for t in (11, 22, 33, 44)]
            runs.append(torch.stack(logits))
    cpu_only, split = runs
    per_row = (split - cpu_only).abs().amax(dim=1).tolist()
    print(f"{fixture} {flags}: --pcie-experts 1 against the CPU alone, max |logit diff| per row: {per_row}")
    assert (split - cpu_only).abs().max() <= 1e-2 * cpu_only.abs().max(), per_row
    return cpu_only, split


@pytest.mark.parametrize("fixture", ["tiny_qwen3moe_gguf", "tiny_gemma4_gguf", "tiny_gpt_oss_gguf"])
def test_pcie_experts_split_by_expert_in_a_batch(fixture: str, request: pytest.FixtureRequest, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Six sequences decoding at once with --pcie-experts 1 (the 8-row graph, captured after its eager first
    step): a batch splits its experts by expert between ggml and the GPU, which computes its part from copies
    staged in the window, vectors (Gemma 4's scales, gpt-oss's biases) included (weights/offload.py
    ExpertStaging); the logits stay within rounding of the CPU-only run's, as one token's split by slot does
    above."""
    import tandem
    from tandem.convert import convert_hf

    path = convert_hf(request.getfixturevalue(fixture)[0], tmp_path / "q8_0.gguf", "q8_0")
    prompts = [[3 + s, 17, 29, 41, 5, 8, 13][: 2 + s] for s in range(6)]  # 2 to 7 tokens: both splits in prefill
    runs = []
    for k in (0, 1):  # the tiny models select 2 experts per token: the GPU takes half of the experts
        with tandem.LLM(path, device="cuda", cpu_moe=True, dtype="f32", cache_type="f32", n_ctx=64, n_parallel=6,
                        pcie_experts=k) as llm:  # fmt: skip
            runner = llm.engine.runner
            logits = [runner.run([(s, p)]).float().cpu() for s, p in enumerate(prompts)]
            logits += [runner.run([(s, [11 + i + s]) for s in range(6)]).float().cpu() for i in range(4)]
            assert runner.captured(8) is not None
            if k:  # every layer's batches staged their experts in the window
                staged = [e.staging.staged_total for e in _offloaded(llm) if e.staging is not None]
                assert staged and all(n > 0 for n in staged), staged
            runs.append(torch.cat(logits))
    cpu_only, split = runs
    per_row = (split - cpu_only).abs().amax(dim=1).tolist()
    print(f"{fixture}: batched --pcie-experts 1 against the CPU alone, max |logit diff| per row: {per_row}")
    assert (split - cpu_only).abs().max() <= 1e-2 * cpu_only.abs().max(), per_row
