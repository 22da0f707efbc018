"""The tiny Gemma 3 in Q8_0 against llama.cpp reading the same GGUF with its default f16 K/V cache
(tests/fixtures/gemma3_llamacpp.json, scripts/record_qwen35moe_fixture.py --fixture gemma3).

llama.cpp's Gemma 3 graph multiplies the queries by the attention scale before q.k, where the queries meet the f16
keys rounded to f16; the other families scale the scores in the softmax. The tiny model's scale, 1/sqrt(32), is
no power of two (nor is Gemma 3 27B's, 1/sqrt(168)), so the two orders round apart: before tandem followed the
family rather than the scale, its logits here were up to 5e-2 from llama.cpp's, on every prompt length."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from llamacpp_logits import assert_logits_match_llama_cpp

import tandem

GEMMA3_LLAMA_CPP = Path(__file__).parent / "fixtures" / "gemma3_llamacpp.json"


@pytest.mark.parametrize("cpu_graph", ["1", "0"], ids=["step-graphs", "layer-path"])
def test_gemma3_f16_cache_logits_match_llama_cpp(
    tiny_gemma3_q8_0_gguf: tuple[Path, Path], cpu_graph: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill in one batch and the last tokens decoded one at a time, on 7 and 80 tokens (past the sliding
    window of 16), through the CPU step graphs (the default) and the layer path."""
    monkeypatch.setenv("TANDEM_CPU_GRAPH", cpu_graph)
    fx = json.loads(GEMMA3_LLAMA_CPP.read_text(encoding="utf-8"))
    with tandem.LLM(tiny_gemma3_q8_0_gguf[1], threads=1, n_ctx=64) as llm:
        assert llm.config.scale_queries and llm.config.attn_scale == pytest.approx(32**-0.5)
    assert_logits_match_llama_cpp(tiny_gemma3_q8_0_gguf[1], fx["models"]["gemma3"]["prompts"],
                                  fx["models"]["gemma3"]["gguf_sha256"], label="gemma3 Q8_0, f16 cache",
                                  script="scripts/record_qwen35moe_fixture.py --fixture gemma3",
                                  columns=fx["columns"], decode_steps=fx["decode_steps"], cache_type="f16")  # fmt: skip
