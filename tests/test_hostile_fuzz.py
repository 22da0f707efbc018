"""The fuzzer's bounded CI run (issue 18): a fixed seed, about 90 s on 2 cores, no finding allowed.

Seeds: the tiny converted models of every supported architecture. The run is a fresh process (it forks a child per
case: a parent that has run OpenMP, as this pytest process has, must not fork). The long mode is run by hand:
docs/ROBUSTNESS.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = ("tiny_qwen3_gguf", "tiny_qwen3moe_gguf", "tiny_gemma3_gguf", "tiny_qwen35moe_gguf",
            "tiny_qwen3next_gguf", "tiny_gpt_oss_gguf", "tiny_gemma4_gguf")  # fmt: skip
MUTANTS = 1500
BUDGET_S = 90


@pytest.mark.slow
def test_fuzz_ci(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    seeds = [str(request.getfixturevalue(name)[1]) for name in FIXTURES]
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.fuzz", "--seeds", *seeds, "--mutants", str(MUTANTS), "--seed", "0",
         "--workers", "2", "--timeout", "20", "--memory-gib", "4", "--budget", str(BUDGET_S),
         "--findings", str(tmp_path / "findings")],
        capture_output=True, text=True, timeout=BUDGET_S + 120,
    )  # fmt: skip
    summary = json.loads(proc.stdout.splitlines()[0])
    assert proc.returncode == 0 and summary["findings"] == 0, proc.stdout[-5000:]
    assert summary["cases"] >= 300, summary  # it ran: a slow machine still gets through a few hundred
    assert set(summary["by_kind"]) == {"gguf", "template", "flags"}
