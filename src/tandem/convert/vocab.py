"""Tokenizer metadata for the GGUF writer, following llama.cpp's `convert_hf_to_gguf.py` conventions.

Two kinds are supported:

* byte-level BPE from `tokenizer.json` (Qwen): `tokenizer.ggml.model = "gpt2"` with merges and token types;
* SentencePiece from `tokenizer.model` (Gemma): `tokenizer.ggml.model = "llama"` with scores and types.

Neither `transformers` nor `sentencepiece` is needed: `tokenizer.json` is plain JSON and `tokenizer.model`
is a small protobuf message that is decoded here. Special token ids, `add_bos`/`add_eos` flags, merges and
the chat template come from `gguf.SpecialVocab`, the same helper llama.cpp's converter uses.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from tandem.errors import ConversionError


@dataclass
class Vocab:
    """A complete token table, ready to be written: one entry per row of the embedding matrix."""

    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str  # tokenizer.ggml.pre
    tokens: list[bytes]
    toktypes: list[int]
    scores: list[float] | None  # SentencePiece only


def does_token_look_special(text: str) -> bool:
    """llama.cpp's heuristic for added tokens that should be CONTROL although not flagged special."""
    if text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]"):
        return True
    if text.startswith("<|") and text.endswith("|>"):
        return True
    if text.startswith("<｜") and text.endswith("｜>"):
        return True
    return text.startswith("<unused") and text.endswith(">")


def read_json_object(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file (config, tokenizer, ...), which must hold an object; else a ConversionError."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # ValueError: malformed, undecodable or 5,000-digit integers
        raise ConversionError(f"{path}: cannot read JSON ({type(e).__name__}: {e})") from None
    if not isinstance(value, dict):
        raise ConversionError(f"{path}: expected a JSON object, found a {type(value).__name__}")
    return value


# ---------------------------------------------------------------------------------------------------------
# byte-level BPE (tokenizer.json)
# ---------------------------------------------------------------------------------------------------------


def load_bpe_vocab(hf_dir: Path, vocab_size: int, pre: str) -> Vocab:
    """Token list and types from `tokenizer.json`, padded with `[PAD{i}]` (UNUSED) up to `vocab_size`."""
    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        raise ConversionError(f"{hf_dir}: tokenizer.json is missing (needed for the BPE vocabulary)")
    tj = read_json_object(path)
    model = tj.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise ConversionError(f"{path}: expected a BPE tokenizer model, got {model.get('type')!r}")
    by_id: dict[int, str] = {int(i): tok for tok, i in model["vocab"].items()}
    added: dict[int, dict[str, Any]] = {}
    for entry in tj.get("added_tokens") or []:
        added[int(entry["id"])] = entry
        by_id[int(entry["id"])] = entry["content"]
    if by_id and max(by_id) >= vocab_size:
        raise ConversionError(
            f"{path}: token id {max(by_id)} does not fit the model's vocab_size {vocab_size}"
        )
    tokens: list[bytes] = []
    toktypes: list[int] = []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]".encode())
            toktypes.append(gguf.TokenType.UNUSED)
            continue
        text = by_id[i]
        if i in added:
            if added[i].get("special") or does_token_look_special(text):
                toktypes.append(gguf.TokenType.CONTROL)
            else:
                # llama.cpp expects user-defined tokens pre-normalized (SentencePiece's U+2581 as a space)
                text = text.replace("\u2581", " ")
                toktypes.append(gguf.TokenType.USER_DEFINED)
        else:
            toktypes.append(gguf.TokenType.NORMAL)
        tokens.append(text.encode("utf-8"))
    return Vocab(model="gpt2", pre=pre, tokens=tokens, toktypes=toktypes, scores=None)


# ---------------------------------------------------------------------------------------------------------
# SentencePiece (tokenizer.model)
# ---------------------------------------------------------------------------------------------------------

