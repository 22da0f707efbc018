"""The CPU step as ggml graphs (tandem.models.cpu_graph) against the layer-by-layer path (models/decoder.py).

On the bundled Gemma 3 270M the two give the same logits bit for bit (so llama.cpp's, tests/test_real_gemma3.py):
prompts whose Q6_K products take ggml's tiled kernel (8 rows or more), chunked prefill, contexts past the sliding
window, decode steps, and several sequences in one step; the paths take turns on one cache. On the tiny models the
graphs cover (gpt-oss's biases, sinks and YaRN included, Qwen3.5's and Qwen3-Next's delta-net and gated attention),
ggml's SwiGLU, GELU formula, routing and delta-net conv replace torch's: close, not equal.

Those tests hold the graph without flash attention (llama.cpp's `-fa off`, TANDEM_CPU_FLASH_ATTN=0), whose attention
is the layer path's; the flash-attention node, the graphs' default with an f16 cache, has its own below."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import ggml
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import tandem
from tandem.api import default_model_path
from tandem.errors import TandemError
from tandem.layers.moe import MoE
from tandem.models.cpu_graph import FLASH_ENV, StepGraph
from tandem.models.cpu_graph.coverage import unsupported
from tandem.runtime.sampling import Sampler, SamplingParams
from tandem.state.kv_cache import LayerKV
from tandem.synth.writer import synthesize


@pytest.fixture(scope="module", autouse=True)
def _attention_without_flash() -> Iterator[None]:
    """The graph of llama.cpp's `-fa off` for this module's models (read when their graphs are made); the
    flash-attention tests set the switch on themselves."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(FLASH_ENV, "0")
        yield


