"""The real Gemma 3 270M Q4_K_M against llama.cpp's recorded greedy tokens.

The fixture is recorded by scripts/record_llamacpp_fixtures.py (llama-cpp-python, CPU build).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tandem
from tandem.api import default_model_path

FIXTURE = Path(__file__).parent / "fixtures" / "gemma3_270m_llamacpp.json"


@pytest.fixture(scope="module")
def fixture() -> dict:
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def gemma() -> tandem.LLM:
    llm = tandem.LLM(default_model_path(), n_ctx=512, threads=2)
    yield llm
    llm.close()


@pytest.mark.xfail(
    strict=True,
    reason="not met yet: 2 of 8 prompts match for 32 tokens, the others diverge at tokens 3-22. The last-position "
    "logits differ from llama.cpp's by up to 0.55 -- as much as llama.cpp's own differ between flash attention on "
    "and off (0.54) -- so matching needs ggml's exact attention and GELU rounding (docs/PERFORMANCE.md).",
)
def test_greedy_tokens_match_llamacpp(gemma: tandem.LLM, fixture: dict) -> None:
    cases = fixture["greedy"]
    assert len(cases) >= 5
    for case in cases:
        assert len(case["tokens"]) >= 32
        ours = gemma.generate_ids(case["prompt_ids"], max_tokens=len(case["tokens"]), temperature=0)
        assert ours == case["tokens"], f"prompt {case['prompt']!r}"


def test_greedy_prefix_matches_llamacpp(gemma: tandem.LLM, fixture: dict) -> None:
    """What holds today: every prompt's first 3 greedy tokens, and 2 prompts' full 32 tokens."""
    full = 0
    for case in fixture["greedy"]:
        ours = gemma.generate_ids(case["prompt_ids"], max_tokens=len(case["tokens"]), temperature=0)
        assert ours[:3] == case["tokens"][:3], f"prompt {case['prompt']!r}"
        full += ours == case["tokens"]
    assert full >= 2


def test_prompt_tokenization_matches_llamacpp(gemma: tandem.LLM, fixture: dict) -> None:
    for case in fixture["greedy"]:
        assert gemma.tokenize(case["prompt"]) == case["prompt_ids"]


def test_top_logits_close_to_llamacpp(gemma: tandem.LLM, fixture: dict) -> None:
    for case in fixture["logits"]:
        ours = gemma.logits(case["prompt_ids"])[-1]
        top = case["top50"]  # [(id, logit), ...] from llama.cpp, most likely first
        assert int(ours.argmax()) == top[0][0]
        # Measured: at most 0.55 apart (llama.cpp's own flash-attention on/off spread on this file: 0.54).
        for token, logit in top:
            assert abs(float(ours[token]) - logit) < 0.6, (token, float(ours[token]), logit)
