"""`tandem convert` through the command line: the file it writes for each MoE family, and its bad-input error."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.cli.main import EXIT_USER_ERROR, main
from tandem.gguf.reader import open_gguf

# The session fixtures convert these tiny checkpoints with convert_hf(..., "f32"); the CLI must write the same file.
MOE_FIXTURES = ["tiny_qwen35moe_gguf", "tiny_qwen3next_gguf", "tiny_gemma4_gguf", "tiny_gpt_oss_gguf"]


@pytest.mark.parametrize("fixture", MOE_FIXTURES)
def test_cli_convert_matches_fixture(
    fixture: str, request: pytest.FixtureRequest, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hf_dir, ref_path = request.getfixturevalue(fixture)
    out = tmp_path / "cli.gguf"
    assert main(["convert", str(hf_dir), "-o", str(out), "--outtype", "f32"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"

    ref, got = open_gguf(ref_path), open_gguf(out)
    assert list(got.metadata.items()) == list(ref.metadata.items())
    assert list(got.tensors) == list(ref.tensors)  # same names, in the same order
    for name, r in ref.tensors.items():
        t = got.tensors[name]
        assert (t.qtype, t.shape, t.offset) == (r.qtype, r.shape, r.offset), name
        assert bytes(t.data) == bytes(r.data), name
    # Conversion is deterministic (no timestamps; general.name is the checkpoint directory's name, the same
    # here), so nothing else in the file may differ either: padding, alignment, header layout.
    assert out.read_bytes() == ref_path.read_bytes()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (None, "config.json is missing"),
        ("{bad", "cannot read JSON"),
        ("[1, 2]", "expected a JSON object, found a list"),
    ],
)
def test_cli_convert_not_a_model_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: str | None, message: str
) -> None:
    src = tmp_path / "notes"
    src.mkdir()
    (src / "README.md").write_text("not a checkpoint\n")
    if config is not None:
        (src / "config.json").write_text(config)
    out = tmp_path / "out.gguf"
    assert main(["convert", str(src), "-o", str(out)]) == EXIT_USER_ERROR
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), cap.err
    assert "config.json" in lines[0] and message in lines[0] and "Traceback" not in cap.err
    assert cap.out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]  # no output, no temporary file left
