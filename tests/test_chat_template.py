"""Chat templates: ChatML rendering, transformers' helpers, sandbox refusals, one-line errors."""

from __future__ import annotations

import pytest

from tandem.errors import ChatTemplateError
from tandem.tokenizer import chat_template_from_metadata, render_chat

CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Hi!"},
]

# Gemma-style: bos_token, raise_exception, whitespace control
GEMMA_LIKE = """{{ bos_token }}
{%- for message in messages -%}
    {%- if message['role'] not in ['user', 'assistant'] -%}
        {{ raise_exception('Conversation roles must be user/assistant') }}
    {%- endif -%}
    {{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\n' }}
    {{- message['content'] | trim + '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""
# trim_blocks and lstrip_blocks, as transformers sets them: block tags leave no blank lines or indents
BLOCKS = """{% for m in messages %}
    {% if m.role == 'user' %}
[{{ m.content }}]
    {% endif %}
{% endfor %}
"""


def test_chatml() -> None:
    out = render_chat(CHATML, MESSAGES)
    assert out == (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not render_chat(CHATML, MESSAGES, add_generation_prompt=False).endswith("assistant\n")


def test_gemma_like_and_raise_exception() -> None:
    msgs = [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "hello"}]
    out = render_chat(GEMMA_LIKE, msgs, bos_token="<bos>")
    assert out == (
        "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\nhello<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    with pytest.raises(ChatTemplateError, match="roles must be user/assistant"):
        render_chat(GEMMA_LIKE, [{"role": "system", "content": "x"}])


def test_trim_and_lstrip_blocks() -> None:
    assert render_chat(BLOCKS, MESSAGES) == "[Hi!]\n"


def test_helpers_and_extensions() -> None:
    tpl = (
        "{{ tools | tojson }}|{{ strftime_now('%Y') | length }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}|"
        "{% generation %}{{ eos_token }}{% endgeneration %}"
    )
    out = render_chat(tpl, MESSAGES, eos_token="</s>", tools=[{"name": "café", "n": 1}])
    assert out == '[{"name": "café", "n": 1}]|4|system|</s>'


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__ }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ joiner.__init__.__globals__.os.system('true') }}",
        "{{ lipsum.__globals__['os'] }}",
        "{{ messages.append({'role': 'user', 'content': 'x'}) }}",
        "{{ (messages|first).update({'role': 'x'}) }}",
        "{{ raise_exception.__code__ }}",
    ],
)
def test_sandbox_refuses(template: str) -> None:
    with pytest.raises(ChatTemplateError) as exc:
        render_chat(template, MESSAGES)
    msg = str(exc.value)
    assert "\n" not in msg
    assert "sandbox" in msg or "unsafe" in msg


@pytest.mark.parametrize(
    ("template", "pattern"),
    [
        ("{% for m in messages %}{{ m.role }}", "does not parse"),
        ("{{ messages[0]['content'] / 0 }}", "failed"),
        ("{{ undefined_thing.attr }}", "failed"),
        ("{{ 1 // 0 }}", "ZeroDivisionError"),
    ],
)
def test_render_errors_are_one_line(template: str, pattern: str) -> None:
    with pytest.raises(ChatTemplateError, match=pattern) as exc:
        render_chat(template, MESSAGES)
    assert "\n" not in str(exc.value)


def test_missing_template() -> None:
    assert chat_template_from_metadata({"tokenizer.ggml.model": "llama"}) is None
    assert chat_template_from_metadata({"tokenizer.chat_template": CHATML}) == CHATML
    with pytest.raises(ChatTemplateError, match=r"^model has no chat template \(tokenizer.chat_template\) and tandem"):
        render_chat(None, MESSAGES)


def test_builtin_templates_render_their_families_formats() -> None:
    """The built-ins as the families' own templates render plain conversations: ChatML as the tiny Qwen's template
    (transformers' ChatML), Gemma as the tiny Gemma's (Gemma 3's format), Qwen3's empty thinking block on request."""
    from tiny_models import CHATML_TEMPLATE, GEMMA_TEMPLATE

    from tandem.tokenizer.builtin_templates import BUILTIN_TEMPLATES, arch_template_name, builtin_template

    plain = [{"role": "user", "content": "Hi! "}, {"role": "assistant", "content": "Hello."},
             {"role": "user", "content": "Bye"}]  # fmt: skip
    with_system = [{"role": "system", "content": "Be brief."}, *plain]
    for name, reference in (("chatml", CHATML_TEMPLATE), ("gemma", GEMMA_TEMPLATE), ("qwen3", CHATML_TEMPLATE)):
        for messages in (plain, with_system):
            ours = render_chat(builtin_template(name), messages, bos_token="<bos>")
            assert ours == render_chat(reference, messages, bos_token="<bos>"), name
    thinking_off = render_chat(BUILTIN_TEMPLATES["qwen3"], plain, enable_thinking=False)
    assert thinking_off == render_chat(CHATML, plain) + "<think>\n\n</think>\n\n"
    llama3 = render_chat(builtin_template("llama3"), plain[:1], bos_token="<|begin_of_text|>")
    assert llama3 == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
                      "<|start_header_id|>assistant<|end_header_id|>\n\n")  # fmt: skip
    assert arch_template_name("gemma3") == "gemma" and arch_template_name("gpt-oss") is None
    with pytest.raises(ChatTemplateError, match="not a built-in template"):
        builtin_template("alpaca")
