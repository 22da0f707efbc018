"""The requests of the OpenAI and Ollama APIs, read and checked into a `Generation`: a malformed, mistyped or
out-of-range request is an `APIError` (a 4xx whose message names the field), never an exception further down.

Numeric options are checked against the one table the CLI and the API use (`runtime/sampling.py` OPTION_LIMITS);
fields tandem cannot honour (several choices, logprobs, tools, images, JSON mode) are refused by name rather than
ignored. Fields that change nothing the server computes (`user`, `metadata`, `keep_alive`, ...) are ignored."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tandem.errors import TandemError
from tandem.runtime.sampling import SamplingParams, check_option

MAX_BODY_BYTES = 8 << 20  # a request body; the prompt must also fit the context (checked before tokenizing)
MAX_STOPS = 16
MAX_STOP_CHARS = 256  # TextStream's hold-back check costs the square of a stop string's length per token
MAX_MESSAGES = 10_000
# OpenAI's roles; a template renders any string it is given as a turn, so a typo would make a turn of its own.
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
# A \uD800-\uDFFF escape: where a lone surrogate may come from, as JSON's text itself is checked UTF-8.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


class APIError(Exception):
    """An HTTP error answered as OpenAI's JSON error body (`{"error": {"message", "type", "param", "code"}}`),
    or as Ollama's (`{"error": message}`) on its endpoints."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})

    def openai_body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Generation:
    """What one request asks the engine for: a chat (`messages`, rendered with the chat template) or a completion
    (`prompt`: text tokenized as `LLM.generate` does, or token ids), and how to sample and stop."""

    messages: list[dict[str, str]] | None = None
    prompt: str | list[int] | None = None
    max_tokens: int = -1  # -1: until an end-of-generation token or a full context
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # llama-server's: end-of-generation tokens do not stop it (benchmarks)
    template_kwargs: dict[str, Any] | None = None


