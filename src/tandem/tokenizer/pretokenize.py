"""Word splitting for byte-level BPE, reproducing llama.cpp's `unicode_regex_split` (src/unicode.cpp).

llama.cpp does not run the pre-tokenizer regexes on Unicode text. The GPT-2, Llama-3, Qwen2, Qwen3.5,
newline-run and tiny_aya digit patterns go through hand-written splitters (ported here line for line,
quirks included); every other pattern runs through std::regex on a "collapsed" copy of
the text where each non-ASCII code point becomes one byte naming its category (and the \\p{..} classes
of the regex become those bytes plus their ASCII members). Where that differs from a true Unicode
regex (e.g. upper/lower case of non-ASCII letters in the GPT-4o pattern) llama.cpp's behaviour is kept.
"""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache

from tandem.tokenizer.pre_types import GPT2, LLAMA3, NEWLINE_RUNS, QWEN2, QWEN35, TINY_AYA_DIGITS

# unicode_cpt_flags bits (src/unicode.h)
NUMBER, LETTER, SEPARATOR, MARK, PUNCT, SYMBOL, CONTROL = 0x2, 0x4, 0x8, 0x10, 0x20, 0x40, 0x80
WHITESPACE = 0x100
_CATEGORY_BITS = {"N": NUMBER, "L": LETTER, "Z": SEPARATOR, "M": MARK, "P": PUNCT, "S": SYMBOL, "C": CONTROL}
# Unicode White_Space: llama.cpp's table comes from the `regex` module's \s, which is exactly this set.
_WHITESPACE = frozenset(
    [0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F,
     0x205F, 0x3000]
)  # fmt: skip


@lru_cache(maxsize=65536)
def cpt_flags(ch: str) -> int:
    """llama.cpp's flags for one code point: its general category bit, plus WHITESPACE."""
    flags = _CATEGORY_BITS[unicodedata.category(ch)[0]]
    return flags | WHITESPACE if ord(ch) in _WHITESPACE else flags


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (unicode_byte_to_utf8_map)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


BYTE_TO_CHAR = bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


def byte_encode(word: str) -> str:
    """A word's UTF-8 bytes as GPT-2 byte characters (unicode_byte_encoding_process)."""
    return "".join([BYTE_TO_CHAR[b] for b in word.encode("utf-8", errors="surrogatepass")])


# --- llama.cpp's hand-written splitters -------------------------------------------------------------


def _split_gpt2(text: str, fl: list[int], start: int, end: int, out: list[int]) -> None:
    """unicode_regex_split_custom_gpt2 on text[start:end]; appends word lengths to `out`."""

    def flg(p: int) -> int:
        return fl[p] if start <= p < end else 0

    pos = start
    while pos < end:
        c, f = text[pos], fl[pos]
        begin = pos
        if c == "'" and pos + 1 < end:  # 's|'t|'re|'ve|'m|'ll|'d
            n = text[pos + 1]
            if n in "stmd":
                out.append(2)
                pos += 2
                continue
            if pos + 2 < end and n + text[pos + 2] in ("re", "ve", "ll"):
                out.append(3)
                pos += 3
                continue
        f2 = flg(pos + 1) if c == " " else f
        if f2 & LETTER or f2 & NUMBER:  # <space>?\p{L}+ and <space>?\p{N}+
            cls = LETTER if f2 & LETTER else NUMBER
            pos += c == " "
            while flg(pos) & cls:
                pos += 1
        elif not f2 & (WHITESPACE | LETTER | NUMBER) and f2:  # <space>?[^\s\p{L}\p{N}]+
            pos += c == " "
            while (f2 := flg(pos)) and not f2 & (WHITESPACE | LETTER | NUMBER):
                pos += 1
        else:
            nws = 0
            while flg(pos + nws) & WHITESPACE:
                nws += 1
            if nws > 1 and pos + nws < end:  # \s+(?!\S)
                pos += nws - 1
            elif nws > 0:  # \s+
                pos += nws
            else:
                pos += 1
        out.append(pos - begin)


