"""tandem's own chat templates, for GGUF files that carry none (the bundled Gemma 3 270M among them) and for
`--chat-template NAME`, as llama.cpp falls back to its built-in formats. Each renders like the model family's
published Jinja template on plain-text conversations (system, user and assistant turns)."""

from __future__ import annotations

from tandem.errors import ChatTemplateError

# Gemma 2/3: the system message joins the first user turn; assistant turns are the "model" role.
GEMMA = (
    "{{- bos_token -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set prefix = messages[0]['content'] + '\\n\\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)

CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Qwen3 / Qwen3.5 / Qwen3.6: ChatML; with enable_thinking false, an empty thinking block opens the reply.
QWEN3 = CHATML.replace(
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}",
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}",
)

LLAMA3 = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)

BUILTIN_TEMPLATES: dict[str, str] = {"gemma": GEMMA, "chatml": CHATML, "qwen3": QWEN3, "llama3": LLAMA3}

# The built-in template a file of each architecture gets when it carries none. gpt-oss and Gemma 4 files carry
# their own (harmony, Gemma 4's turn markers), which no built-in here reproduces.
ARCH_TEMPLATES: dict[str, str] = {
    "gemma3": "gemma",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3",
    "qwen35moe": "qwen3",
    "qwen3next": "qwen3",
}


def builtin_template(name: str) -> str:
    """The Jinja text of built-in template `name` (--chat-template NAME); an unknown name is a ChatTemplateError."""
    try:
        return BUILTIN_TEMPLATES[name]
    except KeyError:
        raise ChatTemplateError(
            f"--chat-template {name!r}: not a built-in template (one of {', '.join(BUILTIN_TEMPLATES)}); "
            "a Jinja file goes to --chat-template-file"
        ) from None


def arch_template_name(arch: str) -> str | None:
    """The built-in template for a file of architecture `arch` without one of its own, or None."""
    return ARCH_TEMPLATES.get(arch)
