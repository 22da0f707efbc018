"""The CLI commands and the generation API (sampling, stop strings, streaming, chat) on tiny models."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tandem
from tandem.cli.main import main
from tandem.errors import ChatTemplateError, TandemError
from tandem.runtime.generate import TextStream
from tandem.runtime.sampling import NonFiniteLogitsError, Sampler, SamplingParams, largest, sample_rows


@pytest.fixture(scope="module")
def qwen(tiny_qwen3_gguf: tuple[Path, Path]) -> tandem.LLM:
    llm = tandem.LLM(tiny_qwen3_gguf[1], device="cpu", threads=2, n_ctx=256)
    yield llm
    llm.close()


def test_seeded_sampling_is_reproducible_and_greedy_is_deterministic(qwen: tandem.LLM) -> None:
    a = qwen.generate_ids("hello world", max_tokens=12, temperature=1.0, seed=3, top_k=0, top_p=1.0, min_p=0.0)
    b = qwen.generate_ids("hello world", max_tokens=12, temperature=1.0, seed=3, top_k=0, top_p=1.0, min_p=0.0)
    c = qwen.generate_ids("hello world", max_tokens=12, temperature=1.0, seed=4, top_k=0, top_p=1.0, min_p=0.0)
    assert a == b and a != c
    g1 = qwen.generate_ids("hello world", max_tokens=8, temperature=0)
    assert g1 == qwen.generate_ids("hello world", max_tokens=8, temperature=0)


def test_top_k_one_is_greedy(qwen: tandem.LLM) -> None:
    greedy = qwen.generate_ids("the ocean", max_tokens=8, temperature=0)
    assert qwen.generate_ids("the ocean", max_tokens=8, temperature=1.5, top_k=1, seed=1) == greedy


def test_streaming_equals_whole_text_and_stop_strings_cut(qwen: tandem.LLM) -> None:
    whole = qwen.generate("some text", max_tokens=16, temperature=0)
    pieces = list(qwen.generate("some text", max_tokens=16, temperature=0, stream=True))
    assert "".join(pieces) == whole and len(whole) > 0
    stop = whole[len(whole) // 2 : len(whole) // 2 + 2]
    if stop.strip():
        cut = qwen.generate("some text", max_tokens=16, temperature=0, stop=[stop])
        assert stop not in cut and whole.startswith(cut)


def test_text_stream_holds_partial_utf8_and_stop_prefixes() -> None:
    s = TextStream(stop=["END"])
    snow = "☃".encode()
    assert s.push(snow[:1]) == "" and s.push(snow[1:]) == "☃"
    assert s.push(b"abE") == "ab"  # "E" may start "END"
    assert s.push(b"N") == ""
    assert s.push(b"D tail") == "" and s.stopped


def test_bad_sampling_values_are_errors(qwen: tandem.LLM) -> None:
    with pytest.raises(TandemError, match="top_p"):
        qwen.generate("x", top_p=0.0)


def test_chat_uses_the_template(qwen: tandem.LLM) -> None:
    prompt = qwen.apply_chat_template([{"role": "user", "content": "hi"}])
    assert "<|im_start|>user\nhi<|im_end|>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    assert isinstance(qwen.chat([{"role": "user", "content": "hi"}], max_tokens=4, temperature=0), str)


def test_tokenize_detokenize_round_trip(qwen: tandem.LLM) -> None:
    text = "The quick brown fox, 42 times!"
    assert qwen.detokenize(qwen.tokenize(text, add_special=False)) == text


def test_cli_run_streams_text(tiny_qwen3_gguf: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "-m", str(tiny_qwen3_gguf[1]), "-p", "hello", "-n", "6", "--temp", "0", "-t", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("hello") and len(out) > len("hello\n")


@pytest.mark.parametrize(
    ("command", "flags", "message"),
    [
        ("run", ["-b", "0"], "n_batch (-b/--batch-size) must be positive, got 0"),
        ("bench", ["-b", "0"], "n_batch (-b/--batch-size) must be positive, got 0"),
        ("inspect", ["-c", "0"], "n_ctx (-c/--ctx-size) must be positive, got 0"),
        ("run", ["-t", "0"], "threads (-t) must be at least 1"),
    ],
)
def test_cli_bad_sizes_are_one_line(
    tiny_qwen3_gguf: tuple[Path, Path], capsys: pytest.CaptureFixture[str], command: str, flags: list[str], message: str
) -> None:
    prompt = ["-p", "hi", "-n", "2"] if command == "run" else ["--pp", "8", "--tg", "2"] if command == "bench" else []
    assert main([command, "-m", str(tiny_qwen3_gguf[1]), *prompt, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {message}")


def test_negative_threads_mean_the_physical_cores(tiny_qwen3_gguf: tuple[Path, Path]) -> None:
    """llama.cpp's -t -1."""
    from tandem.api import default_threads

    with tandem.LLM(tiny_qwen3_gguf[1], device="cpu", threads=-1, n_ctx=64) as llm:
        assert llm.threads == default_threads()