def _split_llama3(
    text: str, fl: list[int], start: int, end: int, out: list[int], max_digits: int = 3, letters: int = LETTER
) -> None:
    """unicode_regex_split_custom_llama3 (max_digits=3), _qwen2 (max_digits=1) and _qwen35 (also
    letters=LETTER|MARK) on text[start:end]; appends word lengths to `out`."""

    def flg(p: int) -> int:
        return fl[p] if start <= p < end else 0

    not_punct = WHITESPACE | letters | NUMBER
    pos = start
    while pos < end:
        c, f = text[pos], fl[pos]
        begin = pos
        if c == "'" and pos + 1 < end:  # (?i:'s|'t|'re|'ve|'m|'ll|'d)
            n = text[pos + 1].lower() if text[pos + 1] < "\x80" else text[pos + 1]
            if n in "stmd":
                out.append(2)
                pos += 2
                continue
            if pos + 2 < end:
                nn = text[pos + 2].lower() if text[pos + 2] < "\x80" else text[pos + 2]
                if n + nn in ("re", "ve", "ll"):
                    out.append(3)
                    pos += 3
                    continue
        if not (c == "\r" or c == "\n" or f & NUMBER) and (f & letters or flg(pos + 1) & letters):
            pos += 1  # [^\r\n\p{L}\p{N}]?\p{L}+
            while flg(pos) & letters:
                pos += 1
            out.append(pos - begin)
            continue
        if f & NUMBER:  # \p{N}{1,3} / \p{N}
            ini = pos
            while flg(pos) & NUMBER:
                pos += 1
                if pos - ini >= max_digits:
                    out.append(pos - ini)
                    ini = pos
            if pos > ini:
                out.append(pos - ini)
            continue
        f2 = flg(pos + 1) if c == " " else f
        if not f2 & not_punct and f:  # <space>?[^\s\p{L}\p{N}]+[\r\n]*
            pos += c == " "
            while (f2 := flg(pos)) and not f2 & not_punct:
                pos += 1
            while pos < end and text[pos] in "\r\n":
                pos += 1
            out.append(pos - begin)
            continue
        nws = 0
        last_rn = 0
        while flg(pos + nws) & WHITESPACE:
            if text[pos + nws] in "\r\n":
                last_rn = pos + nws + 1
            nws += 1
        if last_rn > 0:  # \s*[\r\n]+
            pos = last_rn
        elif nws > 1 and pos + nws < end:  # \s+(?!\S)
            pos += nws - 1
        elif nws > 0:  # \s+
            pos += nws
        else:
            pos += 1
        out.append(pos - begin)


def _split_qwen2(text: str, fl: list[int], start: int, end: int, out: list[int]) -> None:
    _split_llama3(text, fl, start, end, out, max_digits=1)


def _split_qwen35(text: str, fl: list[int], start: int, end: int, out: list[int]) -> None:
    _split_llama3(text, fl, start, end, out, max_digits=1, letters=LETTER | MARK)


def _split_newlines(text: str, fl: list[int], start: int, end: int, out: list[int]) -> None:
    """unicode_regex_split_custom_newlines: runs of newlines and runs of anything else."""
    pos = start
    while pos < end:
        begin, is_nl = pos, text[pos] == "\n"
        while pos < end and (text[pos] == "\n") == is_nl:
            pos += 1
        out.append(pos - begin)


def _split_digit_groups(text: str, fl: list[int], start: int, end: int, out: list[int]) -> None:
    """unicode_regex_split_custom_afmoe (llama.cpp uses it for tiny_aya's digit regex): digit runs in
    groups of three from the right. Text before a run is emitted together with its first group."""
    prev = pos = start
    while pos < end:
        if not fl[pos] & NUMBER:
            pos += 1
            continue
        first = pos
        while pos < end and fl[pos] & NUMBER:
            pos += 1
        cut = first + (pos - first) % 3
        cuts = ([cut] if cut > first else []) + list(range(cut + 3, pos + 1, 3))
        for c in cuts:
            out.append(c - prev)
            prev = c
    if prev < end:
        out.append(end - prev)


_CUSTOM = {
    GPT2: _split_gpt2,
    LLAMA3: _split_llama3,
    QWEN2: _split_qwen2,
    QWEN35: _split_qwen35,
    NEWLINE_RUNS: _split_newlines,
    TINY_AYA_DIGITS: _split_digit_groups,
}


# --- std::regex on the collapsed text ---------------------------------------------------------------

