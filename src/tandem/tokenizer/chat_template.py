"""Chat templates: the model's Jinja template (`tokenizer.chat_template`) rendered the way
transformers renders it, inside jinja2's immutable sandbox, within limits: the template's size, the rendering's
wall-clock time, the output's size and the size of what one operation may build (a hostile template's
`'x' * 10**9`, `a ** 10**8`, `indent(10**9)` or nested loops are refused or stopped, never left to run)."""

from __future__ import annotations

import functools
import json
import os
import re
import stat
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from types import FrameType
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from tandem.errors import ChatTemplateError
from tandem.gguf.header import one_line

CHAT_TEMPLATE_KEY = "tokenizer.chat_template"
MISSING_TEMPLATE = (
    "model has no chat template (tokenizer.chat_template) and tandem has none for its family; use `run` without "
    "--chat, pick a built-in one with --chat-template NAME, or give one with --chat-template-file FILE "
    "(API: chat_template_name=, chat_template=)"
)


# Limits, far above what real chat templates need (the largest are ~20 KiB and render a conversation in
# milliseconds); a prompt longer than the output limit would not fit a context anyway.
MAX_TEMPLATE_CHARS = 1 << 20
MAX_OUTPUT_CHARS = 1 << 24  # the rendered prompt, and any one string or list the template builds
MAX_INT_ARGUMENT = 100_000  # a number passed to a call or filter (a width, a count): jinja2's own range() limit
MAX_INT_BITS = 1 << 16  # an integer the template computes
RENDER_SECONDS = 10.0


class _TooLarge(SecurityError):
    """An operation would build more than the limits allow."""


def _check_size(n: int, what: str) -> None:
    if n > MAX_OUTPUT_CHARS:
        raise _TooLarge(f"{what} would be {n} items long (the limit is {MAX_OUTPUT_CHARS})")


