"""The serving engine (runtime/engine.py): sequences advanced together in one state pool give each sequence the
tokens it gets alone, whatever joins or leaves beside it; the scheduler's chunked prefill, slots and aborts.

On the CPU here (CI); `pytest -m gpu` runs the same checks on the GPU, where decode steps are pooled and captured
per batch size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tandem
from tandem.runtime.engine import Engine
from tandem.runtime.sampling import Sampler, SamplingParams
from tandem.runtime.sequence import Sequence

FAMILIES = [
    "tiny_qwen3_gguf",
    "tiny_gemma3_gguf",
    "tiny_qwen3moe_gguf",
    "tiny_qwen35moe_gguf",
    "tiny_qwen3next_gguf",
    "tiny_gpt_oss_gguf",
    "tiny_gemma4_gguf",
]
DENSE = ("tiny_qwen3_gguf", "tiny_gemma3_gguf")  # no routed experts: --cpu-moe is refused
# (prompt length, tokens to generate, step at which the request arrives): short and long prompts (past the
# tiny models' sliding window of 16 and a delta-net chunk of 64), sequences joining while others decode and
# leaving at different times.
REQUESTS = [(5, 12, 0), (70, 6, 0), (23, 9, 2), (1, 10, 5), (40, 4, 7)]
RUNS = {"cpu": {"device": "cpu"}}
GPU_RUNS = {
    "all-gpu": {"device": "cuda", "dtype": "f32"},
    "cpu-moe": {"device": "cuda", "dtype": "f32", "cpu_moe": True},
    "all-gpu-eager": {"device": "cuda", "dtype": "f32", "cuda_graphs": False},
}


def _prompt(n: int, seed: int, n_vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, n_vocab, (n,), generator=g).tolist()


def _greedy() -> Sampler:
    return Sampler(SamplingParams(temperature=0.0))


def _run_batched(llm: tandem.LLM, requests: list[tuple[list[int], int, int]], sampler=_greedy) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Every request through one engine, each added at its step; the tokens of each."""
    engine = llm.engine
    pending = sorted(range(len(requests)), key=lambda i: requests[i][2])
    seqs: dict[int, Sequence] = {}
    step = 0
    most_running = 0
    while pending or engine.has_work:
        while pending and requests[pending[0]][2] <= step:
            i = pending.pop(0)
            prompt, n, _ = requests[i]
            seqs[i] = engine.add_request(prompt, sampler(), n, llm.tokenizer.stop_ids)
        engine.step()
        most_running = max(most_running, len(engine.scheduler.running))
        step += 1
        assert step < 1000, "the engine does not finish"
    assert most_running > 1, "the requests never ran side by side"
    assert all(s.finished for s in seqs.values())
    return [seqs[i].output for i in range(len(requests))]


def _run_alone(llm: tandem.LLM, requests: list[tuple[list[int], int, int]], sampler=_greedy) -> list[list[int]]:  # type: ignore[no-untyped-def]
    out = []
    for prompt, n, _ in requests:
        llm.engine.reset()
        seq = llm.engine.add_request(prompt, sampler(), n, llm.tokenizer.stop_ids)
        out.append(list(llm.engine.generate(seq)))
    return out


def _requests(llm: tandem.LLM) -> list[tuple[list[int], int, int]]:
    n_vocab = llm.tokenizer.n_vocab
    return [(_prompt(n, 100 + i, n_vocab), max_tokens, at) for i, (n, max_tokens, at) in enumerate(REQUESTS)]


def _check_batch_equals_alone(path: Path, flags: dict) -> None:
    with tandem.LLM(path, cache_type="f32", threads=2, n_ctx=128, n_batch=32, n_parallel=3, **flags) as llm:
        requests = _requests(llm)
        batched = _run_batched(llm, requests)
    with tandem.LLM(path, cache_type="f32", threads=2, n_ctx=128, n_batch=32, **flags) as llm:
        alone = _run_alone(llm, requests)
    assert batched == alone
    assert [len(t) for t in alone] != [0] * len(alone)


