"""Hostile chat templates (issue 18): each refused or stopped within the limits, as a one-line ChatTemplateError."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tandem.errors import ChatTemplateError
from tandem.tokenizer import chat_template
from tandem.tokenizer.chat_template import render_chat

MESSAGES = [{"role": "user", "content": "hi"}]

HOSTILE = {
    "repeat 10^9": ("{{ 'x' * 10**9 }}", "a repetition"),
    "list repeat": ("{{ [1] * 10**9 }}", "a repetition"),
    "power": ("{{ 7 ** (10 ** 8) }}", "bits"),
    "squaring": (
        "{% set ns = namespace(x=7) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
        "bits",
    ),
    "indent": ("{{ 'a\\nb' | indent(10**9) }}", "exceeds"),
    "center": ("{{ 'a'.center(10**9) }}", "exceeds"),
    "format method": ("{{ '{:>999999999}'.format(1) }}", "exceeds"),
    "format filter": ("{{ '%999999999d' | format(1) }}", "exceeds"),
    "percent": ("{{ '%999999999d' % 1 }}", "exceeds"),
    "lipsum": ("{{ lipsum(10**9) }}", "exceeds"),
    "doubling": (
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "namespace",
    ),
    "macro doubling": (
        "{% macro f(s, n) %}{{ f(s ~ s, n - 1) if n else s | length }}{% endmacro %}{{ f('x', 60) }}",
        "argument",
    ),
    "output": ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "the rendered prompt"),
    "nested loops": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "more than 1 s",
    ),
    "loops without calls": (
        "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
        "more than 1 s",
    ),
    "recursion": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    "deep nesting": ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "chat template"),
    "escape": ("{{ ''.__class__.__mro__ }}", "sandbox"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_template(case: str) -> None:
    template, message = HOSTILE[case]
    start = time.monotonic()
    with pytest.raises(ChatTemplateError) as e:
        render_chat(template, MESSAGES, render_seconds=1.0)
    assert time.monotonic() - start < 5.0
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_template_size_cap() -> None:
    with pytest.raises(ChatTemplateError, match="chat template of 52428800 characters"):
        render_chat("x" * (50 << 20), MESSAGES)


def test_real_templates_still_render() -> None:
    text = render_chat(
        "{% for m in messages %}{{ m['role'] ~ ': ' ~ m['content'] | indent(2) }}{% endfor %}{{ range(3) | list }}",
        MESSAGES,
    )
    assert text == "user: hi[0, 1, 2]"


def test_cli_one_line_for_a_hostile_template_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The template given with --chat-template-file fails as one `error:` line (exit 2)."""
    from tandem.cli.main import main

    path = tmp_path / "t.jinja"
    path.write_text("{{ 'x' * 10**9 }}")
    assert main(["run", "-p", "hi", "--chat", "--chat-template-file", str(path), "-n", "1", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: chat template exceeds a limit")


def test_fifo_template_file_is_refused(tmp_path: Path) -> None:
    import os

    fifo = tmp_path / "t.jinja"
    os.mkfifo(fifo)
    with pytest.raises(ChatTemplateError, match="not a regular file"):
        chat_template.read_template_file(str(fifo))


def test_a_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing(
    tiny_qwen3moe_gguf: tuple[Path, Path],
) -> None:
    """A template rendering megabytes (the fuzzer's `strftime_now('%Y' * 1000000)`, which took seconds to tokenize):
    refused by its byte count against the context, before the tokenizer reads it."""
    import tandem
    from tandem.state.kv_cache import ContextFullError

    with tandem.LLM(tiny_qwen3moe_gguf[1], device="cpu", threads=1, n_ctx=128) as llm:
        llm.tokenizer.encode = None  # type: ignore[method-assign]  # never reached
        start = time.perf_counter()
        with pytest.raises(ContextFullError, match="bytes cannot fit the context size 128"):
            llm.generate("2026" * 1_000_000, max_tokens=1)
        with pytest.raises(ContextFullError, match="bytes cannot fit"):
            llm.chat([{"role": "user", "content": "x"}], chat_template="{{ '%Y' * 1000000 }}", max_tokens=1)
        assert time.perf_counter() - start < 5
