"""Chat templates: the model's Jinja template (`tokenizer.chat_template`) rendered the way
transformers renders it, inside jinja2's immutable sandbox."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from tandem.errors import ChatTemplateError

CHAT_TEMPLATE_KEY = "tokenizer.chat_template"
MISSING_TEMPLATE = (
    "model has no chat template (tokenizer.chat_template); use `run` without --chat, or give one with "
    "--chat-template-file FILE (API: chat_template=)"
)


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """Any reach for an unsafe attribute (dunders, function globals, ...) is an error at once.

    jinja2's sandbox only returns an Undefined there, which renders as '' unless used further."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:  # type: ignore[override]
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:  # fmt: skip
    # transformers' override: no HTML escaping, unicode kept
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_env: _StrictSandbox | None = None


def _environment() -> _StrictSandbox:
    global _env
    if _env is None:
        env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        _env = env
    return _env


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


def chat_template_from_metadata(metadata: Mapping[str, Any]) -> str | None:
    """The model's default chat template (`tokenizer.chat_template`), or None if the file has none."""
    template = metadata.get(CHAT_TEMPLATE_KEY)
    return str(template) if template else None


# Variables render_chat sets itself; extra template variables may not replace them.
RESERVED_VARIABLES = ("messages", "add_generation_prompt", "bos_token", "eos_token")


def template_variables(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """Extra chat template variables (e.g. {"enable_thinking": False}, as llama.cpp's --chat-template-kwargs and
    vLLM's chat_template_kwargs), checked: a mapping of names that render_chat does not set itself."""
    if extra is None:
        return {}
    if not isinstance(extra, Mapping) or not all(isinstance(k, str) for k in extra):
        raise ChatTemplateError('chat template kwargs must be a JSON object of names, e.g. {"enable_thinking": false}')
    taken = [k for k in extra if k in RESERVED_VARIABLES]
    if taken:
        raise ChatTemplateError(f"chat template kwargs may not set {', '.join(taken)}: tandem sets them")
    return dict(extra)


def parse_template_variables(text: str) -> dict[str, Any]:
    """--chat-template-kwargs: a JSON object of extra chat template variables."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        where = f"{e.msg} at character {e.pos}"
        raise ChatTemplateError(f"--chat-template-kwargs is not JSON ({where}): {text!r}") from None
    return template_variables(value)


def read_template_file(path: str) -> str:
    """--chat-template-file: a Jinja chat template to use instead of the model's (as llama.cpp's flag)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ChatTemplateError(f"--chat-template-file {path}: cannot read it ({reason})") from None


def render_chat(
    template: str | None,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **kw: Any,
) -> str:
    """Render `messages` ([{'role': ..., 'content': ...}, ...]) with a Jinja chat template.

    Extra keyword arguments (tools, documents, ...) are passed to the template. Raises ChatTemplateError
    (one line) when the template is missing, does not parse, fails, calls raise_exception() or reaches for
    Python internals the sandbox forbids."""
    if template is None:
        raise ChatTemplateError(MISSING_TEMPLATE)
    try:
        compiled = _environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not parse (line {e.lineno}): {_one_line(e)}") from None
    try:
        return compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **kw,
        )
    except SecurityError as e:
        raise ChatTemplateError(f"chat template refused by the sandbox: {_one_line(e)}") from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {_one_line(e)}") from None
    except Exception as e:  # a template can raise anything (TypeError, ZeroDivisionError, ...)
        msg = f"{type(e).__name__}: {_one_line(e)}"
        raise ChatTemplateError(f"chat template failed to render: {msg}") from None