@pytest.mark.parametrize("fixture", FAMILIES)
def test_batched_greedy_equals_alone(fixture: str, request: pytest.FixtureRequest) -> None:
    """Five requests over three slots (two wait for a slot), with prefill chunks of 32 tokens beside the decoding
    sequences: each sequence's greedy tokens are those it gets alone (f32)."""
    _check_batch_equals_alone(request.getfixturevalue(fixture)[1], RUNS["cpu"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run with -m gpu on the device)")
@pytest.mark.parametrize(
    ("fixture", "run"),
    [(f, r) for f in FAMILIES for r in GPU_RUNS if "cpu_moe" not in GPU_RUNS[r] or f not in DENSE],
)
def test_gpu_batched_greedy_equals_alone(fixture: str, run: str, request: pytest.FixtureRequest) -> None:
    """The same on the GPU: pooled decode steps (captured per batch size, or eager), CPU experts for every token
    of the step at once with --cpu-moe."""
    _check_batch_equals_alone(request.getfixturevalue(fixture)[1], GPU_RUNS[run])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run with -m gpu on the device)")
@pytest.mark.parametrize("fixture", ["tiny_qwen3moe_gguf", "tiny_gemma4_gguf"])
def test_gpu_largest_decode_graph_with_cpu_experts(fixture: str, request: pytest.FixtureRequest) -> None:
    """20 sequences decoding at once with --cpu-moe: the step is padded to the 32-row graph, whose CPU experts are
    one host op of 32 rows (a decode step never streams the experts: that reads the routing on the host, which a
    captured step cannot); each sequence's tokens are those it gets alone."""
    path = request.getfixturevalue(fixture)[1]
    flags = dict(device="cuda", dtype="f32", cpu_moe=True, cache_type="f32", threads=2, n_ctx=64, n_batch=64)
    with tandem.LLM(path, n_parallel=20, **flags) as llm:
        n_vocab = llm.tokenizer.n_vocab
        requests = [(_prompt(3 + i % 5, 300 + i, n_vocab), 6, 0) for i in range(20)]
        batched = _run_batched(llm, requests)
        assert llm.engine.runner.captured(32) is not None, "the 32-row decode graph never ran"
    with tandem.LLM(path, **flags) as llm:
        alone = _run_alone(llm, requests)
    assert batched == alone


def test_seeded_sampling_is_reproducible_per_request(tiny_qwen3moe_gguf: tuple[Path, Path]) -> None:
    """A request's seed gives it the same tokens in a batch as alone, whatever the others draw."""
    path = tiny_qwen3moe_gguf[1]

    def seeded() -> Sampler:
        seeded.count += 1  # type: ignore[attr-defined]
        return Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1000 + seeded.count))  # type: ignore[attr-defined]

    with tandem.LLM(path, device="cpu", cache_type="f32", threads=2, n_ctx=128, n_batch=32, n_parallel=3) as llm:
        requests = _requests(llm)
        seeded.count = 0  # type: ignore[attr-defined]
        batched = _run_batched(llm, requests, seeded)
        seeded.count = 0  # type: ignore[attr-defined]
        alone = _run_alone(llm, requests, seeded)
    assert batched == alone


def _recorded_runs(engine: Engine) -> list[list[tuple[int, int]]]:
    """Each run of the engine's runner from now on, as (slot, tokens) per piece."""
    runs: list[list[tuple[int, int]]] = []
    run = engine.runner.run

    def recorded(pieces, all_logits=False):  # type: ignore[no-untyped-def]
        runs.append([(slot, len(tokens)) for slot, tokens in pieces])
        return run(pieces, all_logits)

    engine.runner.run = recorded  # type: ignore[method-assign]
    return runs


def test_prefill_is_chunked_beside_decode(tiny_qwen3moe_gguf: tuple[Path, Path]) -> None:
    """A long prompt arriving while another sequence decodes is computed in chunks within the step's token budget,
    and the decoding sequence advances in every one of those steps."""
    with tandem.LLM(tiny_qwen3moe_gguf[1], device="cpu", threads=2, n_ctx=256, n_batch=16, n_parallel=2) as llm:
        engine, n_vocab = llm.engine, llm.tokenizer.n_vocab
        steps = _recorded_runs(engine)
        first = engine.add_request(_prompt(4, 1, n_vocab), _greedy(), 40, frozenset())
        engine.step()
        engine.step()
        long = engine.add_request(_prompt(100, 2, n_vocab), _greedy(), 3, frozenset())
        steps.clear()
        while not long.output:
            engine.step()
        assert len(steps) >= 100 // 15, steps
        for pieces in steps:
            assert sum(n for _, n in pieces) <= 16, pieces
            assert (first.slot, 1) in pieces, "the decoding sequence waited for the prefill"
        assert sum(n for pieces in steps for slot, n in pieces if slot == long.slot) == 100


