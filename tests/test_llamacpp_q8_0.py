"""Tiny models in Q8_0 against llama.cpp reading the same GGUF (scripts/record_qwen35moe_fixture.py), where the
order of a float32 sum decides a Q8_0 activation code and so shows in the logits (~1e-2 when it differs).

* Gemma 3, llama.cpp's default f16 K/V cache (fixtures/gemma3_llamacpp.json): llama.cpp's Gemma 3 graph multiplies
  the queries by the attention scale before they are rounded to f16 for q.k; the other families scale the scores
  in the softmax. The tiny model's scale, 1/sqrt(32), is no power of two (nor is Gemma 3 27B's, 1/sqrt(168)), so
  the two orders round apart: before tandem followed the family rather than the scale, its logits here were up to
  5e-2 from llama.cpp's at every prompt length.
* dense Qwen3, f32 K/V cache, a prompt of 171 tokens (fixtures/qwen3_llamacpp.json): llama.cpp multiplies q.k
  over the permuted queries, which ggml sums by its own dot product; the step graphs once made the queries
  contiguous first, so that tinyBLAS summed them in another order, and this prompt's logits moved by ~1e-2 (29 of
  140 prompt lengths from 60 to 199 did; none does now)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from llamacpp_logits import assert_logits_match_llama_cpp

import tandem
from tandem.models.cpu_graph import FLASH_ENV

FIXTURES = Path(__file__).parent / "fixtures"
PATHS = pytest.mark.parametrize("cpu_graph", ["1", "0"], ids=["step-graphs", "layer-path"])


def _check(gguf: Path, name: str, cache_type: str) -> None:
    fx = json.loads((FIXTURES / f"{name}_llamacpp.json").read_text(encoding="utf-8"))
    model = fx["models"][name]
    assert_logits_match_llama_cpp(gguf, model["prompts"], model["gguf_sha256"], label=f"{name} Q8_0, {cache_type}",
                                  script=f"scripts/record_qwen35moe_fixture.py --fixture {name}", columns=fx["columns"],
                                  decode_steps=fx["decode_steps"], cache_type=cache_type)  # fmt: skip


@PATHS
def test_gemma3_f16_cache_logits_match_llama_cpp(
    tiny_gemma3_q8_0_gguf: tuple[Path, Path], cpu_graph: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill in one batch and the last tokens decoded one at a time, on 7 and 80 tokens (past the sliding
    window of 16), through the CPU step graphs and the layer path, as llama.cpp computes attention without flash
    attention (the fixture's, recorded through the Python class's default)."""
    monkeypatch.setenv("TANDEM_CPU_GRAPH", cpu_graph)
    monkeypatch.setenv(FLASH_ENV, "0")
    with tandem.LLM(tiny_gemma3_q8_0_gguf[1], threads=1, n_ctx=64) as llm:
        assert llm.config.scale_queries and llm.config.attn_scale == pytest.approx(32**-0.5)
    _check(tiny_gemma3_q8_0_gguf[1], "gemma3", "f16")


def test_qwen3_f32_cache_logits_match_llama_cpp(tiny_qwen3_q8_0_gguf: tuple[Path, Path]) -> None:
    """The step graphs (the default; the layer path's float32 attention is torch's, close but not llama.cpp's
    order): a prefill in one batch and the last tokens decoded one at a time."""
    _check(tiny_qwen3_q8_0_gguf[1], "qwen3", "f32")
