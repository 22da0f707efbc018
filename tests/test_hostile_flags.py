"""Hostile flags and logits (issue 18): one-line errors naming the flag, never a traceback or a hang."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.cli.main import main
from tandem.errors import TandemError
from tandem.runtime.sampling import NonFiniteLogitsError, Sampler, SamplingParams, check_option

FLAGS = [
    (["--temp", "nan"], "temperature (--temp) must be finite"),
    (["--temp", "inf"], "temperature (--temp) must be finite"),
    (["--seed", str(2**70)], "seed (-s/--seed) must be at most"),
    (["-c", str(10**12)], "n_ctx (-c/--ctx-size) must be at most"),
    (["-t", "100000"], "threads (-t) must be at most 512"),
    (["-b", "-5"], "n_batch (-b/--batch-size) must be positive"),
    (["--top-p", "nan"], "top_p (--top-p) must be finite"),
    (["--top-k", str(2**40)], "top_k (--top-k) must be at most"),
    (["--min-p", "2"], "min_p (--min-p) must be at most 1"),
    (["-n", "-7"], "max_tokens (-n/--n-predict) must be >= -1"),
    (["--repeat-penalty", "-1"], "repeat_penalty (--repeat-penalty) must be >="),
    (["--repeat-last-n", "-9"], "repeat_last_n (--repeat-last-n) must be >= -1"),
    (["--pcie-experts", "-1"], "pcie_experts (--pcie-experts) must be >= 0"),
]


@pytest.mark.parametrize(("flags", "message"), FLAGS)
def test_numeric_flags_are_range_checked(
    tiny_qwen3_gguf: tuple[Path, Path], capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    capsys.readouterr()
    assert main(["run", "-m", str(tiny_qwen3_gguf[1]), "-p", "hi", "-n", "2", "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {message}"), err


def test_api_options_take_the_same_checks() -> None:
    with pytest.raises(TandemError, match=r"temperature \(--temp\) must be finite"):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(TandemError, match="must be an integer"):
        check_option("n_ctx", 4.5)
    with pytest.raises(TandemError, match="must be an integer"):
        check_option("seed", True)
    check_option("seed", 2**64 - 1)  # torch's largest


def test_kv_cache_larger_than_memory(tiny_qwen3_gguf: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """-c within its range but past this machine's memory (here a machine of 1 GiB): refused before loading."""
    import types

    import tandem
    import tandem.api

    monkeypatch.setattr(tandem.api.psutil, "virtual_memory", lambda: types.SimpleNamespace(total=1 << 30))
    with pytest.raises(TandemError, match="KV cache of 16777216 tokens"):
        tandem.LLM(tiny_qwen3_gguf[1], device="cpu", n_ctx=1 << 24, cache_type="f32")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_logits_are_an_error(temperature: float) -> None:
    sampler = Sampler(SamplingParams(temperature=temperature, seed=1))
    for bad in (float("nan"), float("inf")):
        logits = torch.zeros(16)
        logits[3] = bad
        with pytest.raises(NonFiniteLogitsError, match="1 non-finite logits"):
            sampler(logits, [])


def test_tiny_temperature_samples_its_limit() -> None:
    """logits / 1e-300 overflows: the draw is the limit distribution (the most likely token), not NaNs."""
    sampler = Sampler(SamplingParams(temperature=1e-300, top_k=0, top_p=1.0, min_p=0.0, seed=1))
    logits = torch.arange(16, dtype=torch.float32)
    assert sampler(logits, []) == 15