def test_a_step_of_b_tokens_runs_in_pieces_of_ub(tiny_qwen3moe_gguf: tuple[Path, Path]) -> None:
    """-b 64 -ub 16 (n_batch, n_ubatch), as llama.cpp's logical and physical batches: three prompts that arrive
    together are computed in one step, in runs of at most 16 tokens (a prompt split between runs goes on in the
    next), and their first tokens come out of that step together; with -b 16 they come one step after another.
    Each sequence's greedy tokens are those it gets alone (f32)."""
    path = tiny_qwen3moe_gguf[1]
    flags = dict(device="cpu", cache_type="f32", threads=2, n_ctx=128, n_parallel=3)
    with tandem.LLM(path, n_batch=64, n_ubatch=16, **flags) as llm:  # type: ignore[arg-type]
        engine, n_vocab = llm.engine, llm.tokenizer.n_vocab
        prompts = [_prompt(n, 40 + n, n_vocab) for n in (10, 23, 17)]
        runs = _recorded_runs(engine)
        seqs = [engine.add_request(prompt, _greedy(), 6, frozenset()) for prompt in prompts]
        first_step = engine.step()
        assert sorted(o.seq.id for o in first_step) == sorted(s.id for s in seqs)  # every first token at once
        assert [sum(n for _, n in r) for r in runs] == [16, 16, 16, 2], runs  # 50 prompt tokens in runs of <= 16
        while engine.has_work:
            engine.step()
        assert all(sum(n for _, n in r) <= 16 for r in runs)
        batched = [s.output for s in seqs]
    with tandem.LLM(path, n_batch=16, **flags) as llm:  # type: ignore[arg-type]
        engine = llm.engine
        seqs = [engine.add_request(prompt, _greedy(), 6, frozenset()) for prompt in prompts]
        assert len(engine.step()) <= 1  # a 16-token budget: one prompt's first token at most
        for seq in seqs:
            engine.abort(seq)
        alone = _run_alone(llm, [(prompt, 6, 0) for prompt in prompts])
    assert batched == alone and all(len(t) == 6 for t in alone)


def _prompts_of_a_run_each(llm: tandem.LLM) -> tuple[list[list[int]], list[list[int]]]:
    """Three prompts of exactly -ub tokens that arrive together, under -b 3 x -ub: each is one run of the step and
    ends in it (on a GPU without host ops, each run is the same captured prompt-chunk graph). Their greedy tokens
    in that step's engine, and alone."""
    engine, n_vocab = llm.engine, llm.tokenizer.n_vocab
    prompts = [_prompt(16, 70 + i, n_vocab) for i in range(3)]
    seqs = [engine.add_request(prompt, _greedy(), 5, frozenset()) for prompt in prompts]
    while engine.has_work:
        engine.step()
    return [s.output for s in seqs], _run_alone(llm, [(prompt, 5, 0) for prompt in prompts])


def test_each_run_of_a_step_keeps_its_own_logits(tiny_qwen3moe_gguf: tuple[Path, Path]) -> None:
    """A step's runs whose logits come back in one buffer that the next run rewrites (as a replayed graph's output
    does): each prompt still gets its own first token."""
    flags = dict(device="cpu", cache_type="f32", threads=2, n_ctx=64, n_batch=48, n_ubatch=16, n_parallel=3)
    with tandem.LLM(tiny_qwen3moe_gguf[1], **flags) as llm:  # type: ignore[arg-type]
        run = llm.engine.runner.run
        shared: dict[tuple[int, ...], torch.Tensor] = {}

        def replayed(pieces, all_logits=False):  # type: ignore[no-untyped-def]
            logits = run(pieces, all_logits)
            out = shared.setdefault(tuple(logits.shape), torch.empty_like(logits))
            return out.copy_(logits)

        llm.engine.runner.run = replayed  # type: ignore[method-assign]
        batched, alone = _prompts_of_a_run_each(llm)
    assert batched == alone and all(len(t) == 5 for t in alone)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run with -m gpu on the device)")
