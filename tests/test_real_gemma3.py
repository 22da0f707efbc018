"""The real Gemma 3 270M Q4_K_M against llama.cpp's recorded greedy tokens and intermediate tensors.

The fixtures are recorded from llama.cpp's CPU build (llama-cpp-python 0.3.36, defaults: f16 KV cache, no
flash attention): tokens and logits by scripts/record_llamacpp_fixtures.py, the op-level tensors by
scripts/compare_activations_llamacpp.py --save-ops.

Every op tandem computes itself on the CPU (RMS norm, rope, attention with the f16 cache, GEGLU) gives
llama.cpp's float32 results bit for bit (test_ops_match_llamacpp_bit_for_bit). What still separates the
greedy tokens is in the quantized products: llama.cpp repacks the Q4_K weights and runs a tiled kernel
for K-quant products over 8 rows or more, and ggml-python runs neither. With those two emulated
(scripts/llamacpp_cpu_matmul.py), all 8 prompts match for 32 tokens and the logits agree exactly.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import ggml
import numpy as np
import pytest
import torch

import tandem
from tandem.api import default_model_path
from tandem.layers.activations import ACTIVATIONS
from tandem.layers.attention import attend
from tandem.layers.norm import rms_norm

FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE = FIXTURES / "gemma3_270m_llamacpp.json"
OPS = FIXTURES / "gemma3_270m_llamacpp_ops.npz"
SCRIPTS = Path(__file__).parent.parent / "scripts"


@pytest.fixture(scope="module")
def fixture() -> dict:
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def gemma() -> Iterator[tandem.LLM]:
    llm = tandem.LLM(default_model_path(), n_ctx=512, threads=2)
    yield llm
    llm.close()


def greedy(llm: tandem.LLM, case: dict) -> list[int]:
    """llama.cpp's recording starts every prompt from an empty context: so does this (tandem would
    otherwise reuse the common prefix and prefill the rest in another batch shape, which picks other
    ggml kernels)."""
    llm.engine.reset()
    return llm.generate_ids(case["prompt_ids"], max_tokens=len(case["tokens"]), temperature=0)


@pytest.mark.xfail(
    strict=True,
    reason="not met yet: 3 of 8 prompts match for 32 tokens (the others diverge at tokens 3-30), top-50 logits "
    "within 0.44. Everything tandem computes itself is bit-exact (test_ops_match_llamacpp_bit_for_bit); the "
    "rest is in the quantized products: llama.cpp repacks Q4_K weights (CPU_REPACK) and multiplies K-quants "
    "over >= 8 rows with its tiled kernel, which tandem's ggml calls do not. With both (scripts/"
    "llamacpp_cpu_matmul.py, test_greedy_tokens_match_with_llamacpp_products) all 8 prompts match.",
)
def test_greedy_tokens_match_llamacpp(gemma: tandem.LLM, fixture: dict) -> None:
    cases = fixture["greedy"]
    assert len(cases) >= 5
    for case in cases:
        assert len(case["tokens"]) >= 32
        assert greedy(gemma, case) == case["tokens"], f"prompt {case['prompt']!r}"


def test_greedy_prefix_matches_llamacpp(gemma: tandem.LLM, fixture: dict) -> None:
    """What holds today: every prompt's first 3 greedy tokens, and 3 prompts' full 32 tokens."""
    full = 0
    for case in fixture["greedy"]:
        ours = greedy(gemma, case)
        assert ours[:3] == case["tokens"][:3], f"prompt {case['prompt']!r}"
        full += ours == case["tokens"]
    assert full >= 3


def test_prompt_tokenization_matches_llamacpp(gemma: tandem.LLM, fixture: dict) -> None:
    for case in fixture["greedy"]:
        assert gemma.tokenize(case["prompt"]) == case["prompt_ids"]


def test_top_logits_close_to_llamacpp(gemma: tandem.LLM, fixture: dict) -> None:
    for case in fixture["logits"]:
        gemma.engine.reset()
        ours = gemma.logits(case["prompt_ids"])[-1]
        top = case["top50"]  # [(id, logit), ...] from llama.cpp, most likely first
        assert int(ours.argmax()) == top[0][0]
        # Measured: at most 0.44 apart, all of it from the quantized products (0 with them emulated).
        for token, logit in top:
            assert abs(float(ours[token]) - logit) < 0.5, (token, float(ours[token]), logit)


def test_ops_match_llamacpp_bit_for_bit(gemma: tandem.LLM) -> None:
    """llama.cpp's own inputs through tandem's CPU ops give llama.cpp's outputs exactly: RMS norm, local
    and global rope, attention with an f16 cache while prefilling (7 rows) and while decoding (1 row at
    position 12, whose query has f16-subnormal elements once scaled), and GEGLU's f16 GELU table."""
    ops = {k: torch.from_numpy(v) for k, v in np.load(OPS).items()}
    blocks = gemma.model.blocks
    assert gemma.config.activation == "gelu_tanh_ggml"

    def same(ours: torch.Tensor, ref: torch.Tensor) -> None:
        ours = ours.reshape(ref.shape)
        assert torch.equal(ours, ref), f"{int((ours != ref).sum())} of {ref.numel()} differ"

    same(rms_norm(ops["norm_x"], blocks[1].mixer_norm, blocks[1].eps), ops["norm_y"])
    t = ops["ids"].numel()
    prefill = torch.arange(t)
    for kind, layer in (("local", 0), ("global", 5)):
        same(blocks[layer].mixer.rope.apply(ops[f"rope_{kind}_x"], prefill), ops[f"rope_{kind}_y"])
    shape = blocks[0].mixer.shape
    same(attend(ops["prefill_q"], ops["prefill_k"].half(), ops["prefill_v"].half(), prefill, shape), ops["prefill_out"])
    position = torch.tensor([ops["decode_ids"].numel() - 1])
    out = attend(ops["decode_q"], ops["decode_k"].half(), ops["decode_v"].half(), position, blocks[1].mixer.shape)
    same(out, ops["decode_out"])
    same(ACTIVATIONS["gelu_tanh_ggml"](ops["geglu_gate"]) * ops["geglu_up"], ops["geglu_out"])


def _llamacpp_cpu_matmul():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("llamacpp_cpu_matmul", SCRIPTS / "llamacpp_cpu_matmul.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("llamacpp_cpu_matmul", module)
    spec.loader.exec_module(module)
    return module


def test_greedy_tokens_match_with_llamacpp_products(fixture: dict) -> None:
    """With llama.cpp's repacked and tiled products emulated, every prompt matches for all its tokens
    and the last-position logits are llama.cpp's exactly: the rest of tandem's arithmetic is llama.cpp's."""
    if not (ggml.ggml_cpu_has_avx512() and ggml.ggml_cpu_has_avx512_vnni()):
        pytest.skip("the emulated products are those of an AVX-512 VNNI build (where the fixture was recorded)")
    with _llamacpp_cpu_matmul().installed(2):
        llm = tandem.LLM(default_model_path(), n_ctx=512, threads=2)
        try:
            cases = fixture["greedy"]
            assert len(cases) >= 5
            for case in cases:
                assert len(case["tokens"]) >= 32
                assert greedy(llm, case) == case["tokens"], f"prompt {case['prompt']!r}"
            for case in fixture["logits"]:
                llm.engine.reset()
                ours = llm.logits(case["prompt_ids"])[-1]
                assert all(float(ours[token]) == logit for token, logit in case["top50"])
        finally:
            llm.close()
