"""The BPE pre-tokenizers of llama.cpp (src/llama-vocab.cpp), keyed by `tokenizer.ggml.pre`.

Each regex string below has the *value* of the C++ literal in llama.cpp, so that `unicode_regex_split`'s
treatment of it (custom splitter for the GPT-2 / Llama-3 patterns, "collapsed" std::regex otherwise)
can be reproduced exactly by `tandem.tokenizer.pretokenize`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.errors import UnsupportedModelError
from tandem.gguf.header import quote

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"

# Handled by llama.cpp's hand-written splitters (matched by exact string in unicode_regex_split_custom).
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
JAIS2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)"
    r"|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}"
)
NEWLINE_RUNS = r"[^\n]+|[\n]+"
TINY_AYA_DIGITS = r"\d{1,3}(?=(?:\d{3})*\b)"
_CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"  # "[一-龥぀-ゟ゠-ヿ]+"
# These two contain real CR/LF characters in the C++ source (not "\\r\\n"), copied as such.
_DEEPSEEK3_MAIN = (
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"
)
_SPARK_MAIN = (
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+"
)
_UPPER_LOWER = r"((?=[\p{L}])([^a-z]))"  # llama.cpp's ECMAScript stand-in for \p{Lu}-ish classes
_LOWER_ONLY = r"((?=[\p{L}])([^A-Z]))"
TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER_LOWER}*{_LOWER_ONLY}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER_LOWER}+{_LOWER_ONLY}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER_LOWER}*{_LOWER_ONLY}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER_LOWER}+{_LOWER_ONLY}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UL_M = r"((?=[\p{L}\p{M}])([^a-z]))"
_LO_M = r"((?=[\p{L}\p{M}])([^A-Z]))"
GRANITE_EMB_MULTI = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UL_M}*{_LO_M}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UL_M}+{_LO_M}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TINY_AYA_MAIN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?[\p{{Lu}}\p{{Lt}}\p{{Lm}}\p{{Lo}}\p{{M}}]*[\p{{Ll}}\p{{Lm}}\p{{Lo}}\p{{M}}]+"
    rf"{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?[\p{{Lu}}\p{{Lt}}\p{{Lm}}\p{{Lo}}\p{{M}}]+[\p{{Ll}}\p{{Lm}}\p{{Lo}}\p{{M}}]*"
    rf"{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BAILINGMOE = (
    r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]|\s+(?!\S)|\s+"
)
SEED_CODER = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)
UFAKZEKA = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
EXAONE_MOE = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
    r"|\s*[\r\n]|\s+(?!\S)|\s+"
)
MINICPM5_MAIN = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK_LLM_LETTERS = (
    "\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf"
    "\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-"
    "\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113"
    "\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149"
    "\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b"
    "\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
    "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-"
    "\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)
_YOUTU_CJK = (
    "[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c"
    "\u3001-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
)
# " ?[^(\\s|.,!?…。，、।۔،)]+"
_BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"

_REGEXES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"),
    "llama3": (LLAMA3,),
    "jais2": (JAIS2,),
    "deepseek-coder": (
        "[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}",
    ),  # fmt: skip
    "deepseek3": (r"\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3_MAIN),
    "spark2_5": (r"\p{N}{1,3}", _CJK_KANA, _SPARK_MAIN, r"\p{N}"),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"),
    "deepseek-llm": (
        "[\r\n]", _DEEPSEEK_LLM_LETTERS, "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        r"\s+$", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}+",
    ),  # fmt: skip
    "youtu": (_YOUTU_CJK, TINY_AYA_MAIN.replace(r"\p{N}{1,3}", r"\p{N}")),
    "starcoder": (r"\p{N}", GPT2),
    "gpt2": (GPT2,),
    "qwen2": (QWEN2,),
    "qwen35": (QWEN35,),
    "bloom": (_BLOOM,),
    "viking": (_BLOOM, r"\p{N}"),
    "tekken": (TEKKEN,),
    "chameleon": (
        "<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )",
        r"\p{N}", r"[\p{P}!-/:-@\[-`{-~]", GPT2,
    ),  # fmt: skip
    "gpt4o": (GPT4O,),
    "granite-emb-multi": (GRANITE_EMB_MULTI,),
    "tiny_aya": (TINY_AYA_DIGITS, TINY_AYA_MAIN),
    "superbpe": (r"\p{N}+", r"(?=(\d{3})+(?!\d))"),
    "bailingmoe": (BAILINGMOE,),
    "seed-coder": (SEED_CODER,),
    "ufakzeka": (UFAKZEKA,),
    "laguna": (NEWLINE_RUNS, QWEN2),
    "newlines": (NEWLINE_RUNS,),
    "exaone-moe": (EXAONE_MOE,),
    "minicpm5": (r"\p{N}{1,3}", MINICPM5_MAIN),
}


@dataclass(frozen=True)
class PreSpec:
    """How llama.cpp treats one `tokenizer.ggml.pre` value."""

    regexes: tuple[str, ...]
    clean_spaces: bool = True  # llama.cpp's BPE default; many pre types switch it off
    ignore_merges: bool = False  # a whole word found in the vocab is taken as one token
    add_bos: bool = False  # default before `tokenizer.ggml.add_bos_token` overrides it
    no_bos: bool = False  # chatglm: the default BOS id is dropped
    escape_whitespaces: bool = False  # SentencePiece-style BPE: ' ' -> U+2581 before splitting, back on decode
    byte_encode: bool = True  # GPT-2 byte characters; False: raw UTF-8 with <0xXX> byte-fallback tokens
    gemma4: bool = False  # an all-newline word that is a token stays whole; BOS is always added


def _spec(kind: str, **kw: bool) -> PreSpec:
    return PreSpec(_REGEXES[kind], **kw)


_NC = {"clean_spaces": False}
# pre name -> spec, in llama.cpp's order (llama_vocab::impl::load).
PRE_SPECS: dict[str, PreSpec] = {
    "default": _spec("default"),
    "minicpm5": _spec("minicpm5", ignore_merges=True),
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano"],
        _spec("llama3", ignore_merges=True, add_bos=True),
    ),  # fmt: skip
    "deepseek-llm": _spec("deepseek-llm", **_NC),
    "deepseek-coder": _spec("deepseek-coder", **_NC),
    "deepseek-v3": _spec("deepseek3", **_NC),
    "spark2_5": _spec("spark2_5", **_NC),
    "youtu": _spec("youtu", clean_spaces=False, ignore_merges=True),
    "falcon": _spec("falcon"),
    "mpt": _spec("gpt2"),
    "starcoder": _spec("starcoder"),
    **dict.fromkeys(
        ["gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
         "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4", "olmo", "jais"],
        _spec("gpt2"),
    ),  # fmt: skip
    "trillion": _spec("gpt2", **_NC),
    "granite-docling": _spec("gpt2", **_NC),
    "jais-2": _spec("jais2"),
    "refact": _spec("starcoder"),
    "command-r": _spec("starcoder", **_NC),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2"], _spec("qwen2", **_NC)),
    "qwen35": _spec("qwen35", **_NC),
    "stablelm2": _spec("qwen2"),
    "megrez": _spec("qwen2"),
    "dbrx": _spec("llama3"),
    "smaug-bpe": _spec("llama3"),
    "poro-chat": _spec("bloom", **_NC),
    "chatglm-bpe": _spec("llama3", no_bos=True),
    **dict.fromkeys(["glm4", "glm5"], _spec("llama3", no_bos=True, ignore_merges=True)),
    "viking": _spec("viking", **_NC),
    "tekken": _spec("tekken", clean_spaces=False, ignore_merges=True, add_bos=True),
    "smollm": _spec("starcoder", **_NC),
    "codeshell": _spec("starcoder"),
    "bloom": _spec("bloom"),
    "gpt3-finnish": _spec("bloom"),
    "exaone": _spec("starcoder"),
    "exaone-moe": _spec("exaone-moe"),
    "chameleon": _spec("chameleon", clean_spaces=False, add_bos=True),
    "minerva-7b": _spec("starcoder"),
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _spec("gpt4o", **_NC)),
    "granite-embed-multi-97m": _spec("granite-emb-multi", clean_spaces=False, ignore_merges=True),
    **dict.fromkeys(["tiny_aya", "cohere2moe"], _spec("tiny_aya", **_NC)),
    "superbpe": _spec("superbpe", **_NC),
    **dict.fromkeys(["bailingmoe", "bailingmoe2", "llada-moe"], _spec("bailingmoe", **_NC)),
    "seed-coder": _spec("seed-coder", **_NC),
    **dict.fromkeys(["hunyuan", "solar-open", "grok-2"], _spec("qwen2", **_NC)),
    **dict.fromkeys(["hunyuan-dense", "hy_v4", "joyai-llm"], _spec("deepseek3", **_NC)),
    "ufakzeka": _spec("ufakzeka", **_NC),
    "laguna": _spec("laguna", **_NC),
    "mellum2": _spec("starcoder"),
    **dict.fromkeys(
        ["gemma4", "granite-embed-multi-311m"],
        _spec("newlines", escape_whitespaces=True, byte_encode=False, gemma4=True),
    ),
    "sarvam-moe": _spec("newlines", clean_spaces=False, escape_whitespaces=True, byte_encode=False),
}

# llama.cpp knows these, but they need splitters or normalisations tandem does not implement.
_NOT_IMPLEMENTED = {"kimi-k2", "afmoe", "whitespace"}


def pre_spec(pre: str | None) -> PreSpec:
    """The spec for `tokenizer.ggml.pre` (None/empty: llama.cpp's 'default', with degraded quality)."""
    if not pre:
        return PRE_SPECS["default"]
    spec = PRE_SPECS.get(pre)
    if spec is not None:
        return spec
    if pre in _NOT_IMPLEMENTED:
        raise UnsupportedModelError(f"BPE pre-tokenizer {quote(pre)} (tokenizer.ggml.pre) is not supported yet")
    raise UnsupportedModelError(f"unknown BPE pre-tokenizer {quote(pre)} (tokenizer.ggml.pre)")