def test_cli_chat_is_multi_turn(tiny_qwen3_gguf: tuple[Path, Path]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.cli.main", "chat", "-m", str(tiny_qwen3_gguf[1]), "-n", "4", "--temp", "0",
         "-t", "2", "-c", "512"],
        input="hi\nand again\n\n", capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("> ") >= 2  # two turns answered, then the empty line ends the session


def test_chat_without_template_of_a_family_without_builtin_is_a_clear_error(
    tiny_gpt_oss_gguf: tuple[Path, Path], tmp_path: Path
) -> None:
    """A gpt-oss file stripped of its template: no built-in reproduces harmony, so chatting says what to do."""
    from tandem.fuzz.gguf_edit import GGUFParts

    parts = GGUFParts.read(tiny_gpt_oss_gguf[1])
    del parts.metadata["tokenizer.chat_template"]
    path = tmp_path / "no-template.gguf"
    parts.write(path)
    with tandem.LLM(path, threads=2, n_ctx=128) as llm:
        assert llm.builtin_chat_template is None
        with pytest.raises(ChatTemplateError, match="no chat template .* --chat-template NAME"):
            llm.chat([{"role": "user", "content": "hi"}])
        assert llm.apply_chat_template([{"role": "user", "content": "hi"}], chat_template_name="chatml") == (
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        )


def test_bundled_model_chats_on_the_builtin_gemma_template() -> None:
    """The bundled Gemma 3 270M carries no template: chats render Gemma's turn format (system joined to the first
    user turn), and the turn markers are the vocabulary's special tokens."""
    from tandem.api import default_model_path

    with tandem.LLM(default_model_path(), threads=2, n_ctx=256) as llm:
        assert llm.builtin_chat_template == "gemma"
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi "},
                    {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]  # fmt: skip
        prompt = llm.apply_chat_template(messages)
        assert prompt == (
            "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
            "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
        )
        ids = llm.tokenizer.encode(prompt, add_special=False)
        turn = llm.tokenizer.encode("<start_of_turn>", add_special=False)
        assert len(turn) == 1 and ids.count(turn[0]) == 4
        reply = llm.chat(messages[1:2], max_tokens=4, temperature=0)
        assert isinstance(reply, str) and reply


def test_cli_chat_template_flags(tmp_path: Path) -> None:
    """run --chat on the bundled model: a notice names the built-in template; --chat-template picks one; a wrong name,
    two templates at once or the flag without --chat are one-line errors before loading."""
    base = [sys.executable, "-m", "tandem.cli.main", "run", "-p", "Hi", "-n", "2", "--temp", "0", "-t", "2"]
    ok = subprocess.run([*base, "--chat"], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert "using tandem's built-in 'gemma'" in ok.stderr
    picked = subprocess.run([*base, "--chat", "--chat-template", "chatml"], capture_output=True, text=True, timeout=300)
    assert picked.returncode == 0 and "built-in 'gemma'" not in picked.stderr, picked.stderr
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}", encoding="utf-8")
    for extra, message in [
        (["--chat", "--chat-template", "nope"], "--chat-template 'nope': not a built-in template"),
        (["--chat", "--chat-template", "gemma", "--chat-template-file", str(tmp_path / "t.jinja")], "give one"),
        (["--chat-template", "gemma"], "--chat-template needs --chat"),
    ]:
        bad = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and message in bad.stderr and bad.stderr.count("\n") == 1, bad.stderr


