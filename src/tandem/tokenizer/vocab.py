"""The vocabulary as llama.cpp loads it (llama_vocab::impl::load): token texts, scores, attributes,
special ids, end-of-generation set and the special-token cache used to split raw text."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tandem.errors import MissingMetadataError, UnsupportedModelError
from tandem.gguf.header import quote
from tandem.tokenizer.pre_types import PreSpec, pre_spec

# llama_token_attr bits
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8
# GGUF tokenizer.ggml.token_type (llama_token_type) -> attribute
_TYPE_ATTR = {0: ATTR_UNDEFINED, 1: ATTR_NORMAL, 2: ATTR_UNKNOWN, 3: ATTR_CONTROL, 4: ATTR_USER_DEFINED,
              5: ATTR_UNUSED, 6: ATTR_BYTE}  # fmt: skip
SPECIAL_ATTRS = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN

_K = "tokenizer.ggml."
# Tokens llama.cpp recognises by text when the file does not name them (auto-detect in load()).
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "[EOT]", "<\uff5cend\u2581of\u2581sentence\uff5c>",
              "<end_of_utterance>")  # fmt: skip
_AUTO_DETECT: dict[str, tuple[str, ...]] = {
    "eot": _EOT_TEXTS,
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>",
                "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>",
                "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>",
                "\u2581<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}  # fmt: skip
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
              "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
              "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
              "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[")  # fmt: skip
# metadata key suffix for each special id, in llama.cpp's order (later deprecated keys win)
_ID_KEYS = (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("eot", "eot_token_id"),
            ("eom", "eom_token_id"), ("unk", "unknown_token_id"), ("sep", "seperator_token_id"),
            ("pad", "padding_token_id"), ("mask", "mask_token_id"), ("fim_pre", "fim_pre_token_id"),
            ("fim_suf", "fim_suf_token_id"), ("fim_mid", "fim_mid_token_id"), ("fim_pad", "fim_pad_token_id"),
            ("fim_rep", "fim_rep_token_id"), ("fim_sep", "fim_sep_token_id"), ("fim_pre", "prefix_token_id"),
            ("fim_suf", "suffix_token_id"), ("fim_mid", "middle_token_id"))  # fmt: skip


@dataclass
class Vocab:
    """Everything llama.cpp derives from the tokenizer.* metadata."""

    model: str  # "llama" (SPM), "gpt2" (byte-level BPE) or "gemma4" (BPE on raw UTF-8)
    tokens: list[str]
    scores: list[float]
    attrs: list[int]
    token_to_id: dict[str, int]
    ids: dict[str, int | None]  # bos, eos, eot, eom, unk, sep, pad, mask, fim_*
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    pre: str = ""
    spec: PreSpec | None = None  # BPE only
    bpe_ranks: dict[tuple[str, str], int] = field(default_factory=dict)
    eog_ids: frozenset[int] = frozenset()
    special_ids: list[int] = field(default_factory=list)  # longest text first (tokenizer_st_partition order)

    @property
    def is_spm(self) -> bool:
        return self.model == "llama"

    @property
    def escape_whitespaces(self) -> bool:
        """BPE vocabularies that spell spaces as U+2581 (Gemma 4)."""
        return self.spec.escape_whitespaces if self.spec is not None else True

    @property
    def clean_spaces(self) -> bool:
        return self.spec.clean_spaces if self.spec is not None else False


def load_vocab(md: Mapping[str, Any]) -> Vocab:
    """Build the vocabulary from GGUF metadata exactly as llama.cpp does."""
    model = md.get(_K + "model")
    if model is None:
        raise MissingMetadataError("tokenizer metadata is missing: no 'tokenizer.ggml.model' key")
    if model not in ("llama", "gpt2", "gemma4"):
        raise UnsupportedModelError(f"tokenizer model {quote(str(model))} is not supported (llama, gpt2, gemma4 are)")
    tokens = list(md.get(_K + "tokens") or [])
    if not tokens:
        raise MissingMetadataError("tokenizer metadata has no 'tokenizer.ggml.tokens' list")
    n = len(tokens)
    pre = "gemma4" if model == "gemma4" else str(md.get(_K + "pre") or "")
    spec = None
    ids: dict[str, int | None] = {k: None for k, _ in _ID_KEYS}
    if model == "llama":
        ids.update(bos=1, eos=2, unk=0)
        add_space_prefix, add_bos = True, True
    else:
        spec = pre_spec(pre)
        if model == "gpt2":  # "gemma4" has no default ids
            ids.update(bos=None if spec.no_bos else 11, eos=11)
        add_space_prefix, add_bos = False, spec.add_bos
    add_space_prefix = bool(md.get(_K + "add_space_prefix", add_space_prefix))

    scores = [float(s) for s in md.get(_K + "scores") or [0.0] * n]
    types = md.get(_K + "token_type")
    attrs = [_TYPE_ATTR.get(int(t), ATTR_UNDEFINED) for t in types] if types else [ATTR_NORMAL] * n
    if len(scores) < n or len(attrs) < n:
        raise UnsupportedModelError("tokenizer scores/token_type arrays are shorter than the token list")
    token_to_id: dict[str, int] = {}
    for i, text in enumerate(tokens):
        if not text:
            tokens[i] = text = f"[EMPTY_{i}]"
        if token_to_id.setdefault(text, i) != i:
            first = token_to_id[text]
            raise UnsupportedModelError(f"duplicate token in vocabulary: {quote(text)} has ids {first} and {i}")

    for name, key in _ID_KEYS:
        if ids[name] is not None and ids[name] >= n:  # type: ignore[operator]
            ids[name] = None  # default id out of range: disabled
        value = md.get(_K + key)
        if value is not None and 0 <= int(value) < n:
            ids[name] = int(value)
    add_bos = bool(md.get(_K + "add_bos_token", add_bos)) or (spec is not None and spec.gemma4)
    add_eos = bool(md.get(_K + "add_eos_token", False))
    for flag, name in ((add_bos, "bos"), (add_eos, "eos")):
        if flag and ids[name] is None:
            raise UnsupportedModelError(f"tokenizer.ggml.add_{name}_token is set but there is no {name} id")

    vocab = Vocab(model=model, tokens=tokens, scores=scores[:n], attrs=attrs[:n], token_to_id=token_to_id,
                  ids=ids, add_bos=add_bos, add_eos=add_eos, add_space_prefix=add_space_prefix, pre=pre,
                  spec=spec)  # fmt: skip
    if not vocab.is_spm:
        vocab.bpe_ranks = _bpe_ranks(md)
    _detect_special(vocab)
    vocab.special_ids = sorted(
        (i for i, a in enumerate(vocab.attrs) if a & SPECIAL_ATTRS),
        key=lambda i: (-len(tokens[i].encode("utf-8")), i),  # llama.cpp: longest first (ties: by id here)
    )
    _model_specific_attrs(vocab, md)
    return vocab


def _bpe_ranks(md: Mapping[str, Any]) -> dict[tuple[str, str], int]:
    merges = md.get(_K + "merges")
    if merges is None:
        raise MissingMetadataError("BPE tokenizer without 'tokenizer.ggml.merges'")
    ranks: dict[tuple[str, str], int] = {}
    for i, merge in enumerate(merges):
        pos = merge.find(" ", 1)  # the first space after the first character
        pair = (merge[:pos], merge[pos + 1 :]) if pos >= 0 else ("", "")
        ranks.setdefault(pair, i)  # emplace keeps the first rank
    return ranks


def _detect_special(v: Vocab) -> None:
    """Auto-detect EOT/EOM/FIM tokens by text and build the end-of-generation set (llama.cpp load())."""
    find = v.token_to_id.get

    def force_control(tid: int) -> None:  # "control-looking token ... its type will be overridden"
        v.attrs[tid] |= ATTR_CONTROL

    for name, texts in _AUTO_DETECT.items():
        if v.ids[name] is None:
            # llama.cpp takes the first hit of an unordered_map walk; the lowest id is our deterministic pick.
            found = sorted(tid for t in texts if (tid := find(t)) is not None)
            if found:
                v.ids[name] = found[0]
                force_control(found[0])
    eog = {v.ids[k] for k in ("fim_pad", "fim_rep", "fim_sep") if v.ids[k] is not None}
    for text in _EOG_TEXTS:
        if (tid := find(text)) is not None:
            eog.add(tid)
            force_control(tid)
    for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):  # gpt-oss: always render
        if (tid := find(text)) is not None:
            v.attrs[tid] = ATTR_USER_DEFINED
    eog.update(v.ids[k] for k in ("eos", "eot", "eom") if v.ids[k] is not None)  # type: ignore[misc]

    texts = {v.tokens[t]: t for t in eog}
    # o200k_harmony / solar-open: "<|end|>" ends a message, not the generation
    has_call = "<|call|>" in texts or "<|calls|>" in texts
    if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
        eog.discard(texts["<|end|>"])
        v.attrs[texts["<|end|>"]] = ATTR_USER_DEFINED
    if ("<|tool_response>" in texts or "<|plamo:eos|>" in texts) and "</s>" in texts:  # gemma4, plamo
        eog.discard(texts["</s>"])
        v.attrs[texts["</s>"]] = ATTR_NORMAL
    v.eog_ids = frozenset(eog)  # type: ignore[arg-type]


def _model_specific_attrs(v: Vocab, md: Mapping[str, Any]) -> None:
    """LSTRIP/RSTRIP attributes llama.cpp sets by model name (the end of load())."""
    name = str(md.get("general.name", "")).lower()
    arch = str(md.get("general.architecture", ""))

    def set_attr(text: str, attr: int, on: bool) -> None:
        tid = v.token_to_id.get(text)
        if tid is not None:
            v.attrs[tid] = v.attrs[tid] | attr if on else v.attrs[tid] & ~attr

    if any(p in v.pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
        a in arch for a in ("nomic-bert-moe", "jina-bert-v3")
    ):
        set_attr("<mask>", ATTR_LSTRIP, True)
    elif "phi-3" in name or "phi3" in name:
        for tid in v.special_ids:
            v.attrs[tid] |= ATTR_RSTRIP
        set_attr("</s>", ATTR_RSTRIP, True)
        for text in ("<unk>", "<s>", "<|endoftext|>"):
            set_attr(text, ATTR_RSTRIP, False)
    elif "modern-bert" in name:
        set_attr("[MASK]", ATTR_LSTRIP, True)
