"""`tandem bench --drift N`: the scripted (teacher-forced) decode of a drifting text and its tok/s per window, on
the CPU with a tiny random MoE model standing in for a `--routing zipf:S,drift:P` one (its phases given by the
patched `model_phases`: what the file says is checked on its own)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem.bench import drift
from tandem.cli.main import main
from tandem.runtime.engine import Engine
from tandem.synth.routing import token_phases


def test_bench_drift_feeds_the_script_and_reports_windows(
    tiny_qwen3moe_gguf: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    fed: list[list[int]] = []
    real_append = Engine.append

    def spy(self: Engine, ids: list[int]) -> torch.Tensor:
        fed.append(list(ids))
        return real_append(self, ids)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(drift, "model_phases", lambda llm: ("zipf:1,drift:2", 2))
        mp.setattr(Engine, "append", spy)
        argv = ["bench", "-m", str(tiny_qwen3moe_gguf[1]), "--pp", "12", "--tg", "20", "--reps", "2",
                "--drift", "8", "--drift-window", "4", "--json"]  # fmt: skip
        assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    n_vocab = 512  # tests/tiny_models.py
    prompt, script = drift.drift_tokens(n_vocab, 2, 12, 20, 8, seed=0)
    runs = [fed[i : i + 21] for i in range(len(fed) - 2 * 21, len(fed), 21)]  # after the warm-up: prompt + 20 steps
    for run in runs:
        assert run == [prompt] + [[t] for t in script]  # the prompt in one piece, then one scripted token per step
    assert token_phases(torch.tensor(prompt), n_vocab, 2).tolist() == [0] * 12
    assert token_phases(torch.tensor(script), n_vocab, 2).tolist() == [i // 8 % 2 for i in range(20)]
    windows = result["windows"]
    assert [(w["start"], w["tokens"], w["phase"]) for w in windows] == [
        (0, 4, 0), (4, 4, 0), (8, 4, 1), (12, 4, 1), (16, 4, 0)
    ]  # fmt: skip
    assert all(w["tok_s"] > 0 for w in windows)
    assert (result["every"], result["window"], result["reps"], result["routing"]) == (8, 4, 2, "zipf:1,drift:2")


def test_bench_drift_usage_errors(tiny_qwen3moe_gguf: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    model = str(tiny_qwen3moe_gguf[1])
    base = ["bench", "-m", model, "--pp", "8", "--tg", "8", "--reps", "1"]
    assert main([*base, "--drift", "64"]) == 2  # the tiny model was not written with drift
    assert "--drift needs a model written by `tandem synth --routing zipf:S,drift:P`" in capsys.readouterr().err
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(drift, "model_phases", lambda llm: ("zipf:1,drift:2", 2))
        for extra, message in [
            (["--drift", "6", "--drift-window", "4"], "--drift 6 must be a positive multiple of --drift-window 4"),
            (["--drift", "8", "--concurrency", "2"], "--concurrency and --drift are separate runs"),
            (["--drift", "8", "--pp", "8,16"], "--drift takes one --pp size"),
        ]:
            assert main([*base, *extra]) == 2
            err = capsys.readouterr().err
            assert message in err and err.count("\n") == 1, err
