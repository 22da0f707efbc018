"""llama.cpp's penalties sampler (repeat, frequency, presence over the last repeat_last_n tokens), and that the
flags reach it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.errors import TandemError
from tandem.runtime.sampling import SamplingParams, penalize_repeats


def _llamacpp(logits: list[float], history: list[int], p: SamplingParams) -> list[float]:
    """llama_sampler_penalties_apply, written out: per token of the window, by its count."""
    window = history[-p.repeat_last_n :] if p.repeat_last_n > 0 else history
    out = list(logits)
    for token in set(window):
        count = window.count(token)
        out[token] = out[token] * p.repeat_penalty if out[token] <= 0 else out[token] / p.repeat_penalty
        out[token] -= count * p.frequency_penalty + p.presence_penalty
    return out


@pytest.mark.parametrize("last_n", [0, 3, 64])
def test_penalties_as_llama_cpp(last_n: int) -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -0.25, 0.0])
    history = [0, 1, 1, 3, 5, 1, 0]
    p = SamplingParams(repeat_penalty=1.3, repeat_last_n=last_n, presence_penalty=0.4, frequency_penalty=0.25)
    got = penalize_repeats(logits, history, p)
    assert torch.allclose(got, torch.tensor(_llamacpp(logits.tolist(), history, p)), atol=1e-6)
    assert torch.equal(logits, torch.tensor([2.0, -1.0, 0.5, 3.0, -0.25, 0.0]))  # the input is left as it was


def test_penalty_limits() -> None:
    with pytest.raises(TandemError, match=r"presence_penalty \(--presence-penalty\) must be at most 2"):
        SamplingParams(presence_penalty=2.5)


def test_flags_reach_the_sampler(tiny_qwen3moe_gguf: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """--repeat-last-n, --presence-penalty and --frequency-penalty arrive in the run's SamplingParams."""
    from tandem.cli.main import main
    from tandem.runtime import sampling

    seen: list[SamplingParams] = []
    init = sampling.Sampler.__init__

    def record(self: sampling.Sampler, params: SamplingParams) -> None:
        seen.append(params)
        init(self, params)

    monkeypatch.setattr(sampling.Sampler, "__init__", record)
    argv = ["run", "-m", str(tiny_qwen3moe_gguf[1]), "--device", "cpu", "-t", "1", "-c", "64", "-p", "hello",
            "-n", "2", "--repeat-last-n", "7", "--presence-penalty", "0.5", "--frequency-penalty", "-0.5"]  # fmt: skip
    assert main(argv) == 0
    assert [(p.repeat_last_n, p.presence_penalty, p.frequency_penalty) for p in seen] == [(7, 0.5, -0.5)]