def parse_json(body: bytes) -> dict[str, Any]:
    """A request body: a JSON object, else a 400."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as e:  # ValueError covers JSONDecodeError, bad UTF-8, 5000-digit ints
        raise APIError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(value, dict):
        raise APIError(400, f"the request body must be a JSON object, got {_kind(value)}")
    if _SURROGATE_ESCAPE.search(body):
        try:  # a lone surrogate is no text: it cannot be tokenized as such, nor encoded back in an answer
            json.dumps(value, ensure_ascii=False).encode()
        except UnicodeEncodeError as e:
            escape = f"\\u{ord(e.object[e.start]):04x}"
            raise APIError(400, f"the request body is not valid JSON: {escape} is a lone surrogate") from None
    return value


def _kind(value: object) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


class Fields:
    """Typed reads of a JSON object's fields; `where` prefixes the field names in errors (e.g. 'options.')."""

    def __init__(self, body: Mapping[str, Any], where: str = "") -> None:
        self.body, self.where = body, where

    def error(self, name: str, message: str) -> APIError:
        return APIError(400, f"{self.where}{name}: {message}", param=f"{self.where}{name}")

    def get(self, name: str, types: type | tuple[type, ...], what: str) -> Any:
        """The field's value (None when absent or null), which must be of `types` (a bool is not a number)."""
        value = self.body.get(name)
        if value is None:
            return None
        numeric = types in (int, float, (int, float))
        if not isinstance(value, types) or (numeric and isinstance(value, bool)):
            raise self.error(name, f"must be {what}, got {_kind(value)}")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self.get(name, bool, "a boolean")
        return default if value is None else value

    def option(self, name: str, option: str | None = None) -> Any:
        """A number checked against OPTION_LIMITS[option or name] (None when absent)."""
        value = self.body.get(name)
        if value is None:
            return None
        option = option or name
        try:
            check_option(option, value)
        except TandemError as e:  # "temperature (--temp) must be a number, got 'hot'", named as the field
            message = str(e).removeprefix(option)
            raise APIError(400, f"{self.where}{name}{message}", param=f"{self.where}{name}") from None
        return value

    def stop(self, name: str = "stop") -> list[str]:
        """A string or a list of strings (empty ones dropped)."""
        value = self.body.get(name)
        stops = [] if value is None else [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise self.error(name, "must be a string or an array of strings")
        if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise self.error(name, f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters")
        return [s for s in stops if s]

    def refuse(self, name: str, allowed: object = None, why: str = "is not supported") -> None:
        """A 400 when the field is present with another value than `allowed` (None, or e.g. False or 1); an empty
        string, array or object asks for nothing (Ollama's Python client sends `"format": ""`, `"template": ""`)."""
        value = self.body.get(name)
        if value is not None and value != allowed and not (isinstance(value, (str, list, dict)) and not value):
            raise self.error(name, why)


def sampling(f: Fields, max_tokens_names: tuple[str, ...]) -> Generation:
    """The sampling and stopping fields shared by every endpoint (OpenAI's names, and llama-server's top_k,
    min_p, repeat_penalty, repeat_last_n, ignore_eos); absent fields take llama.cpp's defaults, as `tandem run`."""
    given = {name: f.option(name) for name in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty",
                                               "repeat_last_n", "presence_penalty", "frequency_penalty",
                                               "seed")}  # fmt: skip
    try:
        params = SamplingParams(**{k: v for k, v in given.items() if v is not None})
    except TandemError as e:  # what check_option's ranges let through (top_p 0, a negative top_k)
        raise APIError(400, str(e)) from None
    max_tokens = -1
    for name in max_tokens_names:
        value = f.option(name, "max_tokens")
        if value is not None:
            max_tokens = value
    return Generation(
        max_tokens=max_tokens,
        sampling=params,
        stop=f.stop(),
        ignore_eos=f.boolean("ignore_eos", False),
    )


def _openai_common(f: Fields) -> None:
    n = f.get("n", int, "an integer")
    if n is not None and n != 1:
        raise f.error("n", f"only one choice per request is supported (n = 1), got {n}")
    f.refuse("best_of", 1, "only one choice per request is supported (best_of = 1)")
    f.refuse("logit_bias", why="is not supported")
    f.refuse("tools", why="tool calls are not supported")
    f.refuse("functions", why="function calls are not supported")
    response_format = f.get("response_format", dict, "an object")
    if response_format is not None and response_format.get("type", "text") != "text":
        raise f.error("response_format", 'only {"type": "text"} is supported')


def chat_messages(f: Fields, name: str = "messages") -> list[dict[str, str]]:
    """[{role, content}, ...]: content a string, or OpenAI's list of text parts (joined); no images."""
    messages = f.get(name, list, "an array of messages")
    if not messages:
        raise f.error(name, "must be a non-empty array of messages")
    if len(messages) > MAX_MESSAGES:
        raise f.error(name, f"at most {MAX_MESSAGES} messages")
    out = []
    for i, message in enumerate(messages):
        where = f"{name}[{i}]"
        if not isinstance(message, dict):
            raise f.error(where, f"must be an object with role and content, got {_kind(message)}")
        m = Fields(message, f"{f.where}{where}.")
        role = m.get("role", str, "a string")
        if role is None:
            raise m.error("role", "is required")
        if role not in ROLES:
            raise m.error("role", f"must be one of {', '.join(sorted(ROLES))}, got {role[:50]!r}")
        if m.body.get("images"):
            raise m.error("images", "images are not supported")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise m.error(f"content[{j}]", 'only text parts ({"type": "text", "text": ...}) are supported')
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise m.error("content", f"must be a string or an array of text parts, got {_kind(content)}")
        out.append({"role": role, "content": content})
    return out


def template_kwargs(f: Fields) -> dict[str, Any] | None:
    """llama-server's and vLLM's per-request `chat_template_kwargs` (e.g. {"enable_thinking": false})."""
    return f.get("chat_template_kwargs", dict, "an object")


def openai_chat(body: dict[str, Any]) -> Generation:
    f = Fields(body)
    _openai_common(f)
    f.refuse("logprobs", False, "logprobs are not supported")
    f.refuse("top_logprobs", why="logprobs are not supported")
    gen = sampling(f, ("max_tokens", "max_completion_tokens"))
    gen.messages = chat_messages(f)
    gen.template_kwargs = template_kwargs(f)
    return gen


def openai_completion(body: dict[str, Any]) -> Generation:
    f = Fields(body)
    _openai_common(f)
    f.refuse("logprobs", why="logprobs are not supported")
    f.refuse("echo", False, "echo is not supported")
    f.refuse("suffix", why="suffix (insertion) is not supported")
    gen = sampling(f, ("max_tokens",))
    if "max_tokens" not in body:
        gen.max_tokens = 16  # OpenAI's default for completions
    gen.prompt = completion_prompt(f)
    return gen


def completion_prompt(f: Fields) -> str | list[int]:
    """A string, a list of one string, or a list of token ids (one prompt per request)."""
    prompt = f.body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise f.error("prompt", "only one prompt per request is supported")
    raise f.error("prompt", "must be a string or a non-empty array of token ids")


# -- Ollama ---------------------------------------------------------------------------------------------------
# Ollama's option names that tandem reads; others (num_ctx, num_gpu, ...) are fixed when the server starts.
OLLAMA_OPTIONS = ("temperature", "top_k", "top_p", "min_p", "seed", "repeat_penalty", "repeat_last_n",
                  "presence_penalty", "frequency_penalty", "stop", "num_predict")  # fmt: skip


def _ollama_common(f: Fields) -> Generation:
    f.refuse("format", why="structured output (format) is not supported")
    f.refuse("tools", why="tool calls are not supported")
    options = f.get("options", dict, "an object") or {}
    o = Fields(options, "options.")
    gen = sampling(o, ())
    num_predict = o.option("num_predict", "max_tokens") if options.get("num_predict") != -2 else -1
    gen.max_tokens = -1 if num_predict is None else num_predict  # -1 (and Ollama's -2): until the end
    return gen


def ollama_chat(body: dict[str, Any]) -> Generation:
    f = Fields(body)
    gen = _ollama_common(f)
    gen.messages = chat_messages(f) if body.get("messages") else None
    return gen


def ollama_generate(body: dict[str, Any]) -> Generation:
    """`prompt` in the chat template as a user turn (after `system`), or as it is with `raw`, as Ollama's."""
    f = Fields(body)
    gen = _ollama_common(f)
    f.refuse("template", why="a per-request template is not supported (give --chat-template-file at start)")
    f.refuse("context", why="the context array is not supported (use /api/chat for multi-turn)")
    f.refuse("images", why="images are not supported")
    f.refuse("suffix", why="suffix (insertion) is not supported")
    prompt = f.get("prompt", str, "a string") or ""
    system = f.get("system", str, "a string")
    if not prompt:
        return gen  # nothing to generate: Ollama answers done_reason "load"
    if f.boolean("raw", False):
        gen.prompt = prompt
    else:
        gen.messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ]
    return gen