_UCAT = {
    r"\p{N}": NUMBER, r"\p{L}": LETTER, r"\p{P}": PUNCT, r"\p{M}": MARK, r"\p{S}": SYMBOL,
    r"\p{Lu}": LETTER, r"\p{Ll}": LETTER, r"\p{Lt}": LETTER, r"\p{Lm}": LETTER, r"\p{Lo}": LETTER,
}  # fmt: skip
_UCAT_CHAR = {NUMBER: "\xd1", LETTER: "\xd2", PUNCT: "\xd3", MARK: "\xd4", SYMBOL: "\xd5"}
# The ASCII members of each class (k_ucat_map), as regex class text.
_UCAT_ASCII = {
    NUMBER: "0-9", LETTER: "A-Za-z", PUNCT: r"!-#%-*,-/:-;?-@\[-\]_\{\}", MARK: "", SYMBOL: r"\$\+<->^`\|\~",
}  # fmt: skip


def _collapse_char(ch: str) -> str:
    if ch < "\x80":
        return ch
    flags = cpt_flags(ch)
    if flags & WHITESPACE:
        return "\x0b"  # std::regex \s does not know non-ASCII spaces: vertical tab stands in
    return _UCAT_CHAR.get(flags & 0xFF, "\xd0")


def collapse_text(text: str) -> str:
    """Each code point replaced as in unicode_regex_split's `text_collapsed`."""
    return "".join([_collapse_char(ch) for ch in text])


def collapse_regex(expr: str) -> str:
    """The pattern rewritten for the collapsed text, exactly as llama.cpp rewrites it."""
    out: list[str] = []
    inside = False
    i = 0
    while i < len(expr):
        ch = expr[i]
        if ch == "[" and (i == 0 or expr[i - 1] != "\\"):
            out.append("[")
            inside = True
        elif inside and ch == "]" and expr[i - 1] != "\\":
            out.append("]")
            inside = False
        elif ch == "\\" and i + 3 < len(expr) and expr[i + 1] == "p" and expr[i + 2] == "{":
            close = expr.find("}", i + 3)
            pat = expr[i : close + 1] if 0 <= close <= i + 10 else ""
            if pat in _UCAT:
                body = _UCAT_CHAR[_UCAT[pat]] + _UCAT_ASCII[_UCAT[pat]]
                out.append(body if inside else f"[{body}]")
                i = close + 1
                continue
            out.append(ch)
        else:
            out.append(ch)
        i += 1
    return "".join(out)


def _uses_categories(expr: str) -> bool:
    return any(k in expr for k in _UCAT)


@lru_cache(maxsize=64)
def _compiled(expr: str) -> re.Pattern[str]:
    # re.ASCII: std::regex's \s, \d and \b are the C locale's (ASCII) classes.
    return re.compile(collapse_regex(expr) if _uses_categories(expr) else expr, re.ASCII)


def _split_stl(subject: str, expr: str, offsets: list[int]) -> list[int]:
    """unicode_regex_split_stl: matches and the gaps between them both become words."""
    pattern = _compiled(expr)
    out: list[int] = []
    start = 0
    for length in offsets:
        segment = subject[start : start + length]
        done = 0
        for m in pattern.finditer(segment):
            if m.start() > done:
                out.append(m.start() - done)
            out.append(m.end() - m.start())
            done = m.end()
        if done < length:
            out.append(length - done)
        start += length
    return out


def regex_split(text: str, regexes: tuple[str, ...]) -> list[str]:
    """Split `text` into words with the pre-tokenizer `regexes`, applied one after another."""
    if not text:
        return []
    flags: list[int] | None = None
    collapsed: str | None = None
    plain: str | None = None
    offsets = [len(text)]
    for expr in regexes:
        split = _CUSTOM.get(expr)
        if split is not None:
            if flags is None:
                flags = [cpt_flags(ch) for ch in text]
            new: list[int] = []
            start = 0
            for length in offsets:
                split(text, flags, start, start + length, new)
                start += length
            if new:  # llama.cpp falls back to std::regex when a custom splitter yields nothing
                offsets = new
                continue
        if _uses_categories(expr):
            if collapsed is None:
                collapsed = collapse_text(text)
            offsets = _split_stl(collapsed, expr, offsets)
        else:  # std::wregex on the code points, non-ASCII whitespace as vertical tab
            if plain is None:
                plain = "".join(["\x0b" if ch > "\x7f" and cpt_flags(ch) & WHITESPACE else ch for ch in text])
            offsets = _split_stl(plain, expr, offsets)
    words = []
    start = 0
    for length in offsets:
        words.append(text[start : start + length])
        start += length
    return words
