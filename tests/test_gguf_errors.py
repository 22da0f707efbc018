"""Every malformed or unsupported input gives a typed one-line error (API) and exit 2 (CLI)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
from gguf_factory import write_gguf

from tandem.cli.main import main
from tandem.errors import GGUFFormatError, MissingMetadataError, UnsupportedModelError
from tandem.gguf import open_gguf
from tandem.models import read_config
from tandem.quant.types import check_supported


def _cli_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_valid_file_opens(tmp_path: Path) -> None:
    f = open_gguf(write_gguf(tmp_path / "ok.gguf"))
    assert f.arch == "qwen3"
    t = f.tensors["token_embd.weight"]
    assert t.shape == (64, 64) and t.n_bytes == 64 * 64 * 4


def test_wrong_magic(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGML" + b"\0" * 100)
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        open_gguf(path)
    assert "not a GGUF file" in _cli_error(capsys, "inspect", "-m", str(path))


def test_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "no such file" in _cli_error(capsys, "inspect", "-m", str(tmp_path / "nope.gguf"))


@pytest.mark.parametrize("keep", [6, 30, 200])
def test_truncated_header(tmp_path: Path, keep: int, capsys: pytest.CaptureFixture[str]) -> None:
    data = write_gguf(tmp_path / "ok.gguf").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:keep])
    with pytest.raises(GGUFFormatError):
        open_gguf(path)
    _cli_error(capsys, "inspect", "-m", str(path))


def test_tensor_data_out_of_bounds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = write_gguf(tmp_path / "ok.gguf").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:-100])  # the header is intact, the tensor data is not
    with pytest.raises(GGUFFormatError, match="beyond the end of the file"):
        open_gguf(path)
    assert "truncated" in _cli_error(capsys, "inspect", "-m", str(path))


def test_unknown_architecture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_gguf(tmp_path / "arch.gguf", arch="frobnicator")
    with pytest.raises(UnsupportedModelError, match="architecture 'frobnicator' is not supported"):
        read_config(open_gguf(path))
    assert "frobnicator" in _cli_error(capsys, "inspect", "-m", str(path))


def test_missing_required_metadata(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_gguf(tmp_path / "meta.gguf", drop_keys=("embedding_length",))
    with pytest.raises(MissingMetadataError, match="qwen3.embedding_length"):
        read_config(open_gguf(path))
    assert "embedding_length" in _cli_error(capsys, "inspect", "-m", str(path))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"qwen3.block_count": "two"}, "malformed qwen3 metadata (ValueError"),
        ({"qwen3.attention.head_count": 0}, "malformed qwen3 metadata (ZeroDivisionError"),
        ({"qwen3.attention.head_count_kv": 0}, "n_kv_heads 0"),
        ({"qwen3.embedding_length": 0}, "hidden 0"),
        ({"tokenizer.ggml.tokens": 5}, "malformed qwen3 metadata (TypeError"),
    ],
)
def test_malformed_metadata_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], values: dict[str, object], message: str
) -> None:
    """The right keys with wrong types or values: one line naming the file, never the reader's traceback."""
    path = write_gguf(tmp_path / "odd.gguf", values=values)
    with pytest.raises((GGUFFormatError, UnsupportedModelError), match=re.escape(message)):
        read_config(open_gguf(path))
    assert message in _cli_error(capsys, "inspect", "-m", str(path))


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ({}, "'token_embd.weight' has shape (64, 64); the metadata's vocabulary is 128"),
        ({"blk.0.attn_norm.weight": (63,)}, "'blk.0.attn_norm.weight' has shape (63,); the metadata's width is 64"),
        ({"blk.0.attn_q.weight": (32, 64)}, "the metadata's heads x head size is 64 or 128"),
        ({"blk.0.attn_k.weight": (64, 64)}, "the metadata's KV heads x head size is 32"),
        ({"blk.0.ffn_down.weight": (128, 64)}, "'blk.0.ffn_down.weight' has shape (128, 64); the metadata's width"),
        ({"blk.0.ffn_up_exps.weight": (4, 32, 64)}, "the metadata's expert count is 8"),  # a qwen3moe file below
        ({"blk.0.ffn_down_exps.weight": (8, 64, 16)}, "the metadata's expert FFN size is 32"),
    ],
)
def test_tensor_shapes_that_do_not_fit_the_metadata(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tensors: dict[str, tuple[int, ...]], message: str
) -> None:
    """As llama.cpp refuses such a file at load: one line naming the tensor, not a failure in the first forward."""
    values: dict[str, object] = {} if tensors else {"tokenizer.ggml.tokens": [f"t{i}" for i in range(128)]}
    moe = any(name.endswith("_exps.weight") for name in tensors)
    if moe:  # 8 experts of 32, 2 used
        keys = ("expert_count", "expert_used_count", "expert_feed_forward_length")
        values = {f"qwen3moe.{key}": n for key, n in zip(keys, (8, 2, 32), strict=True)}
    arch = "qwen3moe" if moe else "qwen3"
    path = write_gguf(tmp_path / "shapes.gguf", arch=arch, values=values, extra_tensors=tensors)
    with pytest.raises(GGUFFormatError, match=re.escape(message)):
        read_config(open_gguf(path))
    assert message in _cli_error(capsys, "inspect", "-m", str(path))


def test_unsupported_quant_type(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_gguf(tmp_path / "iq2.gguf", tensor_type=gguf.GGMLQuantizationType.IQ2_XXS)
    info = open_gguf(path).tensors["token_embd.weight"]
    with pytest.raises(UnsupportedModelError, match="IQ2_XXS"):
        check_supported(info.qtype, info.name)
    assert "IQ2_XXS" in _cli_error(capsys, "run", "-m", str(path), "-p", "hi")


def test_cli_subprocess_has_no_traceback(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"\x00" * 10)
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.cli.main", "inspect", "-m", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: ") and "Traceback" not in proc.stderr