def _check_arguments(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """Numbers within MAX_INT_ARGUMENT; strings and lists (a macro's argument doubled at each recursion) within
    MAX_OUTPUT_CHARS."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT_ARGUMENT:
            raise _TooLarge(f"argument {value} exceeds {MAX_INT_ARGUMENT}")
        if (n := _size(value)) is not None:
            _check_size(n, "an argument")


def _check_format(spec: str) -> None:
    """A %- or {}-format string's widths and precisions (`'%999999999d'`) within the argument limit."""
    for number in re.findall(r"\d{6,}", spec):
        _check_arguments((int(number),), {})


def _size(x: Any) -> int | None:
    return len(x) if isinstance(x, (str, list, tuple)) else None


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """What `*`, `+`, `**` and `%` would build, before they build it."""
    a, b = _size(left), _size(right)
    ints = all(isinstance(x, int) for x in (left, right))
    if operator == "*" and (a is not None or b is not None) and isinstance(right if a is not None else left, int):
        _check_size((a if a is not None else b or 0) * int(right if a is not None else left), "a repetition")
    elif operator == "+" and a is not None and b is not None:
        _check_size(a + b, "a concatenation")
    elif operator == "*" and ints:
        _check_bits(abs(left).bit_length() + abs(right).bit_length())
    elif operator == "**" and ints and abs(left) > 1 and right > 0:
        _check_bits(abs(left).bit_length() * right)
    elif operator == "%" and isinstance(left, str):
        _check_format(left)


def _check_bits(bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise _TooLarge(f"an integer of about {bits} bits (the limit is {MAX_INT_BITS})")


def _checked_filter(f: Callable[..., Any]) -> Callable[..., Any]:
    """A filter whose numeric arguments (indent, center, truncate widths ...) and result are within the limits."""

    @functools.wraps(f)  # keeps jinja2's pass_context / pass_environment marks
    def checked(*args: Any, **kwargs: Any) -> Any:
        _check_arguments(args[1:], kwargs)
        if f.__name__ == "do_format" and args and isinstance(args[0], str):  # `'%999999d' | format(x)`
            _check_format(args[0])
        result = f(*args, **kwargs)
        if (n := _size(result)) is not None:
            _check_size(n, "a filter's result")
        return result

    return checked


class _Namespace(jinja2.runtime.Namespace):
    """namespace(): what a loop accumulates in it (`{% set ns.s = ns.s ~ ns.s %}`) within the size limit."""

    def __setitem__(self, name: str, value: Any) -> None:
        if (n := _size(value)) is not None:
            _check_size(n, "a namespace value")
        super().__setitem__(name, value)


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """Any reach for an unsafe attribute (dunders, function globals, ...) is an error at once.

    jinja2's sandbox only returns an Undefined there, which renders as '' unless used further. Operators that can
    build large values go through `call_binop` (which also stops jinja2 from folding them at compile time), and
    every call through `call`: both check sizes first."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:  # type: ignore[override]
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja2's names)
        _check_arguments(args, kwargs)
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
        if isinstance(getattr(method, "__self__", None), str) and getattr(method, "__name__", "") in (
            "format", "format_map"
        ):  # fmt: skip
            _check_format(method.__self__)
        result = super().call(__context, __obj, *args, **kwargs)
        if (n := _size(result)) is not None:
            _check_size(n, "a call's result")
        return result


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
        env.filters = {name: _checked_filter(f) for name, f in env.filters.items()}
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.globals["namespace"] = _Namespace
        _env = env
    return _env


def _one_line(e: BaseException) -> str:
    return one_line(str(e)) or type(e).__name__


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
    except (ValueError, RecursionError) as e:  # beside malformed JSON: 5,000-digit integers, nesting past the stack
        where = f"{e.msg} at character {e.pos}" if isinstance(e, json.JSONDecodeError) else str(e)
        raise ChatTemplateError(f"--chat-template-kwargs is not JSON ({where}): {text[:80]!r}") from None
    return template_variables(value)


def read_template_file(path: str) -> str:
    """--chat-template-file: a Jinja chat template to use instead of the model's (as llama.cpp's flag). A regular
    file only (a FIFO or device would block or never end), checked on the descriptor opened without blocking."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with open(fd, encoding="utf-8") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ChatTemplateError(f"--chat-template-file {path}: not a regular file")
            return f.read(MAX_TEMPLATE_CHARS + 1)  # one more than allowed: render_chat says it is too large
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ChatTemplateError(f"--chat-template-file {path}: cannot read it ({reason})") from None


class _Deadline(BaseException):
    """The rendering ran past its wall-clock limit (a BaseException: no `except Exception` in a filter keeps it)."""


def _traced(deadline: float) -> Callable[[FrameType, str, Any], Any]:
    """A trace function that raises _Deadline past `deadline`: every line run while rendering (the template's code
    and the filters it calls) passes through it, so that no loop, however nested, outlasts the limit. The clock is
    read every 256 lines. The cost: Qwen3.5's template renders a 20-message conversation in 6 ms instead of 0.4."""
    count = 0

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        count += 1
        if count % 256 == 0 and time.monotonic() > deadline:
            raise _Deadline
        return trace

    return trace


def _render_limited(compiled: jinja2.Template, variables: dict[str, Any], seconds: float) -> str:
    """The template's output, piece by piece, within the output limit and the deadline."""
    previous = sys.gettrace()
    sys.settrace(_traced(time.monotonic() + seconds))
    try:
        pieces: Iterator[str] = compiled.generate(**variables)
        out, size = [], 0
        for piece in pieces:
            size += len(piece)
            _check_size(size, "the rendered prompt")
            out.append(piece)
        return "".join(out)
    finally:
        sys.settrace(previous)


def render_chat(
    template: str | None,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    render_seconds: float = RENDER_SECONDS,
    **kw: Any,
) -> str:
    """Render `messages` ([{'role': ..., 'content': ...}, ...]) with a Jinja chat template.

    Extra keyword arguments (tools, documents, ...) are passed to the template. Raises ChatTemplateError
    (one line) when the template is missing, too large, does not parse, fails, calls raise_exception(), reaches for
    Python internals the sandbox forbids, builds more than the limits allow or renders past `render_seconds`."""
    if template is None:
        raise ChatTemplateError(MISSING_TEMPLATE)
    if len(template) > MAX_TEMPLATE_CHARS:
        raise ChatTemplateError(f"chat template of {len(template)} characters (the limit is {MAX_TEMPLATE_CHARS})")
    try:
        compiled = _environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not parse (line {e.lineno}): {_one_line(e)}") from None
    except Exception as e:  # deep nesting (RecursionError), or what folding a constant raised
        raise ChatTemplateError(f"chat template does not compile: {type(e).__name__}: {_one_line(e)}") from None
    variables = dict(messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                     eos_token=eos_token, **kw)  # fmt: skip
    try:
        return _render_limited(compiled, variables, render_seconds)
    except _Deadline:
        raise ChatTemplateError(f"chat template rendered for more than {render_seconds:g} s: stopped") from None
    except _TooLarge as e:
        raise ChatTemplateError(f"chat template exceeds a limit: {_one_line(e)}") from None
    except SecurityError as e:
        raise ChatTemplateError(f"chat template refused by the sandbox: {_one_line(e)}") from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {_one_line(e)}") from None
    except Exception as e:  # a template can raise anything (TypeError, ZeroDivisionError, MemoryError, ...)
        msg = f"{type(e).__name__}: {_one_line(e)}"
        raise ChatTemplateError(f"chat template failed to render: {msg}") from None