def _prompt(n: int, seed: int, n_vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [2] + torch.randint(3, n_vocab, (n - 1,), generator=g).tolist()


def _graphs(llm: tandem.LLM) -> StepGraph:
    graph = StepGraph.create(llm.model, llm.engine.pool, force=True)
    assert graph is not None, unsupported(llm.model, llm.engine.pool)
    return graph


def _run(llm: tandem.LLM, graph: StepGraph | None, prompt: list[int], n_decode: int) -> np.ndarray:
    """Logits after the prompt and after each of n_decode greedy tokens, from an empty slot 0."""
    llm.engine.runner.cpu_graph = graph
    llm.engine.reset()
    logits = llm.engine.append(prompt)
    out = [logits.numpy().copy()]
    for _ in range(n_decode):
        logits = llm.engine.append([int(torch.argmax(logits))])
        out.append(logits.numpy().copy())
    return np.stack(out)


@pytest.fixture(scope="module")
def gemma() -> Iterator[tuple[tandem.LLM, StepGraph]]:
    llm = tandem.LLM(default_model_path(), n_ctx=768, threads=2, n_batch=160, n_parallel=3)
    yield llm, _graphs(llm)
    llm.close()


@pytest.mark.parametrize("n_prompt, n_decode", [(5, 3), (12, 2), (41, 2), (600, 70)])
def test_bundled_gemma_graphs_equal_the_layer_path(gemma: tuple[tandem.LLM, StepGraph], n_prompt: int,
                                                   n_decode: int) -> None:  # fmt: skip
    """12 and 41 rows take ggml's tiled Q6_K kernel (5 rows and a decode step its dot product); 600 tokens are
    prefilled in chunks of 160 and decoded past the sliding window (512) and across KV_PAD boundaries."""
    llm, graph = gemma
    prompt = _prompt(n_prompt, n_prompt, llm.config.n_vocab)
    ours = _run(llm, graph, prompt, n_decode)
    ref = _run(llm, None, prompt, n_decode)
    assert np.array_equal(ours, ref), f"max |diff| {np.abs(ours - ref).max()}"


def test_a_context_that_is_no_multiple_of_the_padding_reads_to_its_end() -> None:
    """n_ctx 100: the last positions' padded views (128 keys) read past the pool's rows into its tail, masked;
    the graphs equal the layer path up to the full context."""
    with tandem.LLM(default_model_path(), n_ctx=100, threads=2, n_batch=64) as llm:
        prompt = _prompt(90, 7, llm.config.n_vocab)
        ours, ref = _run(llm, _graphs(llm), prompt, 9), _run(llm, None, prompt, 9)
    assert np.array_equal(ours, ref), f"max |diff| {np.abs(ours - ref).max()}"


def test_flash_attention_reads_to_the_end_of_a_short_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """With flash attention the views are 256-cell multiples: at n_ctx 100 the node reads 256 rows, past the pool's
    rows into its tail (masked), up to the full context: the logits those of a context with room, bit for bit."""
    monkeypatch.setenv(FLASH_ENV, "1")
    runs = []
    for n_ctx in (100, 512):
        with tandem.LLM(default_model_path(), n_ctx=n_ctx, threads=2, n_batch=64) as llm:
            graph = _graphs(llm)
            assert graph.flash and graph.caches[0].rows == n_ctx
            runs.append(_run(llm, graph, _prompt(90, 7, llm.config.n_vocab), 9))
    assert np.array_equal(runs[0], runs[1])


def test_flash_graphs_leave_the_layer_paths_transposed_values_right(monkeypatch: pytest.MonkeyPatch) -> None:
    """With flash attention the graphs write the rows alone, not the values transposed beside them: where the layer
    path had transposed positions that a shorter sequence then rewrites through the graphs, the truncation makes
    it transpose them again (LayerKV.forget), so its next read holds the rows' values."""
    monkeypatch.setenv(FLASH_ENV, "1")
    with tandem.LLM(default_model_path(), n_ctx=128, threads=2) as llm:
        graph, engine = _graphs(llm), llm.engine
        assert graph.flash
        engine.runner.cpu_graph = None  # the layer path: 40 positions, their values transposed as it reads them
        engine.reset()
        engine.feed(_prompt(40, 1, llm.config.n_vocab))
        engine.pool.caches[0].truncate(20)
        engine.runner.cpu_graph = graph  # positions 20.. written again through the graphs
        engine.feed(_prompt(30, 2, llm.config.n_vocab)[1:])
        kvs = [layer for layer in engine.pool.caches[0].layers if isinstance(layer, LayerKV)]
        assert kvs
        for kv in kvs:
            _, vt = kv.attention_rows(49, 64)
            assert torch.equal(vt[..., :49], kv.v[:49].permute(1, 2, 0))


def test_paths_take_turns_on_one_cache(gemma: tuple[tandem.LLM, StepGraph]) -> None:
    """Each path continues what the other wrote into the slot (the f16 rows and their float32 copies): the same
    logits as the layer path alone over the same pieces (the pieces, not one chunk: where the activation rows are
    not a multiple of 4, ggml's AVX2 repacked Q4_K product takes its one-row kernel for the last ones, which adds
    in another order than its four-row one)."""
    llm, graph = gemma
    prompt = _prompt(90, 7, llm.config.n_vocab)
    engine = llm.engine
    runs = []
    for turns in (True, False):
        engine.reset()
        out = []
        for i, piece in enumerate([prompt[:50], prompt[50:], *([None] * 6)]):
            engine.runner.cpu_graph = graph if turns and i % 2 == 0 else None
            logits = engine.append(piece if piece is not None else [int(np.argmax(out[-1]))])
            if i >= 1:
                out.append(logits.numpy().copy())
        runs.append(np.stack(out))
    assert np.array_equal(runs[0], runs[1])


def test_several_sequences_in_one_step(gemma: tuple[tandem.LLM, StepGraph]) -> None:
    """Three requests through the engine together (prefill chunks beside decodes, slots joining late) give each
    the greedy tokens of the layer path alone."""
    llm, graph = gemma
    engine = llm.engine
    requests = [(_prompt(n, n, llm.config.n_vocab), k) for n, k in ((9, 8), (200, 5), (3, 10))]
    alone = []
    for prompt, k in requests:
        engine.runner.cpu_graph = None
        for slot in engine.pool.caches:
            slot.truncate(0)
        alone.append(llm.generate_ids(prompt, max_tokens=k, temperature=0))
    for slot in engine.pool.caches:
        slot.truncate(0)
    engine.runner.cpu_graph = graph
    seqs = []
    for step in range(40):
        if step in (0, 1, 3):
            prompt, k = requests[len(seqs)]
            seqs.append(engine.add_request(prompt, Sampler(SamplingParams(temperature=0.0)), k, llm.tokenizer.stop_ids))
        if not engine.has_work:
            break
        engine.step()
    assert [s.tokens[len(p) :] for s, (p, _) in zip(seqs, requests, strict=True)] == alone


@pytest.mark.parametrize("model, lengths, cache_type", [
    ("bundled", (600, 40, 450, 500), "f16"),
    ("tiny_gemma3_gguf", (100, 10, 70, 80), "f16"),  # sliding window 16
    ("tiny_qwen3moe_gguf", (100, 10, 70, 80), "f16"),  # grouped-query heads
    ("tiny_qwen3moe_gguf", (100, 10, 70, 80), "f32"),
    ("tiny_gpt_oss_gguf", (100, 10, 70, 80), "f16"),  # sinks, biases, sliding window
    ("tiny_gemma4_q8_0_gguf", (100, 10, 70, 80), "f16"),  # two head sizes, values = keys, value norms
])  # fmt: skip
def test_decoding_sequences_attend_as_one_group(model: str, lengths: tuple[int, ...], cache_type: str,
                                                request: pytest.FixtureRequest,
                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The decoding sequences of a step attend together (`DecodeGroup`: one product over the slots side by side)
    with the logits of each one's own attention, bit for bit: one past the sliding window, a slot of the range
    prefilling beside them, then all four decoding."""
    from tandem.models.cpu_graph import decoder, step

    path = default_model_path() if model == "bundled" else Path(request.getfixturevalue(model)[1])
    chunk = 160
    with tandem.LLM(path, device="cpu", n_ctx=768, threads=2, n_batch=chunk, n_parallel=4,
                    cache_type=cache_type) as llm:  # fmt: skip
        prompts = [_prompt(n + 12, n, llm.config.n_vocab) for n in lengths]

        def run(graph: StepGraph) -> list[np.ndarray]:
            for slot, n in enumerate(lengths):
                for start in range(0, n, chunk):
                    graph.run([(slot, start, prompts[slot][start : min(n, start + chunk)])])
            first = [(slot, n, prompts[slot][n : n + (8 if slot == 1 else 1)]) for slot, n in enumerate(lengths)]
            steps = [first]  # slot 1 takes a prompt chunk while the others decode
            steps += [[(slot, n + (8 if slot == 1 else 1) + i, [prompts[slot][n + (8 if slot == 1 else 1) + i]])
                       for slot, n in enumerate(lengths)] for i in range(3)]  # fmt: skip
            return [graph.run(pieces).numpy().copy() for pieces in steps]

        groups = []

        def counted(key: step.StepKey) -> step.DecodeGroup | None:
            group = decode_group(key)
            groups.append(group)
            return group

        decode_group = step.decode_group
        for module in (step, decoder):  # the step's key and its program read it
            monkeypatch.setattr(module, "decode_group", counted)
        grouped = run(_graphs(llm))
        used = [(len(g.members), g.n_slots) for g in groups if g is not None]
        assert (3, 4) in used and (4, 4) in used, used
        for module in (step, decoder):
            monkeypatch.setattr(module, "decode_group", lambda key: None)
        alone = run(_graphs(llm))
    for a, b in zip(grouped, alone, strict=True):
        assert np.array_equal(a, b), f"max |diff| {np.abs(a - b).max()}"


def test_one_long_context_keeps_its_own_attention() -> None:
    """A group whose slot range and key span would compute far more keys than its members read is not made."""
    from tandem.models.cpu_graph.step import decode_group, step_key

    windows = [None]
    short = step_key([(0, 40, [1]), (1, 50, [1])], windows)
    group = decode_group(short)
    assert group is not None and (group.lo, group.n_slots, group.views) == (0, 2, ((0, 64),))
    assert decode_group(step_key([(0, 4000, [1]), (1, 50, [1]), (2, 30, [1])], windows)) is None
    assert decode_group(step_key([(0, 40, [1]), (5, 50, [1])], windows)) is None  # four idle slots between
    assert decode_group(step_key([(0, 40, [1]), (1, 0, [1, 2, 3])], windows)) is None  # one decoding sequence


def test_a_group_keeps_its_program_while_its_members_move() -> None:
    """A decode group's step shape is its span, not its members' own views: the steps of sequences that move inside
    the same keys share one program, a member crossing the span's end makes another."""
    from tandem.models.cpu_graph.step import step_key

    windows = [None, 16]
    key = step_key([(0, 70, [1]), (1, 100, [1]), (2, 20, [1])], windows)
    assert key == step_key([(0, 71, [1]), (1, 110, [1]), (2, 63, [1])], windows)
    assert key != step_key([(0, 71, [1]), (1, 128, [1]), (2, 63, [1])], windows)  # 128: the keys past 127
    assert key.seqs[2].blocks[0].views == ((0, 128), (0, 128))  # the group's span, a member's view within it


@pytest.mark.parametrize("cache_type", ["f16", "f32"])
@pytest.mark.parametrize("fixture", ["tiny_qwen3_gguf", "tiny_qwen3moe_gguf", "tiny_gemma3_gguf", "tiny_gpt_oss_gguf",
                                     "tiny_qwen35moe_gguf", "tiny_qwen3next_gguf"])  # fmt: skip
def test_tiny_models_close_to_the_layer_path(fixture: str, cache_type: str, request: pytest.FixtureRequest) -> None:
    """The graphs' SwiGLU, GELU formula and routing are ggml's ops, the layer path's torch's: close, not equal.
    (Gemma 4 is checked against llama.cpp instead, tests/test_gpt_oss_gemma4.py: on its Q8_0 file an attention
    output one float32 rounding away moves a Q8_0 activation code, ~1e-3 in the next product, between any two
    orders of summation: the layer path's prompt rows against its own decode steps too.)"""
    _, path = request.getfixturevalue(fixture)
    with tandem.LLM(Path(path), device="cpu", n_ctx=256, threads=2, n_batch=32, cache_type=cache_type) as llm:
        graph = _graphs(llm)
        prompt = _prompt(70, 3, llm.config.n_vocab)
        ours, ref = _run(llm, graph, prompt, 8), _run(llm, None, prompt, 8)
        np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=0)
        assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("cache_type", ["f16", "f32"])
@pytest.mark.parametrize("fixture", ["tiny_qwen3_gguf", "tiny_qwen3moe_gguf", "tiny_gemma3_gguf", "tiny_gpt_oss_gguf",
                                     "tiny_qwen35moe_gguf", "tiny_qwen3next_gguf"])  # fmt: skip
def test_flash_attention_close_to_the_layer_path(
    fixture: str, cache_type: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TANDEM_CPU_FLASH_ATTN=1: ggml's flash-attention node (f16 keys and values, an f32 cache's cast as llama.cpp
    casts them; sinks, sliding windows, gated queries) close to the layer path's attention without it, greedy
    tokens the same, over prompt chunks (-b 32) and decode steps. Its kernel sums the weighted values in f16 (as
    llama.cpp's does, VKQ16: each step rounds to 11 bits), where the layer path's product sums in float32: the
    tiny models' logits move by up to ~3e-3 (the bundled Gemma 3's equal llama.cpp's: test_real_gemma3.py)."""
    _, path = request.getfixturevalue(fixture)
    monkeypatch.setenv(FLASH_ENV, "1")
    with tandem.LLM(Path(path), device="cpu", n_ctx=256, threads=2, n_batch=32, cache_type=cache_type) as llm:
        graph = _graphs(llm)
        assert graph.flash
        prompt = _prompt(70, 3, llm.config.n_vocab)
        ours, ref = _run(llm, graph, prompt, 8), _run(llm, None, prompt, 8)
        np.testing.assert_allclose(ours, ref, atol=5e-3, rtol=0)
        assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize(("setting", "f16", "f32"), [("", True, False), ("auto", True, False), ("on", True, True),
                                                    ("1", True, True), ("off", False, False), ("0", False, False)])
def test_flash_attention_by_default_with_an_f16_cache(
    tiny_qwen3_gguf: tuple[Path, Path], setting: str, f16: bool, f32: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unset or auto, the graphs compute attention as llama.cpp's CPU default (`-fa auto`: on) with an f16 cache,
    and in float32 with an f32 one (llama.cpp's flash attention casts it to f16); on and off force it."""
    monkeypatch.setenv(FLASH_ENV, setting)
    for cache_type, expected in (("f16", f16), ("f32", f32)):
        with tandem.LLM(tiny_qwen3_gguf[1], device="cpu", n_ctx=64, threads=2, cache_type=cache_type) as llm:
            assert _graphs(llm).flash is expected, (setting, cache_type)


def test_a_bad_flash_attention_setting_is_a_clear_error(
    tiny_qwen3_gguf: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FLASH_ENV, "maybe")
    with pytest.raises(TandemError, match="TANDEM_CPU_FLASH_ATTN='maybe': expected auto, on"):
        tandem.LLM(tiny_qwen3_gguf[1], device="cpu", n_ctx=64, threads=2)


def test_flash_views_are_llamacpp_cells_then_the_window() -> None:
    """A flash-attention node reads llama.cpp's view of its cache, the cells up to the last used one in multiples of
    256, from position 0; a sliding layer's, once its keys pass llama.cpp's ring (n_swa + n_ubatch cells), those of
    its window only, as many as the ring holds rather than every key since position 0."""
    from tandem.models.cpu_graph.step import sliding_ring, step_key

    windows = [None, 512]
    rings = [sliding_ring(w, 4096, 512) for w in windows]
    assert rings == [None, 1024] and sliding_ring(512, 700, 512) == 768  # at most the context
    early = step_key([(0, 512, list(range(512)))], windows, flash=True, rings=rings)
    assert early.seqs[0].blocks[0].views == ((0, 1024), (0, 1024))
    late = step_key([(0, 2560, list(range(440)))], windows, flash=True, rings=rings)
    assert late.seqs[0].blocks[0].views == ((0, 3072), (2048, 1024))  # keys 2049..2999 of 2560..2999's windows
    decode = step_key([(0, 3000, [1])], windows, flash=True, rings=rings)
    assert decode.seqs[0].blocks[0].views == ((0, 3072), (2304, 768))
    assert step_key([(0, 3000, [1])], windows, flash=True).seqs[0].blocks[0].views == ((0, 3072), (0, 3072))


@pytest.mark.parametrize("fixture", ["tiny_gemma3_gguf", "tiny_gpt_oss_gguf"])
def test_flash_attention_past_the_ring_close_to_the_layer_path(
    fixture: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sliding layers past llama.cpp's ring (window + -b cells, here 256) read their window's keys: a 300-token
    prompt in chunks of 32 and decode steps after it stay as close to the layer path as short prompts do."""
    _, path = request.getfixturevalue(fixture)
    monkeypatch.setenv(FLASH_ENV, "1")
    with tandem.LLM(Path(path), device="cpu", n_ctx=512, threads=2, n_batch=32) as llm:
        graph = _graphs(llm)
        assert graph.flash and any(r == 256 for r in graph.rings)
        prompt = _prompt(300, 5, llm.config.n_vocab)
        ours, ref = _run(llm, graph, prompt, 8), _run(llm, None, prompt, 8)
        np.testing.assert_allclose(ours, ref, atol=5e-3, rtol=0)
        assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_flash_attention_of_a_sequence_is_the_same_in_a_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """With flash attention each sequence attends in a node of its own (no decode group): its logits in a step
    beside others, prefilling or decoding, are those of its steps alone, bit for bit."""
    monkeypatch.setenv(FLASH_ENV, "1")
    with tandem.LLM(default_model_path(), n_ctx=512, threads=2, n_parallel=3) as llm:
        graph = llm.engine.runner.cpu_graph
        assert graph is not None and graph.flash
        prompts = [_prompt(n, seed, llm.config.n_vocab) for n, seed in ((9, 1), (300, 2), (40, 3))]
        alone = []
        for slot, prompt in enumerate(prompts):
            first = graph.run([(slot, 0, prompt)]).numpy().copy()
            alone.append([first, graph.run([(slot, len(prompt), [7])]).numpy().copy()])
        together = graph.run([(s, 0, p) for s, p in enumerate(prompts)]).numpy()
        decoding = graph.run([(s, len(p), [7]) for s, p in enumerate(prompts)]).numpy()
        for j in range(3):
            assert np.array_equal(together[j], alone[j][0][0]) and np.array_equal(decoding[j], alone[j][1][0])


def test_uncovered_models_keep_the_layer_path(tiny_gemma4_gguf: tuple[Path, Path]) -> None:
    """A float Gemma 4's GEGLU experts compute transformers' tanh formula, which no ggml op does."""
    with tandem.LLM(Path(tiny_gemma4_gguf[1]), device="cpu", n_ctx=64, threads=2) as llm:
        assert unsupported(llm.model, llm.engine.pool) is not None
        assert StepGraph.create(llm.model, llm.engine.pool, force=True) is None
        assert llm.engine.runner.cpu_graph is None


@pytest.fixture(scope="module")
def synth_qwen3moe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A 1-layer synthetic Qwen3-30B-A3B: Q4_K expert stacks of the real shapes (128 experts, top-8); 0.8 GB of disk,
    given back when the module is done."""
    path = synthesize("qwen3-30b-a3b", tmp_path_factory.mktemp("graph-moe") / "q.gguf", layers=1, fill="random").path
    yield path
    path.unlink(missing_ok=True)


@pytest.mark.parametrize("repack", [None, False])
def test_graphs_multiply_the_experts_the_loader_holds(synth_qwen3moe: Path, repack: bool | None) -> None:
    """As llama.cpp's CPU backend holds a CPU-only model's experts: by default the loader copies the Q4_K stacks
    into ggml's repacked layout and the graphs read those copies (no second one); with --no-repack-experts both read
    the file's blocks. Either way the graphs' logits are the layer path's with the same stacks (the same kernels) up
    to the graphs' own routing and SwiGLU ops."""
    if not ggml.ggml_cpu_has_avx2():
        pytest.skip("ggml repacks Q4_K only with AVX2")
    prompt = [2, 300, 1000, 77, 5, 4096, 12, 9000, 31, 64, 128, 7]
    with tandem.LLM(synth_qwen3moe, device="cpu", n_ctx=64, threads=2, repack_experts=repack) as llm:
        ref = _run(llm, None, prompt, 3)
        graph = _graphs(llm)
        moe = llm.model.blocks[0].ffn
        assert isinstance(moe, MoE)
        layer_ffn, graph_ffn = moe.experts._graph[1], graph.experts[id(moe)]  # type: ignore[union-attr]
        for stack in ("gate", "up", "down"):  # gate and up Q4_K; down Q4_K or Q6_K (not repacked on x86)
            w = getattr(layer_ffn, stack)
            assert getattr(graph_ffn, stack) is w, stack
            assert (w.repacked is not None) == (repack is None and w.qtype == Q.Q4_K), stack
        ours = _run(llm, graph, prompt, 3)
    scale = float(np.abs(ref).max())
    np.testing.assert_allclose(ours, ref, atol=1e-4 * scale, rtol=0)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_a_long_prompt_step_builds_past_a_fixed_graph_size(tiny_qwen3moe_gguf: tuple[Path, Path]) -> None:
    """A prompt step's graph grows with its blocks of query rows: a 48-layer Qwen3-30B-A3B at -b 1024 needed ~13,000
    nodes, past the 8,192 that a step's graph held before (ggml aborts the process there). Built, not run: the
    tiny model with a prompt of 30,000 rows needs as many."""
    from tandem.models.cpu_graph import decoder, step

    with tandem.LLM(Path(tiny_qwen3moe_gguf[1]), device="cpu", n_ctx=30_720, threads=2, n_batch=30_000) as llm:
        graph = _graphs(llm)
        key = step.step_key([(0, 0, [5] * 30_000)], step.layer_windows(llm.model))
        program = decoder.build_step(llm.model, graph.caches, key, graph.experts, graph.runner.kernels.n_threads)
        nodes = ggml.ggml_graph_n_nodes(program.program.graph)
    assert nodes > 8192, nodes
