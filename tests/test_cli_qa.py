"""The command line as a user meets it: files the user owns are refused unchanged, flags no run could use are usage
errors before anything runs, and Ctrl-C at any time ends in exit 130 without a traceback."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tandem.cli import main as cli_main
from tandem.cli.main import EXIT_USER_ERROR, main


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


@pytest.fixture
def deadline() -> Iterator[None]:
    """Fails a test that blocks (a read of a FIFO) instead of hanging the suite."""

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError("blocked for 20 s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_expert_stats_fifo_is_refused_without_blocking(
    tiny_qwen3moe_gguf: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], deadline: None
) -> None:
    fifo = tmp_path / "stats.json"
    os.mkfifo(fifo)
    assert main(["inspect", "-m", str(tiny_qwen3moe_gguf[1]), "--expert-stats", str(fifo)]) == EXIT_USER_ERROR
    assert "not a regular file" in _one_error_line(capsys)


def test_expert_stats_naming_the_model_is_refused_unread_and_unchanged(
    tiny_qwen3moe_gguf: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A GGUF given as the statistics is refused by its size, not read into memory (a real model is many GiB)."""
    model = tmp_path / "model.gguf"
    model.write_bytes(tiny_qwen3moe_gguf[1].read_bytes())
    before = _sha256(model)
    flags = ["-m", str(model), "--device", "cpu", "--expert-stats", str(model)]
    assert main(["run", *flags, "-p", "hi", "-n", "2"]) == EXIT_USER_ERROR
    assert "not an expert-statistics file" in _one_error_line(capsys)
    assert _sha256(model) == before


def test_expert_stats_in_a_missing_folder_fails_before_generating(
    tiny_qwen3moe_gguf: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The file is written at the end: a folder that cannot hold it must not cost a whole run's counts."""
    stats = tmp_path / "missing" / "stats.json"
    flags = ["-m", str(tiny_qwen3moe_gguf[1]), "--device", "cpu", "--expert-stats", str(stats)]
    assert main(["run", *flags, "-p", "hi", "-n", "2"]) == EXIT_USER_ERROR
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert f"the folder {stats.parent} cannot hold one" in captured.err


def test_expert_stats_through_a_symlink_update_the_file_it_names(
    tiny_qwen3moe_gguf: tuple[Path, Path], tmp_path: Path
) -> None:
    shared = tmp_path / "shared" / "stats.json"
    shared.parent.mkdir()
    link = tmp_path / "stats.json"
    link.symlink_to(shared)
    flags = ["-m", str(tiny_qwen3moe_gguf[1]), "--device", "cpu", "--expert-stats", str(link)]
    assert main(["run", *flags, "-p", "hi", "-n", "2"]) == 0
    assert link.is_symlink() and json.loads(shared.read_text())["picks"] > 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--budget", "-1"], "--budget must be a positive number of seconds, got -1"),
        (["--budget", "0"], "--budget must be a positive number of seconds, got 0"),
        (["--timeout", "nan"], "--timeout must be a positive number of seconds, got nan"),
        (["--timeout", "inf"], "--timeout must be a positive number of seconds, got inf"),
    ],
)
def test_bench_time_limits_are_checked_before_any_run(
    tiny_qwen3moe_gguf: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    message: str,
) -> None:
    report = tmp_path / "report"
    argv = ["bench", "-m", str(tiny_qwen3moe_gguf[1]), "--device", "cpu", "--pp", "8", "--tg", "4", "--reps", "1"]
    assert main([*argv, "--report", str(report), *flags]) == EXIT_USER_ERROR
    assert message in _one_error_line(capsys)
    assert not report.exists()