# sentencepiece_model.proto: ModelPiece.Type. NORMAL=1 UNKNOWN=2 CONTROL=3 USER_DEFINED=4 UNUSED=5 BYTE=6
_SPM_TO_GGUF = {
    1: gguf.TokenType.NORMAL,
    2: gguf.TokenType.UNKNOWN,
    3: gguf.TokenType.CONTROL,
    # llama.cpp's converter has no IsUserDefined branch, so user-defined pieces are written as NORMAL
    # (tokenizer_config.json's added_tokens_decoder then re-types them, as below).
    4: gguf.TokenType.NORMAL,
    5: gguf.TokenType.UNUSED,
    6: gguf.TokenType.BYTE,
}


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _fields(buf: bytes) -> list[tuple[int, int, Any]]:
    """Decode one protobuf message into (field, wire type, value) triples; nested messages stay bytes."""
    out: list[tuple[int, int, Any]] = []
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos : pos + 8], pos + 8
        elif wire == 2:
            n, pos = _varint(buf, pos)
            value, pos = buf[pos : pos + n], pos + n
        elif wire == 5:
            value, pos = buf[pos : pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
        if pos > len(buf):
            raise ValueError("truncated field")
        out.append((field, wire, value))
    return out


def parse_sentencepiece_model(data: bytes) -> list[tuple[bytes, float, int]]:
    """(piece, score, sentencepiece type) for every piece of a serialized `ModelProto`, in id order."""
    pieces: list[tuple[bytes, float, int]] = []
    for field, wire, value in _fields(data):
        if field != 1 or wire != 2:  # ModelProto.pieces = 1; trainer/normalizer specs are not needed
            continue
        piece, score, kind = b"", 0.0, 1
        for f, w, v in _fields(value):
            if f == 1 and w == 2:
                piece = bytes(v)
            elif f == 2 and w == 5:
                score = struct.unpack("<f", v)[0]
            elif f == 3 and w == 0:
                kind = int(v)
        pieces.append((piece, score, kind))
    return pieces


def load_spm_vocab(hf_dir: Path, vocab_size: int | None) -> Vocab:
    """Token list, scores and types from `tokenizer.model`, as llama.cpp's `_create_vocab_sentencepiece`."""
    path = hf_dir / "tokenizer.model"
    if not path.is_file():
        raise ConversionError(f"{hf_dir}: tokenizer.model is missing (needed for the SentencePiece vocab)")
    try:
        pieces = parse_sentencepiece_model(path.read_bytes())
    except (OSError, ValueError, struct.error) as e:
        raise ConversionError(f"{path}: not a readable SentencePiece model ({e})") from None
    if not pieces:
        raise ConversionError(f"{path}: SentencePiece model has no pieces")
    n = vocab_size or len(pieces)
    tokens = [f"[PAD{i}]".encode() for i in range(n)]
    scores = [-10000.0] * n
    toktypes = [int(gguf.TokenType.UNUSED)] * n
    for i, (piece, score, kind) in enumerate(pieces[:n]):  # llama.cpp ignores pieces beyond vocab_size
        tokens[i] = piece
        scores[i] = score
        toktypes[i] = _SPM_TO_GGUF.get(kind, gguf.TokenType.NORMAL)

    added_path = hf_dir / "added_tokens.json"
    if added_path.is_file():
        for text, token_id in read_json_object(added_path).items():
            if int(token_id) < n:
                tokens[int(token_id)] = text.encode("utf-8")
                scores[int(token_id)] = -1000.0
                toktypes[int(token_id)] = gguf.TokenType.USER_DEFINED

    config_path = hf_dir / "tokenizer_config.json"
    if config_path.is_file():
        decoder = read_json_object(config_path).get("added_tokens_decoder") or {}
        for key, data in decoder.items():
            token_id, text = int(key), str(data["content"])
            if token_id >= n:
                continue
            if data.get("special") or does_token_look_special(text):
                toktypes[token_id] = gguf.TokenType.CONTROL
            else:
                text = text.replace("\u2581", " ")
                toktypes[token_id] = gguf.TokenType.USER_DEFINED
            scores[token_id] = -1000.0
            tokens[token_id] = text.encode("utf-8")
    return Vocab(model="llama", pre="default", tokens=tokens, toktypes=toktypes, scores=scores)


# ---------------------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------------------


def write_vocab(writer: gguf.GGUFWriter, vocab: Vocab, hf_dir: Path) -> None:
    """Write the token table plus special ids, add_* flags, merges and chat template."""
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.toktypes)
    bpe = vocab.model in ("gpt2", "gemma4")  # gemma4: llama.cpp's BPE over raw UTF-8 with byte fallback
    special = gguf.SpecialVocab(hf_dir, load_merges=bpe, n_vocab=len(vocab.tokens))
    if bpe and not special.merges:
        raise ConversionError(f"{hf_dir}: tokenizer.json has no BPE merges")
    _fill_special_ids(special, vocab, hf_dir)
    special.add_to_gguf(writer, quiet=True)


def _fill_special_ids(special: gguf.SpecialVocab, vocab: Vocab, hf_dir: Path) -> None:
    """Resolve bos/eos/unk/pad named in tokenizer_config.json that SpecialVocab left unset.

    SpecialVocab maps those names to ids through tokenizer.json's added_tokens only, so a checkpoint
    with just tokenizer.model (llama.cpp would then assume <unk> = 0) gets them from the token list here.
    """
    path = hf_dir / "tokenizer_config.json"
    config = read_json_object(path) if path.is_file() else {}
    ids = {tok: i for i, tok in enumerate(vocab.tokens)}
    for typ in ("bos", "eos", "unk", "pad"):
        if typ in special.special_token_ids:
            continue
        entry = config.get(f"{typ}_token")
        content = entry.get("content") if isinstance(entry, dict) else entry
        if isinstance(content, str) and content.encode("utf-8") in ids:
            special._set_special_token(typ, ids[content.encode("utf-8")])
    if "unk" not in special.special_token_ids and gguf.TokenType.UNKNOWN in vocab.toktypes:
        special._set_special_token("unk", vocab.toktypes.index(gguf.TokenType.UNKNOWN))