def test_gpu_prompt_chunk_graphs_of_one_step(tiny_qwen3_gguf: tuple[Path, Path]) -> None:
    """The same with the captured prompt-chunk graph (every weight in VRAM) run three times in one step."""
    flags = dict(device="cuda", dtype="f32", cache_type="f32", threads=2, n_ctx=64, n_batch=48, n_ubatch=16)
    with tandem.LLM(tiny_qwen3_gguf[1], n_parallel=3, **flags) as llm:  # type: ignore[arg-type]
        batched, alone = _prompts_of_a_run_each(llm)
        assert llm.engine.runner.captured_chunks(), "no prompt chunk was captured"
    assert batched == alone and all(len(t) == 5 for t in alone)


def test_abort_frees_the_slot_and_reuses_the_prefix(tiny_qwen3moe_gguf: tuple[Path, Path]) -> None:
    """An aborted sequence's slot takes the next request; a request that starts with a finished sequence's tokens
    gets that slot and computes only the rest (the next turn of a chat)."""
    with tandem.LLM(tiny_qwen3moe_gguf[1], device="cpu", threads=2, n_ctx=128, n_parallel=2) as llm:
        engine, n_vocab = llm.engine, llm.tokenizer.n_vocab
        a = engine.add_request(_prompt(12, 3, n_vocab), _greedy(), 50, frozenset())
        b = engine.add_request(_prompt(9, 4, n_vocab), _greedy(), 5, frozenset())
        for _ in range(3):
            engine.step()
        engine.abort(a)
        assert a.finish_reason == "abort" and a not in engine.scheduler.running
        while not b.finished:
            engine.step()
        assert b.finish_reason == "length" and len(b.output) == 5
        turn2 = b.tokens + _prompt(6, 5, n_vocab)
        c = engine.add_request(turn2, _greedy(), 2, frozenset())
        work = engine.scheduler.schedule()
        assert c.slot == b.slot
        (piece,) = [w for w in work if w.seq is c]
        assert len(piece.tokens) == len(turn2) - (len(b.tokens) - 1), "the cached prefix was recomputed"


def test_requests_past_the_context_are_refused(tiny_qwen3moe_gguf: tuple[Path, Path]) -> None:
    with tandem.LLM(tiny_qwen3moe_gguf[1], device="cpu", threads=2, n_ctx=16, n_parallel=2) as llm:
        with pytest.raises(tandem.TandemError, match="context size 16"):
            llm.engine.add_request(list(range(3, 20)), _greedy(), 1, frozenset())
        seq = llm.engine.add_request(list(range(3, 13)), _greedy(), -1, frozenset())
        tokens = list(llm.engine.generate(seq))
        assert seq.finish_reason == "length" and len(tokens) == 16 - 10 + 1


def test_recurrent_checkpoint_before_the_last_prompt_token(tiny_qwen35moe_gguf: tuple[Path, Path]) -> None:
    """Through the scheduler, a recurrent model's prompt ends in a checkpoint before its last token, so that the
    next turn resumes there instead of recomputing the prompt."""
    with tandem.LLM(tiny_qwen35moe_gguf[1], device="cpu", threads=2, n_ctx=256, n_batch=32) as llm:
        engine, n_vocab = llm.engine, llm.tokenizer.n_vocab
        prompt = _prompt(70, 6, n_vocab)
        seq = engine.add_request(prompt, _greedy(), 3, frozenset())
        list(engine.generate(seq))
        cache = engine.pool.caches[seq.slot]
        assert [at for at, _ in cache.checkpoints] == [69]
        assert all(t.device.type == "cpu" for s in cache.checkpoints[0][1] for t in (s.conv, s.ssm))
        turn2 = prompt + _prompt(5, 7, n_vocab)
        engine.add_request(turn2, _greedy(), 1, frozenset())
        (piece,) = engine.scheduler.schedule()
        assert piece.seq.slot == seq.slot and cache.length == 69  # back to the checkpoint, not to 0
