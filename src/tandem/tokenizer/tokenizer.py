"""`Tokenizer`: llama.cpp-compatible encode/decode over a GGUF vocabulary (llama_vocab::impl::tokenize,
token_to_piece, detokenize)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from tandem.tokenizer.bpe import BPETokenizer
from tandem.tokenizer.pretokenize import CHAR_TO_BYTE
from tandem.tokenizer.spm import SPMTokenizer
from tandem.tokenizer.vocab import (
    ATTR_BYTE,
    ATTR_CONTROL,
    ATTR_LSTRIP,
    ATTR_NORMAL,
    ATTR_RSTRIP,
    ATTR_UNKNOWN,
    ATTR_USER_DEFINED,
    Vocab,
    load_vocab,
)

_C_SPACE = " \t\n\v\f\r"  # C isspace()
_END = ""  # trie key marking a complete special token


class Tokenizer:
    """Text <-> token ids exactly as llama.cpp does for `tokenizer.ggml.model` 'llama', 'gpt2' or 'gemma4'."""

    def __init__(self, vocab: Vocab) -> None:
        self.vocab = vocab
        self._impl: SPMTokenizer | BPETokenizer = SPMTokenizer(vocab) if vocab.is_spm else BPETokenizer(vocab)
        self._pieces: dict[int, bytes] = {}
        # Trie of special-token texts: finds which of the (thousands of) special tokens occur in a text
        # without a substring search per token.
        self._trie: dict[str, Any] = {}
        self._rank = {tid: r for r, tid in enumerate(vocab.special_ids)}
        for tid in vocab.special_ids:
            node = self._trie
            for ch in vocab.tokens[tid]:
                node = node.setdefault(ch, {})
            node[_END] = tid

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build the tokenizer from GGUF metadata (the `tokenizer.*` keys).

        Raises UnsupportedModelError for tokenizer models / pre-tokenizers tandem does not implement."""
        return cls(load_vocab(metadata))

    # -- properties ----------------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        """Number of tokens in the vocabulary."""
        return len(self.vocab.tokens)

    @property
    def model(self) -> str:
        """`tokenizer.ggml.model`: 'llama' (SentencePiece), 'gpt2' (byte-level BPE) or 'gemma4'."""
        return self.vocab.model

    @property
    def bos_id(self) -> int | None:
        return self.vocab.ids["bos"]

    @property
    def eos_id(self) -> int | None:
        return self.vocab.ids["eos"]

    @property
    def eot_id(self) -> int | None:
        return self.vocab.ids["eot"]

    @property
    def unk_id(self) -> int | None:
        return self.vocab.ids["unk"]

    @property
    def pad_id(self) -> int | None:
        return self.vocab.ids["pad"]

    @property
    def add_bos(self) -> bool:
        return self.vocab.add_bos

    @property
    def add_eos(self) -> bool:
        return self.vocab.add_eos

    @property
    def stop_ids(self) -> frozenset[int]:
        """End-of-generation tokens (llama.cpp's special_eog_ids): EOS, EOT, <end_of_turn>, <|im_end|>, ..."""
        return self.vocab.eog_ids

    eog_ids = stop_ids

    def is_eog(self, token: int) -> bool:
        """True if generating `token` ends the generation."""
        return token in self.vocab.eog_ids

    def token_text(self, token: int) -> str:
        """The raw vocabulary entry of `token` (e.g. '▁Hello', '<bos>', 'Ġworld')."""
        return self.vocab.tokens[token]

    # -- encode --------------------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`, as llama_tokenize(text, add_special, parse_special).

        add_special: add BOS/EOS where the model asks for them. parse_special: text such as '<eos>' or
        '<|im_end|>' becomes that control token (user-defined tokens are always matched)."""
        v = self.vocab
        out: list[int] = []
        if add_special and v.add_bos:
            out.append(v.ids["bos"])  # type: ignore[arg-type]
        prev_special = True  # SPM: the first text fragment gets the space prefix
        for frag in self._partition(text, parse_special):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
            elif v.is_spm:
                if v.add_space_prefix and prev_special:
                    frag = " " + frag
                out.extend(self._impl.tokenize(frag.replace(" ", "\u2581")))
                prev_special = False
            else:
                out.extend(self._impl.tokenize(frag.replace(" ", "\u2581") if v.escape_whitespaces else frag))
        if add_special and v.add_eos:
            out.append(v.ids["eos"])  # type: ignore[arg-type]
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Split raw text at special-token texts (tokenizer_st_partition): longest tokens first."""
        if not text:
            return []
        v = self.vocab
        frags: list[tuple[int, int] | int] = [(0, len(text))]
        for tid in self._specials_in(text):
            attr = v.attrs[tid]
            if not parse_special and attr & (ATTR_CONTROL | ATTR_UNKNOWN):
                continue  # user-defined tokens are matched even then
            special = v.tokens[tid]
            new: list[tuple[int, int] | int] = []
            for frag in frags:
                if isinstance(frag, int):
                    new.append(frag)
                    continue
                start, end = frag
                while (at := text.find(special, start, end)) >= 0:
                    left_end = at
                    if attr & ATTR_LSTRIP:
                        while left_end > start and text[left_end - 1] in _C_SPACE:
                            left_end -= 1
                    if left_end > start:
                        new.append((start, left_end))
                    new.append(tid)
                    start = at + len(special)
                    if attr & ATTR_RSTRIP:
                        while start < end and text[start] in _C_SPACE:
                            start += 1
                if end > start:
                    new.append((start, end))
            frags = new
        return [f if isinstance(f, int) else text[f[0] : f[1]] for f in frags]

    def _specials_in(self, text: str) -> list[int]:
        """Special tokens whose text occurs anywhere in `text`, in partition order."""
        trie = self._trie
        found: set[int] = set()
        n = len(text)
        for i in range(n):
            node = trie.get(text[i])
            j = i + 1
            while node is not None:
                if _END in node:
                    found.add(node[_END])
                if j >= n:
                    break
                node = node.get(text[j])
                j += 1
        return sorted(found, key=self._rank.__getitem__)

    # -- decode --------------------------------------------------------------------------------
    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """The bytes `token` stands for (llama_token_to_piece); may be part of a UTF-8 character.

        special=False renders control tokens (BOS, <end_of_turn>, ...) as nothing, like llama.cpp's
        default for generated text; special=True gives their text."""
        attr = self.vocab.attrs[token]
        if not special and attr & (ATTR_UNKNOWN | ATTR_CONTROL):
            return b""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self._piece(token)
        return piece

    def piece_text(self, token: int) -> str:
        """The text of one token with special tokens shown (e.g. '<bos>'), for chat templates."""
        return self.token_to_piece(token, special=True).decode("utf-8", errors="replace")

    def _piece(self, token: int) -> bytes:
        v = self.vocab
        attr, text = v.attrs[token], v.tokens[token]
        if attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED):
            return text.encode("utf-8")
        if attr & ATTR_NORMAL:
            if v.escape_whitespaces:
                return text.replace("\u2581", " ").encode("utf-8")
            return _decode_bpe_text(text)
        if attr & ATTR_BYTE:
            return bytes([int(text[3:5], 16)])
        return b""  # unused / undefined tokens

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`: llama_detokenize(remove_special=skip_special, unparse_special=not skip_special).

        Invalid UTF-8 (e.g. a cut multi-byte character) is replaced by U+FFFD."""
        v = self.vocab
        toks = list(ids)
        remove_space = v.add_space_prefix
        if skip_special and v.add_bos and toks and toks[0] == v.ids["bos"]:
            remove_space = False
            toks = toks[1:]
        if skip_special and v.add_eos and toks and toks[-1] == v.ids["eos"]:
            toks = toks[:-1]
        buf = bytearray()
        for tok in toks:
            piece = self.token_to_piece(tok, special=not skip_special)
            if remove_space and piece.startswith(b" "):
                piece = piece[1:]
            remove_space = False
            buf += piece
        if v.clean_spaces:
            buf = _clean_spaces(buf)
        return buf.decode("utf-8", errors="replace")


def _decode_bpe_text(text: str) -> bytes:
    """GPT-2 characters back to bytes (llama_decode_text), with llama.cpp's marker for strays."""
    out = bytearray()
    for ch in text:
        b = CHAR_TO_BYTE.get(ch)
        if b is not None:
            out.append(b)
        else:
            out += b"[UNK_BYTE_0x" + ch.encode("utf-8").hex().encode() + text.encode("utf-8") + b"]"
    return bytes(out)


def _clean_spaces(t: bytearray) -> bytearray:
    """llama_vocab::impl::detokenize's clean_up_tokenization_spaces, pass for pass, in place."""
    n = len(t)
    total = 1 if n else 0
    for i in range(1, n):  # " ?", " !", " .", " ,"
        x = t[i]
        if t[i - 1] == 0x20 and x in b"?!.,":
            total -= 1
        t[total] = x
        total += 1
    n, total, i = total, (1 if total else 0), 1
    while i < n:  # strip the spaces around a lone apostrophe: " ' "
        x = t[i]
        if x == 0x27 and i + 1 < n and t[i - 1] == 0x20 and t[i + 1] == 0x20:
            total -= 1
            i += 1
            t[i] = 0
        t[total] = x
        total += 1
        i += 1
    n, total = total, (1 if total else 0)
    for i in range(1, n):  # contractions: " 's", " 'm", " 're", " 've"
        x = t[i]
        if t[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            x1 = t[i + 1]
            if x1 in b"sm":
                total -= 1
            elif x1 not in b"td" and i + 2 < n and bytes([x1, t[i + 2]]) in (b"re", b"ve"):
                total -= 1
        t[total] = x
        total += 1
    del t[total:]
    return t
