"""A synthetic byte-level BPE ("gpt2") tokenizer of the real vocabulary size.

Ids hold, in order: the preset's special tokens at their real ids (typed CONTROL), the 256 byte tokens
(GPT-2's printable stand-ins for bytes, so any text can be tokenized), a few merges and the tokens they make,
then made-up unique filler strings up to the real vocabulary size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gguf import TokenType

from tandem.synth.presets import Preset

# A handful of merges: llama.cpp refuses a "gpt2" vocabulary without the merges key.
_MERGES = ("Ġ t", "Ġ a", "h e", "i n", "r e", "o n", "Ġt he", "e r")


def _byte_tokens() -> list[str]:
    """GPT-2's bytes_to_unicode(): printable bytes stand for themselves, the others for chr(256 + k)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


@dataclass(frozen=True)
class SynthVocab:
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]


_CACHE: dict[str, SynthVocab] = {}


def build_vocab(p: Preset) -> SynthVocab:
    """The synthetic vocabulary of preset `p` (exactly `p.n_vocab` unique tokens); built once per preset."""
    if p.name not in _CACHE:
        _CACHE[p.name] = _build_vocab(p)
    return _CACHE[p.name]


def _build_vocab(p: Preset) -> SynthVocab:
    n = p.n_vocab
    specials = p.tokens.specials
    merged = [m.replace(" ", "") for m in _MERGES]
    tokens = [f"synth{i}" for i in range(n)]  # filler: unique, and never made by a merge
    types = [int(TokenType.NORMAL)] * n
    free = (i for i in range(n) if i not in specials)
    for i, text in zip(free, [*_byte_tokens(), *merged], strict=False):  # the first free ids
        tokens[i] = text
    for i, text in specials.items():
        tokens[i] = text
        types[i] = int(TokenType.CONTROL)
    return SynthVocab(tokens=tuple(tokens), token_types=tuple(types), merges=_MERGES)


def tokenizer_metadata(p: Preset) -> dict[str, Any]:
    """The `tokenizer.*` keys: model, pre-tokenizer, tokens, types, merges, special ids and chat template."""
    v = build_vocab(p)
    t = p.tokens
    md: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": p.tokenizer_pre,
        "tokenizer.ggml.tokens": v.tokens,
        "tokenizer.ggml.token_type": v.token_types,
        "tokenizer.ggml.merges": v.merges,
        "tokenizer.ggml.bos_token_id": t.bos,
        "tokenizer.ggml.eos_token_id": t.eos,
        "tokenizer.ggml.add_bos_token": t.add_bos,
        "tokenizer.chat_template": t.chat_template,
    }
    if t.pad is not None:
        md["tokenizer.ggml.padding_token_id"] = t.pad
    return md