def test_bench_report_refuses_bad_expert_stats_before_any_run(
    tiny_qwen3moe_gguf: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The worker processes read the file; the usage error must come first, not as a failed row (exit 1)."""
    notes = tmp_path / "notes.txt"
    notes.write_text("not statistics\n")
    argv = ["bench", "-m", str(tiny_qwen3moe_gguf[1]), "--device", "cpu", "--pp", "8", "--tg", "4", "--reps", "1"]
    report = tmp_path / "report"
    assert main([*argv, "--report", str(report), "--expert-stats", str(notes)]) == EXIT_USER_ERROR
    assert "cannot read it as expert statistics" in _one_error_line(capsys)
    assert not report.exists() and notes.read_text() == "not statistics\n"


def test_convert_over_an_existing_file_names_the_flag(
    tiny_qwen3_gguf: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "mine.txt"
    out.write_text("the user's notes\n")
    before = _sha256(out)
    assert main(["convert", str(tiny_qwen3_gguf[0]), "-o", str(out)]) == EXIT_USER_ERROR
    assert "already exists (pass --overwrite" in _one_error_line(capsys)
    assert _sha256(out) == before


def test_the_cli_module_does_not_import_torch() -> None:
    """`tandem` imports the CLI through the package: torch (over a second) must load inside main(), where Ctrl-C
    is caught, and `tandem --help` stays fast."""
    code = "import sys, tandem.cli.main; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_ctrl_c_while_the_command_starts_is_exit_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_main, "build_parser", interrupted)
    try:
        code = main(["run", "-p", "hi"])
    except KeyboardInterrupt:  # escaping main: the interpreter would print a traceback
        pytest.fail("Ctrl-C before the command ran escaped main()")
    assert code == 130
    assert "Traceback" not in capsys.readouterr().err


def test_run_system_prompt_needs_chat(tiny_qwen3_gguf: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """Without --chat the prompt is plain text: a system message would be dropped without a word."""
    argv = ["run", "-m", str(tiny_qwen3_gguf[1]), "--device", "cpu", "-p", "hi", "-n", "2", "-sys", "be brief"]
    assert main(argv) == EXIT_USER_ERROR
    assert "-sys/--system-prompt needs --chat" in _one_error_line(capsys)


def test_context_above_the_training_context_is_noticed(
    tiny_qwen3_gguf: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """As llama.cpp warns of a training-context overflow: the tiny model was trained on 512 tokens."""
    argv = ["run", "-m", str(tiny_qwen3_gguf[1]), "--device", "cpu", "-p", "hi", "-n", "2", "--temp", "0"]
    for ctx, noticed in (("1024", True), ("512", False)):
        assert main([*argv, "-c", ctx]) == 0
        err = capsys.readouterr().err
        notice = "notice: the context size 1,024 (-c) is above the 512 tokens the model was trained on"
        assert (notice in err) == noticed and ("trained on" in err) == noticed, err


def test_seed_minus_one_is_random_as_in_llama_cpp(
    tiny_qwen3_gguf: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """llama.cpp command lines pass `-s -1` for a random seed: two runs must not draw the same 16 tokens."""
    argv = ["run", "-m", str(tiny_qwen3_gguf[1]), "--device", "cpu", "-p", "hi", "-n", "16", "-s", "-1"]
    sampling = ["--temp", "1.5", "--top-k", "0", "--top-p", "1", "--min-p", "0"]
    texts = []
    for _ in range(2):
        assert main([*argv, *sampling]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] != texts[1]


@pytest.mark.parametrize("command", ["synth", "convert"])
def test_output_under_a_file_is_one_line_and_the_file_unchanged(
    command: str, tiny_qwen3_gguf: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """-o a/b.gguf where `a` is the user's file: the folder cannot be made (and the cleanup of the temporary file
    that was never written used to raise a second error, a traceback)."""
    notes = tmp_path / "notes.txt"
    notes.write_text("the user's notes\n")
    out = notes / "model.gguf"
    source = ["convert", str(tiny_qwen3_gguf[0])]
    if command == "synth":
        source = ["synth", "--like", "qwen3-30b-a3b", "--layers", "1"]
    assert main([*source, "-o", str(out)]) == EXIT_USER_ERROR
    assert f"{out}: cannot write ({notes}: " in _one_error_line(capsys)
    assert notes.read_text() == "the user's notes\n"


def test_override_tensor_takes_llama_cpp_lists_and_buffer_names(
    tiny_qwen3moe_gguf: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """llama.cpp's `-ot` takes 'REGEX=BUFT,REGEX=BUFT' with buffer names CPU, CUDA0...; a comma inside a regex
    stays part of it."""
    ot = r"blk\.[0]{1,2}\.ffn_.*_exps=CPU,blk\.1\.ffn_.*_exps=CUDA0"
    argv = ["inspect", "-m", str(tiny_qwen3moe_gguf[1]), "--device", "cuda", "-ot", ot, "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["cpu_expert_layers"] == [0]
    assert main([*argv[:-3], "-ot", "exps=CUDA1", "--json"]) == EXIT_USER_ERROR  # a second GPU needs --tp
    assert "cuda:1" in _one_error_line(capsys)


@pytest.mark.parametrize("kwargs", ["[" * 100_000 + "]" * 100_000, '{"a": ' + "9" * 5000 + "}"])
def test_chat_template_kwargs_past_json_limits_are_one_line(
    kwargs: str, tiny_qwen3_gguf: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Nesting past the recursion limit and integers past Python's 4,300 digits: errors of json.loads that are no
    JSONDecodeError."""
    argv = ["run", "-m", str(tiny_qwen3_gguf[1]), "--device", "cpu", "-p", "hi", "--chat"]
    assert main([*argv, "--chat-template-kwargs", kwargs]) == EXIT_USER_ERROR
    assert "--chat-template-kwargs is not JSON" in _one_error_line(capsys)


