"""GPU path (run on the device: `pytest -m gpu`): kernels, placements, and the VRAM guarantee."""

from __future__ import annotations

import re
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


def test_output_head_past_l2_is_one_grouped_tile() -> None:
    """A weight larger than the GPU's L2 (a 248k-row output head) from QMV_MAX_ROWS_PAST_L2 + 1 to GQMM_MAX_BM
    rows is one tile of the grouped GEMM (its blocks read once, no float copy of them), and its product equals
    the dequantized slices'."""
    from gguf.constants import GGML_QUANT_SIZES

    from tandem.cuda import qlinear

    qtype = gguf.GGMLQuantizationType.Q6_K
    n, k = 248320, 2048
    block, size = GGML_QUANT_SIZES[qtype]
    g = torch.Generator(device="cuda").manual_seed(0)
    data = torch.randint(0, 256, (n * k // block * size,), dtype=torch.uint8, device="cuda", generator=g)
    w = qlinear.GPUQuantWeight(data & 0x3B, qtype, (n, k))  # every byte pair below 2 as f16: finite scales
    few, bm = qlinear.QMV_MAX_ROWS_PAST_L2, qlinear.GQMM_MAX_BM
    kernels = {m: qlinear.dense_kernel(m, w) for m in (few, few + 1, bm, bm + 1)}
    assert list(kernels.values()) == ["qmv", "grouped", "grouped", "sliced"], kernels
    for m in (few + 1, 16, 33):
        x = torch.randn(m, k, device="cuda")
        got = qlinear.qmatmul(x, w, ieee=True).double()
        ref = qlinear.DENSE_PRODUCTS["sliced"](x, w, True).double()
        assert ((got - ref).norm() / ref.norm()).item() < 1e-5, m


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


# A few layers of roundings, not more: bf16 keeps 8 significant bits (2^-8 = 4e-3 per rounding), f16 11 (5e-4).
HALF_TOLERANCE = {"bf16": 2e-2, "f16": 5e-3}


@pytest.mark.parametrize("dtype", list(HALF_TOLERANCE))
def test_half_logits_close_across_placements(tiny_qwen3moe_gguf: tuple[Path, Path], dtype: str) -> None:
    path = tiny_qwen3moe_gguf[1]
    ids = list(range(5, 45))
    with tandem.LLM(path, device="cpu", cache_type="f32") as llm:
        ref = llm.logits(ids)
    for name in ("all-gpu", "cpu-moe", "n-cpu-moe-1"):
        with tandem.LLM(path, dtype=dtype, **PLACEMENTS[name]) as llm:
            got = llm.logits(ids)
        rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        print(f"{name}: relative L2 error of {dtype} logits {rel:.2e}")
        assert rel < HALF_TOLERANCE[dtype], (name, rel)


@pytest.mark.parametrize("name", ["all-gpu", "cpu-moe"])
def test_graph_decode_matches_eager(tiny_qwen3moe_gguf: tuple[Path, Path], name: str) -> None:
    path = tiny_qwen3moe_gguf[1]
    prompt = list(range(7, 19))
    runs = []
    for graphs in (False, True):
        with tandem.LLM(path, cache_type="f32", dtype="f32", cuda_graphs=graphs, **PLACEMENTS[name]) as llm:
            runs.append(llm.generate_ids(prompt, max_tokens=24, temperature=0))
    assert runs[0] == runs[1]


# The architectures of issue 4: hybrid delta-net / gated attention (qwen35moe, qwen3next), Gemma 4 (sliding and
# global layers, softcap, dense MLP beside the experts), gpt-oss (sinks, sliding window, expert biases).
MOE_ARCHS = ["tiny_qwen35moe_gguf", "tiny_qwen3next_gguf", "tiny_gemma4_gguf", "tiny_gpt_oss_gguf"]
# Every GPU placement, with the decode step captured as CUDA graphs and launched eagerly.
GPU_RUNS = {
    f"{name}{'' if graphs else '-eager'}": {**flags, "cuda_graphs": graphs}
    for name, flags in PLACEMENTS.items()
    if name != "cpu"
    for graphs in (True, False)
}


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(4, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _first_difference(got: list[int], ref: list[int]) -> str:
    i = next((i for i, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b), min(len(got), len(ref)))
    return f"first differs at generated token {i}: got {got[i : i + 4]}..., cpu {ref[i : i + 4]}..."


# 5: a short prompt. 70: longer than a delta-net chunk (64) and the sliding windows (8, 16), so prefill takes
# the chunked / windowed batch path, and >= 32, so CPU experts stream through the GPU staging window.
@pytest.mark.parametrize("prompt_len", [5, 70])
@pytest.mark.parametrize("fixture", MOE_ARCHS)
def test_moe_archs_greedy_identical_across_placements(
    fixture: str, prompt_len: int, request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(fixture)[1]
    prompt = _prompt(prompt_len, prompt_len)
    ref = _greedy(path, prompt, device="cpu")
    failures: dict[str, str] = {}
    for name, flags in GPU_RUNS.items():
        try:
            got = _greedy(path, prompt, **flags)
        except Exception as e:  # every placement is tried; the message lists them all
            failures[name] = f"{type(e).__name__}: {e}"
            continue
        if got != ref:
            failures[name] = _first_difference(got, ref)
    assert not failures, f"{fixture}, prompt of {prompt_len}: greedy tokens differ from device=cpu ({ref}):\n" + (
        "\n".join(f"  {name}: {why}" for name, why in failures.items())
    )


@pytest.mark.parametrize("fixture", MOE_ARCHS)
def test_moe_archs_decode_is_captured(fixture: str, request: pytest.FixtureRequest) -> None:
    """Every one of these architectures gets a captured decode step on a GPU (recurrent layers included)."""
    path = request.getfixturevalue(fixture)[1]
    with tandem.LLM(path, device="cuda", cache_type="f32", dtype="f32", n_ctx=128) as llm:
        mixers = sorted({type(b.mixer).__name__ for b in llm.model.blocks})
        assert llm.engine.runner.capturable, f"{fixture}: no CUDA graph for the decode step (mixers: {mixers})"
        llm.generate_ids(_prompt(9, 1), max_tokens=4, temperature=0)
        assert llm.engine.runner.captured(1) is not None, f"{fixture}: the decode step was never captured"


def _chat_logits(path: Path, graphs: bool, flags: dict, chunks: bool = False) -> tuple[torch.Tensor, list[str]]:
    """Logits of a three-turn chat through Engine.feed / append: decode steps after each prompt; the second
    prompt diverges after the first one's recurrent checkpoint (restored), the third before it (back to the
    start). Returns the stacked logits and what went wrong with the engine's bookkeeping (nothing, normally);
    with `chunks`, that no prompt chunk was captured is one of those."""
    from tandem.layers.delta_net import DeltaNetState

    turn1 = _prompt(70, 6)
    script = [
        (turn1, _prompt(8, 7)),
        (turn1 + _prompt(5, 8), _prompt(8, 9)),
        (turn1[:10] + _prompt(20, 10), _prompt(6, 11)),
    ]
    problems: list[str] = []
    logits = []
    with tandem.LLM(path, cache_type="f32", dtype="f32", cuda_graphs=graphs, n_ctx=256, **flags) as llm:
        engine = llm.engine
        if graphs != engine.runner.capturable:
            problems.append(f"decode graphs {engine.runner.capturable}, asked for {graphs}")
        recurrent = [layer for layer in engine.cache.layers if isinstance(layer, DeltaNetState)]
        pointers = [(s.conv.data_ptr(), s.ssm.data_ptr()) for s in recurrent]
        for turn, (prompt, steps) in enumerate(script):
            # .cpu() copies: a graph's output buffer is overwritten by the next replay
            logits.append(engine.feed(prompt).float().cpu())
            for t in steps:
                logits.append(engine.append([t]).float().cpu())
            cache = engine.cache
            expected = prompt + steps
            if cache.tokens != expected or cache.length != len(expected):
                problems.append(f"turn {turn}: cache holds {cache.length} positions / {len(cache.tokens)} tokens")
            if any(s.length != cache.length for s in recurrent):
                problems.append(f"turn {turn}: recurrent lengths {[s.length for s in recurrent]} != {cache.length}")
            if [(s.conv.data_ptr(), s.ssm.data_ptr()) for s in recurrent] != pointers:
                problems.append(f"turn {turn}: a recurrent state tensor was reallocated (the graph writes the old one)")
            held = {t.device.type for _, snaps in cache.checkpoints for s in snaps for t in (s.conv, s.ssm)}
            if recurrent and held != {"cpu"}:  # in VRAM they would be outside the plan
                problems.append(f"turn {turn}: recurrent checkpoints on {sorted(held)}, not in host memory")
        if chunks and not engine.runner.captured_chunks():
            problems.append("no prompt chunk was captured")
    return torch.stack(logits), problems


@pytest.mark.parametrize("name", ["all-gpu", "cpu-moe"])
@pytest.mark.parametrize("fixture", MOE_ARCHS)
def test_graph_decode_logits_match_eager_across_turns(fixture: str, name: str, request: pytest.FixtureRequest) -> None:
    """Captured decode gives the logits of eager decode, step for step over a multi-turn chat whose turns restore
    a recurrent checkpoint or start over (the graph must read and write the live state), within f32 rounding."""
    path = request.getfixturevalue(fixture)[1]
    eager, eager_problems = _chat_logits(path, False, PLACEMENTS[name])
    graphed, graph_problems = _chat_logits(path, True, PLACEMENTS[name])
    assert not eager_problems and not graph_problems, {"eager": eager_problems, "graphs": graph_problems}
    diff = (graphed - eager).abs().amax(dim=-1)  # per step
    scale = eager.abs().max().item()
    print(f"{fixture} {name}: max|graph - eager| {diff.max().item():.2e} (logits up to {scale:.1f})")
    bad = [(i, f"{d:.2e}") for i, d in enumerate(diff.tolist()) if d > 1e-4 * max(scale, 1.0)]
    assert not bad, f"{fixture} {name}: captured decode differs from eager at (step, max|diff|) {bad}"


@pytest.mark.parametrize("fixture", ["tiny_qwen3moe_gguf", *MOE_ARCHS])
def test_captured_prompt_chunks_match_eager(fixture: str, request: pytest.FixtureRequest) -> None:
    """All on the GPU, prompt chunks of n_batch tokens are captured (per bound of the cache rows they read) and
    replayed: over the chat above with n_batch 16, chunks start at multiples of 16 and off them (after the
    third turn's truncation), sliding-window rings wrap, recurrent states are read and written by slot. Their
    logits are the eager steps', within f32 rounding; with CPU experts (host ops) no chunk is captured."""
    path = request.getfixturevalue(fixture)[1]
    eager, eager_problems = _chat_logits(path, False, {"n_batch": 16})
    graphed, graph_problems = _chat_logits(path, True, {"n_batch": 16}, chunks=True)
    assert not eager_problems and not graph_problems, {"eager": eager_problems, "graphs": graph_problems}
    diff = (graphed - eager).abs().amax(dim=-1)
    scale = eager.abs().max().item()
    print(f"{fixture}: max|captured chunks - eager| {diff.max().item():.2e} (logits up to {scale:.1f})")
    bad = [(i, f"{d:.2e}") for i, d in enumerate(diff.tolist()) if d > 1e-4 * max(scale, 1.0)]
    assert not bad, f"{fixture}: captured prompt chunks differ from eager at (step, max|diff|) {bad}"
    with tandem.LLM(path, device="cuda", cpu_moe=True, n_batch=16, n_ctx=128) as llm:
        for seed in range(3):
            llm.engine.feed(_prompt(40, seed))
        assert not llm.engine.runner.captured_chunks(), "a step with CPU experts (host ops) was captured"


@pytest.mark.parametrize("flags", [{"cpu_moe": True}, {"n_cpu_moe": 1}], ids=["cpu-moe", "n-cpu-moe-1"])
def test_vram_guarantee(tiny_qwen3moe_gguf: tuple[Path, Path], flags: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.weights.loader import WeightLoader

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


@pytest.mark.parametrize("fixture", ["tiny_gemma3_gguf", "tiny_gemma4_gguf"])
def test_tied_table_is_uploaded_once(fixture: str, request: pytest.FixtureRequest) -> None:
    """A model without `output.weight` reads its embedding table for the output head too: one copy in VRAM, as
    the plan counts it (two copies put Gemma 4 26B-A4B's --cpu-moe peak 578 MiB above its plan, 17:45)."""
    path = request.getfixturevalue(fixture)[1]
    with tandem.LLM(path, device="cuda", cpu_moe=fixture == "tiny_gemma4_gguf", n_ctx=128) as llm:
        assert "output.weight" not in llm.file.tensors
        table = llm.model.embed.data
        assert table.is_cuda and llm.model.output.weight.data.data_ptr() == table.data_ptr()


@pytest.mark.parametrize("fixture", ["tiny_gemma3_gguf", "tiny_gemma4_gguf", "tiny_gpt_oss_gguf"])
@pytest.mark.parametrize("graphs", [True, False], ids=["captured", "eager"])
def test_sliding_window_rings_on_the_gpu(
    fixture: str, graphs: bool, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU, sliding-window layers keep a ring of window + n_batch - 1 KV rows (layers/attention.py): with
    n_batch 5, prefill wraps the ring, decode steps (captured or eager) go past it, and going back to a shorter
    prefix (held, or recomputed from the start) give the logits of full caches on the same GPU, f32."""
    from tandem.layers import attention

    path = request.getfixturevalue(fixture)[1]
    ids = _prompt(80, 12)  # several windows (8, 16)
    opts = {"device": "cuda", "dtype": "f32", "cache_type": "f32", "n_batch": 5, "cuda_graphs": graphs}

    def run(llm: tandem.LLM) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        engine = llm.engine
        engine.reset()
        engine.feed(ids[:30])
        steps = torch.stack([engine.append([t]).float().cpu() for t in ids[30:60]])
        back = []
        for keep in (57, 12):  # 57: still in every ring; 12: overwritten, recomputed from the start
            back.append(engine.feed(ids[: keep + 1]).float().cpu())
            assert engine.cache.length == keep + 1
        return torch.from_numpy(llm.logits(ids)), steps, back

    monkeypatch.setattr(attention, "RING_DEVICE_TYPES", ())
    with tandem.LLM(path, **opts) as llm:
        assert all(kv.window is None for kv in llm.engine.cache.layers)
        full, full_steps, full_back = run(llm)
    monkeypatch.undo()
    with tandem.LLM(path, **opts) as llm:
        windows = {b.mixer.shape.sliding_window for b in llm.model.blocks} - {None}
        rows = {kv.rows for kv in llm.engine.cache.layers if kv.window is not None}
        assert windows and rows == {w + 4 for w in windows}, rows  # a ring on every sliding layer
        ring, ring_steps, ring_back = run(llm)
    torch.testing.assert_close(ring, full, atol=1e-5, rtol=0)
    torch.testing.assert_close(ring_steps, full_steps, atol=1e-5, rtol=0)
    for got, want in zip(ring_back, full_back, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["all-gpu", "cpu-moe"])
def test_sampling_on_the_gpu(tiny_qwen3moe_gguf: tuple[Path, Path], name: str) -> None:
    """`tandem run`'s default sampling (temperature 0.8, top-k, top-p, min-p, here with a repetition penalty)
    draws from logits on the GPU with a generator of that device (torch refuses a CPU generator there): it
    runs, and a seed gives the same tokens twice on the same computation. The cache is emptied before each run:
    a second run on the cached prompt computes its last token in the decode step instead of prefill, logits
    that differ by rounding (with CPU experts, by an 8-bit rounding of an activation now and then), which may
    move a draw (23:26, `cpu-moe`, the third token)."""
    path = tiny_qwen3moe_gguf[1]
    sampling = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.1}
    with tandem.LLM(path, n_ctx=256, **PLACEMENTS[name]) as llm:
        runs = []
        for _ in range(2):
            llm.engine.reset()
            runs.append(llm.generate_ids(_prompt(7, 3), max_tokens=12, seed=5, **sampling))
        vocab = llm.model.cfg.n_vocab
    assert runs[0] == runs[1], runs
    assert all(0 <= t < vocab for t in runs[0])


# -ot moves what the other flags cannot: a layer's attention projection (a HostLinear: a host op of the captured step
# that is not an expert), and the experts of the last layer only (--n-cpu-moe takes the first ones).
OVERRIDES = {
    "ot-attn-q": [r"blk\.0\.attn_q\.weight=cpu"],
    "ot-last-layer-exps": [r"blk\.1\.ffn_.*_exps=cpu"],
}


@pytest.mark.parametrize("graphs", [True, False], ids=["captured", "eager"])
@pytest.mark.parametrize("name", list(OVERRIDES))
def test_override_tensor_placements_greedy_identical(
    tiny_qwen3moe_gguf: tuple[Path, Path], name: str, graphs: bool
) -> None:
    """`-ot` placements on a GPU give device=cpu's greedy tokens (f32), with the decode step captured or not, and
    the overridden tensors are where the override put them."""
    path = tiny_qwen3moe_gguf[1]
    prompt = _prompt(40, 4)  # >= 32 tokens: the prefill streams what it can
    ref = _greedy(path, prompt, device="cpu")
    flags = {"device": "cuda", "override_tensor": OVERRIDES[name], "cuda_graphs": graphs}
    with tandem.LLM(path, cache_type="f32", dtype="f32", threads=4, n_ctx=512, **flags) as llm:
        patterns = [o.rsplit("=", 1)[0] for o in OVERRIDES[name]]
        matched = {n for n in llm.plan.devices if any(re.search(p, n) for p in patterns)}
        assert matched and all(llm.plan.devices[n] == "cpu" for n in matched), llm.plan.devices
        got = llm.generate_ids(prompt, max_tokens=16, temperature=0)
    assert got == ref, _first_difference(got, ref)