def test_cli_bench_json(tiny_qwen3moe_gguf: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    import json

    assert main(["bench", "-m", str(tiny_qwen3moe_gguf[1]), "--pp", "16", "--tg", "4", "--reps", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["pp_tok_s"] > 0 and result["tg_tok_s"] > 0 and result["peak_rss_bytes"] > 0


GEMMA_TURNS = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{{ m.content }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def test_chat_template_file_for_a_model_without_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The bundled Gemma 3 270M has no template: --chat-template-file (llama.cpp's flag) gives it one, used instead
    of the built-in one (which renders a one-turn chat the same, so the replies match). An unreadable file is one
    line, exit 2, before the model loads."""
    from tandem.api import default_model_path

    template = tmp_path / "gemma.jinja"
    template.write_text(GEMMA_TURNS)
    msgs = [{"role": "user", "content": "Name a colour."}]
    with tandem.LLM(default_model_path(), threads=2, n_ctx=128) as llm:
        assert llm.apply_chat_template(msgs, chat_template=GEMMA_TURNS) == (
            "<bos><start_of_turn>user\nName a colour.<end_of_turn>\n<start_of_turn>model\n"
        )
        reply = llm.chat(msgs, chat_template=GEMMA_TURNS, max_tokens=6, temperature=0)
        assert llm.chat(msgs, max_tokens=6, temperature=0) == reply
    base = ["run", "--chat", "-p", "Name a colour.", "-n", "6", "--temp", "0", "-t", "2", "-c", "128"]
    assert main([*base, "--chat-template-file", str(template)]) == 0
    assert capsys.readouterr().out == reply + "\n"
    assert main([*base, "--chat-template-file", str(tmp_path / "missing.jinja")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --chat-template-file") and "cannot read it" in err[0]
    assert main(["run", "-p", "hi", "--chat-template-file", str(template)]) == 2
    assert "needs --chat" in capsys.readouterr().err


def test_generation_stops_at_a_full_context(
    tiny_qwen3_gguf: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """As llama.cpp without context shift and vLLM's "length": the reply ends where the context is full (the CLI
    says so on stderr), instead of an error after the text; a prompt that does not fit is still an error."""
    with tandem.LLM(tiny_qwen3_gguf[1], device="cpu", threads=2, n_ctx=16) as llm:
        prompt = llm.tokenize("hello there", add_special=True)
        out = llm.generate(prompt, max_tokens=100, temperature=0, top_k=1)
        assert llm.engine.context_full
        assert len(llm.tokenize(out, add_special=False)) <= 16 - len(prompt) + 1
        # -1, as llama.cpp's -n -1: no limit but the end of generation or the context (the same greedy text here)
        assert llm.generate(prompt, max_tokens=-1, temperature=0, top_k=1) == out and llm.engine.context_full
        assert llm.generate(prompt, max_tokens=0) == ""
        with pytest.raises(TandemError, match="context full"):
            llm.generate(list(range(5, 30)), max_tokens=2)
    argv = ["run", "-m", str(tiny_qwen3_gguf[1]), "-p", "hello", "-n", "100", "--temp", "0", "-t", "2", "-c", "16"]
    assert main(argv) == 0
    cap = capsys.readouterr()
    assert cap.out.startswith("hello") and "notice: the context (16 tokens, -c) is full" in cap.err


def test_token_ids_outside_the_vocabulary_and_bad_stops_are_errors(qwen: tandem.LLM) -> None:
    n_vocab = qwen.tokenizer.n_vocab
    for call in (lambda: qwen.logits([1, n_vocab]), lambda: qwen.generate([1, -3], max_tokens=1),
                 lambda: qwen.detokenize([n_vocab + 5])):  # fmt: skip
        with pytest.raises(TandemError, match="outside the vocabulary"):
            call()
    with pytest.raises(TandemError, match="stop must be a string or a list of strings"):
        qwen.generate("hi", max_tokens=1, stop=[5])  # type: ignore[list-item]


def _masked_chain_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """llama.cpp's chain written out over the whole vocabulary, a mask per step: the reference for the sampler."""
    logits = logits.clone()
    if 0 < p.top_k < logits.numel():
        logits = logits.masked_fill(logits < torch.topk(logits, p.top_k).values[-1], float("-inf"))
    if p.top_p < 1.0:  # in double, so that no token sits on the cut by rounding
        ordered, order = torch.sort(logits, descending=True)
        probs = torch.softmax(ordered.double(), dim=-1)
        drop = probs.cumsum(-1) - probs >= p.top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if p.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return torch.softmax(logits / p.temperature, dim=-1)


@pytest.mark.parametrize(
    ("top_k", "top_p", "min_p", "temperature"),
    [(40, 0.95, 0.05, 0.8), (0, 0.9, 0.05, 0.7), (0, 1.0, 0.1, 1.0), (10, 1.0, 0.0, 1.5), (0, 0.5, 0.0, 0.8),
     (0, 1.0, 0.0, 1.0), (1, 0.95, 0.05, 0.8), (0, 0.999, 0.0, 1.0)],
)  # fmt: skip
def test_sampler_draws_from_the_masked_chain_distribution(
    top_k: int, top_p: float, min_p: float, temperature: float
) -> None:
    """The sampler draws from its candidates only (a partial selection, not a sort of the vocabulary), with the
    probabilities the chain of masks over the whole vocabulary gives."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=0)
    logits = torch.randn(5000, generator=torch.Generator().manual_seed(7)) * 4
    probs, ids = Sampler(params).candidates(logits)
    dense = torch.zeros_like(logits).index_put_((ids,), probs)
    torch.testing.assert_close(dense, _masked_chain_probs(logits, params), atol=1e-6, rtol=1e-5)
    assert int(Sampler(params)(logits, [])) in set(ids.tolist())


def test_largest_breaks_ties_by_the_lower_token_id() -> None:
    """The candidates of top-k (and top-p) on logits with many ties, as a bf16 model's are: the k largest, most
    likely first, the lower id first among equals, also where the k-th value's ties cross the cut."""
    logits = (torch.randn(3000, generator=torch.Generator().manual_seed(3)) * 2).to(torch.bfloat16).float()
    for k in (1, 7, 40, 333):
        values, ids = largest(logits, k)
        want = sorted(range(logits.numel()), key=lambda i: (-logits[i].item(), i))[:k]
        assert ids.tolist() == want, k
        assert torch.equal(values, logits[want])


def test_a_seeded_draw_holds_when_rounding_moves_the_logits() -> None:
    """The same seed on logits that differ by rounding only (a bf16 model's logits, tied often, computed by another
    path) draws the same tokens: the draw is in token order, so near-equal candidates trading places move no
    boundary by more than the rounding."""
    base = (torch.randn(512, generator=torch.Generator().manual_seed(11)) * 3).to(torch.bfloat16).float()
    moved = base + torch.randn(512, generator=torch.Generator().manual_seed(12)) * 1e-6
    params = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
    picks = [
        [Sampler(SamplingParams(**params, seed=seed))(logits, []) for seed in range(100)] for logits in (base, moved)
    ]
    assert picks[0] == picks[1]
    assert len(set(picks[0])) > 5  # the draws do spread over the candidates


def test_sample_rows_gives_each_samplers_token() -> None:
    """A step's rows sampled together (the plain greedy ones in one pick) give each row its sampler's own token;
    a non-finite logit in a plain greedy row is still the error naming it."""
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(5)) * 3
    histories = [[1, 2, 3], [], [7, 7, 7], [4], [], [9, 10]]
    kinds = [{"temperature": 0.0}, {"temperature": 0.8, "seed": 1}, {"temperature": 0.0, "repeat_penalty": 1.3},
             {"temperature": 0.0}, {"temperature": 1.2, "top_k": 5, "seed": 2}, {"temperature": 0.0}]  # fmt: skip
    alone = [Sampler(SamplingParams(**k))(row, h) for k, row, h in zip(kinds, logits, histories, strict=True)]
    together = sample_rows([Sampler(SamplingParams(**k)) for k in kinds], logits, histories)
    assert together == alone
    assert (
        sample_rows([Sampler(SamplingParams(temperature=0.0))] * 2, logits[:2], [[], []])
        == logits[:2].argmax(1).tolist()
    )
    logits[3, 17] = float("nan")
    with pytest.raises(NonFiniteLogitsError, match="1 non-finite"):
        sample_rows([Sampler(SamplingParams(**k)) for k in kinds], logits, histories)