@pytest.mark.parametrize("text", ["[" * 30_000 + "]" * 30_000, '{"format": ' + "9" * 5000 + "}"])
def test_expert_stats_past_json_limits_are_one_line(
    text: str, tiny_qwen3moe_gguf: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stats = tmp_path / "stats.json"
    stats.write_text(text)
    assert main(["inspect", "-m", str(tiny_qwen3moe_gguf[1]), "--expert-stats", str(stats)]) == EXIT_USER_ERROR
    assert "cannot read it as expert statistics" in _one_error_line(capsys)
    assert stats.read_text() == text


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("config.json", "[" * 30_000 + "]" * 30_000),
        ("config.json", '{"a": ' + "9" * 5000 + "}"),
        ("model.safetensors", b'[1]'),
        ("model.safetensors", b'{"w": {"dtype": "F32", "shape": [1]}}'),
        ("model.safetensors", b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}'),
        ("model.safetensors.index.json", '{"weight_map": [1]}'),
    ],
)
def test_convert_of_a_malformed_checkpoint_is_one_line(
    name: str,
    content: str | bytes,
    tiny_qwen3_gguf: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    for f in tiny_qwen3_gguf[0].iterdir():
        (hf_dir / f.name).write_bytes(f.read_bytes())
    if isinstance(content, bytes):  # a safetensors header: its length, then the JSON
        content = len(content).to_bytes(8, "little") + content + bytes(64)
        (hf_dir / name).write_bytes(content)
    else:
        (hf_dir / name).write_text(content)
    out = tmp_path / "out.gguf"
    assert main(["convert", str(hf_dir), "-o", str(out)]) == EXIT_USER_ERROR
    assert name in _one_error_line(capsys)
    assert not out.exists()


def test_sampling_takes_llama_cpp_off_values() -> None:
    """llama.cpp's "off" values mean the same in the API, the CLI and the server (one place: SamplingParams): seed
    -1 is a fresh random seed, a top-k of 0 or less keeps every token."""
    from tandem.runtime.sampling import Sampler, SamplingParams

    assert SamplingParams(seed=-1).seed is None
    params = SamplingParams(top_k=-1, top_p=1.0, min_p=0.0)
    probs, ids = Sampler(params).candidates(torch.linspace(-3, 3, 100))
    assert len(ids) == 100 and torch.isclose(probs.sum(), torch.tensor(1.0))
