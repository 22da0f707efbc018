"""--expert-stats and --moe-cache through the API and the CLI on the CPU: picks counted while a model runs and
added to the file at close, a file of another model refused in one line (exit 2), and `inspect` showing the
cached experts per layer (text and --json) without a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import tandem
from tandem.cli.main import main
from tandem.convert import convert_hf
from tandem.placement import ExpertStats


@pytest.fixture(scope="module")
def q8_moe(tiny_qwen3moe_gguf: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert_hf(tiny_qwen3moe_gguf[0], tmp_path_factory.mktemp("q8") / "tiny-q8_0.gguf", "q8_0")


def test_picks_are_counted_and_added_to_the_file(q8_moe: Path, tmp_path: Path) -> None:
    stats = tmp_path / "s.json"
    with tandem.LLM(q8_moe, device="cpu", n_ctx=64, expert_stats=stats) as llm:
        llm.engine.feed(list(range(3, 13)))  # 10 rows
        for t in range(4):
            llm.engine.append([t + 20])
        assert llm.routing_counts is not None
    first = json.loads(stats.read_text())
    assert first["picks"] == 2 * (10 + 4) * 2  # layers x rows x experts per token
    assert np.asarray(first["counts"]).sum(axis=1).tolist() == [28, 28]
    with tandem.LLM(q8_moe, device="cpu", n_ctx=64, expert_stats=stats) as llm:
        llm.engine.feed([5, 6, 7])
    second = json.loads(stats.read_text())
    assert second["picks"] == first["picks"] + 2 * 3 * 2  # added, not replaced
    # the first run in one half, the second in the other (the one with fewer picks)
    assert np.asarray(second["halves"]).sum(axis=(1, 2)).tolist() == [first["picks"], 2 * 3 * 2]


def test_each_text_of_a_run_goes_to_a_half_of_its_own(q8_moe: Path, tmp_path: Path) -> None:
    stats = tmp_path / "s.json"
    with tandem.LLM(q8_moe, device="cpu", n_ctx=64, expert_stats=stats) as llm:
        llm.generate_ids([3, 4, 5, 6], max_tokens=2, temperature=0.0)  # 4 + 1 rows (the last token is not run)
        llm.generate_ids([7, 8], max_tokens=2, temperature=0.0)  # 2 + 1
        llm.engine.reset()
        llm.engine.append([9, 10, 11])  # 3 rows of a third text, after a reset
    doc = json.loads(stats.read_text())
    per_text = 2 * 2  # layers x experts per token
    # texts of 5, 3 and 3 rows, each into the half with fewer picks: 5 | 3, then 5 | 6
    assert np.asarray(doc["halves"]).sum(axis=(1, 2)).tolist() == [5 * per_text, 6 * per_text]
    assert doc["picks"] == 11 * per_text


def test_a_file_of_another_model_is_a_one_line_error(
    q8_moe: Path, tiny_qwen35moe_gguf: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stats = tmp_path / "s.json"
    with tandem.LLM(q8_moe, device="cpu", n_ctx=32, expert_stats=stats) as llm:
        llm.engine.feed([1, 2])
    code = main(["inspect", "-m", str(tiny_qwen35moe_gguf[1]), "--expert-stats", str(stats)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"error: --expert-stats {stats}: recorded for another model")


def test_inspect_shows_the_cache_per_layer(q8_moe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stats = tmp_path / "s.json"
    from tandem.gguf import open_gguf
    from tandem.models import read_config

    f = open_gguf(q8_moe)
    s = ExpertStats.open(stats, f, read_config(f))
    s.add(np.array([[0, 0, 0, 0, 0, 9, 9, 1], [5, 0, 0, 0, 0, 0, 0, 0]]))
    s.save()
    flags = ["inspect", "-m", str(q8_moe), "--device", "cuda", "--cpu-moe", "--moe-cache", "40KiB"]
    assert main([*flags, "--expert-stats", str(stats), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    cache = plan["expert_cache"]
    assert cache["experts"] == {"0": [5, 6], "1": [0]}
    assert plan["expected_gpu_bytes"] >= cache["bytes"] > 0
    assert main([*flags, "--expert-stats", str(stats)]) == 0
    out = capsys.readouterr().out
    assert "expert cache (3 experts)" in out and "layer 0: 2 of 8" in out and "layer 1: 1 of 8" in out
    assert main(flags) == 0  # no statistics: the lowest ids
    assert "lowest expert ids" in capsys.readouterr().out


def test_moe_cache_needs_experts_in_host_ram(q8_moe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "-m", str(q8_moe), "--device", "cuda", "--moe-cache", "1GiB"]) == 2
    assert "--moe-cache 1.00 GiB: no routed experts are in host RAM" in capsys.readouterr().err
