"""Hostile GGUF headers (issue 18): each one a one-line GGUFFormatError, in bounded time and memory."""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

import pytest
from gguf_factory import write_gguf

from tandem.cli.main import main
from tandem.errors import GGUFFormatError
from tandem.gguf import open_gguf
from tandem.gguf.header import quote

_ARRAY, _STRING, _UINT32, _FLOAT32 = 9, 8, 4, 6


def _string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _header(kvs: list[bytes], tensors: list[bytes] | None = None, pad: int = 0) -> bytes:
    """A GGUF v3 header of raw key-value and tensor entries, then `pad` zero bytes."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors or []), len(kvs))
    return head + b"".join(kvs) + b"".join(tensors or []) + b"\0" * pad


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _string(key.encode()) + struct.pack("<I", vtype) + payload


def _tensor(name: bytes, dims: tuple[int, ...], ggml_type: int = 0, offset: int = 0) -> bytes:
    return (
        _string(name)
        + struct.pack("<I", len(dims))
        + struct.pack(f"<{len(dims)}Q", *dims)
        + struct.pack("<IQ", ggml_type, offset)
    )


def _nested(depth: int) -> bytes:
    """An array holding an array holding ... `depth` levels."""
    payload = struct.pack("<IQ", _UINT32, 0)
    for _ in range(depth - 1):
        payload = struct.pack("<IQ", _ARRAY, 1) + payload
    return payload


HOSTILE: dict[str, tuple[bytes, str]] = {
    "nested 500 deep": (_header([_kv("x", _ARRAY, _nested(500))]), "nested more than 8 deep"),
    "10^6 empty arrays": (
        _header([_kv("x", _ARRAY, struct.pack("<IQ", _ARRAY, 10**6) + struct.pack("<IQ", _UINT32, 0) * 10**6)]),
        "arrays inside arrays",
    ),
    "10^9 array items": (_header([_kv("x", _ARRAY, struct.pack("<IQ", _UINT32, 10**9))]), "array of 1000000000"),
    "10^9-byte string": (_header([_kv("x", _STRING, struct.pack("<Q", 10**9))]), "string of 1000000000 bytes"),
    "2^64-1 tensors": (b"GGUF" + struct.pack("<IQQ", 3, 2**64 - 1, 0), "implausible counts"),
    "alignment a string": (_header([_kv("general.alignment", _STRING, _string(b"32"))]), "general.alignment '32'"),
    "alignment NaN": (_header([_kv("general.alignment", _FLOAT32, struct.pack("<f", float("nan")))]), "alignment"),
    "alignment inf": (_header([_kv("general.alignment", _FLOAT32, struct.pack("<f", float("inf")))]), "alignment"),
    "alignment an array": (
        _header([_kv("general.alignment", _ARRAY, struct.pack("<IQI", _UINT32, 1, 32))]),
        "general.alignment '[32]'",
    ),
    "alignment 0": (_header([_kv("general.alignment", _UINT32, struct.pack("<I", 0))]), "power of two"),
    "alignment 48": (_header([_kv("general.alignment", _UINT32, struct.pack("<I", 48))]), "power of two"),
    "duplicate key": (_header([_kv("a", _UINT32, b"\0" * 4)] * 2), "metadata key 'a' appears twice"),
    "dims wrap past 2^64": (_header([], [_tensor(b"t", (2**32, 2**32))], pad=64), "more than 2^63 elements"),
    "5 dims": (_header([], [_tensor(b"t", (1, 1, 1, 1, 1))]), "5 dimensions"),
    "newline in a name": (_header([], [_tensor(b"a\nTraceback", (1,))], pad=64), r"'a\nTraceback'"),
    "name too long": (_header([], [_tensor(b"n" * 100, (1,))], pad=64), "string of 100 bytes"),
    "duplicate tensor": (_header([], [_tensor(b"t", (1,))] * 2, pad=64), "tensor 't' appears twice"),
    "unaligned offset": (_header([], [_tensor(b"t", (1,), offset=3)], pad=64), "not a multiple of alignment"),
    "data past the end": (_header([], [_tensor(b"t", (2**20,))], pad=64), "beyond the end of the file"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_header(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    data, message = HOSTILE[case]
    path = tmp_path / "hostile.gguf"
    path.write_bytes(data)
    start = time.monotonic()
    with pytest.raises(GGUFFormatError) as e:
        open_gguf(path)
    assert time.monotonic() - start < 2.0
    assert message in str(e.value) and "\n" not in str(e.value)
    assert main(["inspect", "-m", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err


def test_big_string_in_a_big_file_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """A 10^8-byte string that the (sparse) file does hold: over the string cap, refused without a copy."""
    path = tmp_path / "sparse.gguf"
    with open(path, "wb") as f:
        f.write(_header([_kv("x", _STRING, struct.pack("<Q", 10**8))]))
        f.truncate(10**8 + 100)
    with pytest.raises(GGUFFormatError, match="string of 100000000 bytes"):
        open_gguf(path)


def test_fifo_is_refused_without_blocking(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    with pytest.raises(GGUFFormatError, match="not a regular file"):
        open_gguf(fifo)
    for command in (["inspect"], ["run", "-p", "hi"]):
        assert main([*command, "-m", str(fifo)]) == 2
        assert "not a regular file" in capsys.readouterr().err


def test_device_is_refused() -> None:
    with pytest.raises(GGUFFormatError, match="not a regular file"):
        open_gguf("/dev/zero")


def test_valid_files_still_open(tmp_path: Path) -> None:
    f = open_gguf(write_gguf(tmp_path / "ok.gguf", values={"general.alignment": 64}))
    assert f.tensors["token_embd.weight"].n_elements == 64 * 64


def test_quote_escapes_and_cuts() -> None:
    assert quote("a\nb\x1b[31m") == r"'a\nb\x1b[31m'"
    assert len(quote("x" * 1000)) == 80 and quote("x" * 1000).endswith("...'")


@pytest.mark.parametrize(
    ("values", "shown"),
    [
        ({"general.architecture": "x\n" * 400 + "Traceback (most recent call last):"}, "architecture 'x\\nx\\n"),
        ({"tokenizer.ggml.pre": "p\r\n" * 400}, "pre-tokenizer 'p\\r\\n"),
    ],
)
def test_names_from_the_file_stay_on_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], values: dict[str, object], shown: str
) -> None:
    """Issue 18: one file gave a 726-line "one-line" error. Names and values from the file are escaped and cut."""
    path = write_gguf(tmp_path / "names.gguf", values=values)
    assert main(["run", "-m", str(path), "-p", "hi", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and shown in err and len(err) < 300, err


def test_cli_keeps_any_message_on_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from tandem.cli import commands
    from tandem.errors import TandemError

    def fail(args: object) -> int:
        raise TandemError("first\nTraceback (most recent call last):\n\x1b[31m" + "y" * 5000)

    monkeypatch.setattr(commands, "inspect", fail)
    assert main(["inspect"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\\x1b" in err and len(err) < 1100


@pytest.mark.parametrize("fixture", ["tiny_qwen3_gguf", "tiny_gpt_oss_gguf", "tiny_gemma4_gguf"])
def test_a_missing_tensor_is_refused_by_inspect_as_by_run(
    fixture: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest
) -> None:
    """A file without a tensor its architecture needs: `inspect` gives `run`'s one-line error, not a plan (the
    layers are built on the weights where they lie; nothing is loaded)."""
    from tandem.fuzz.gguf_edit import GGUFParts

    parts = GGUFParts.read(Path(request.getfixturevalue(fixture)[1]))
    parts.tensors = [t for t in parts.tensors if t.name != "blk.0.attn_q.weight"]
    path = parts.write(tmp_path / "missing.gguf")
    capsys.readouterr()  # the fixture's conversion output
    for command in (["inspect"], ["run", "-p", "hi", "-n", "1", "--device", "cpu"]):
        assert main([*command, "-m", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: "), err
        assert "required tensor 'blk.0.attn_q.weight' is missing" in err, err
