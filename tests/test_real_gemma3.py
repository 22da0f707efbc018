"""The real Gemma 3 270M Q4_K_M against llama.cpp's recorded greedy tokens and intermediate tensors.

The fixtures are recorded from llama.cpp's CPU build (llama-cpp-python 0.3.36, defaults: f16 KV cache, no
flash attention, which TANDEM_CPU_FLASH_ATTN=0 computes; `_fa`: with it, llama.cpp's CLI default and tandem's)
on two CPUs, each its own set: one with AVX-512 VNNI (`gemma3_270m_llamacpp.json`, `_ops.npz`) and an AVX2 one
without AVX-512 (AMD EPYC Zen 3: the `_avx2` files); tokens and logits by scripts/record_llamacpp_fixtures.py,
the op-level tensors by scripts/compare_activations_llamacpp.py --save-ops.

Every op tandem computes itself on the CPU (RMS norm, rope, attention with the f16 cache, GEGLU) gives
llama.cpp's float32 results bit for bit (test_ops_match_llamacpp_bit_for_bit), and the quantized products
are llama.cpp's too: the Q4_K weights are repacked for ggml's interleaved kernels (tandem/quant/ggml_weights.py)
and tandem's ggml is llama.cpp's, whose Q6_K products over 8 rows or more take its tiled kernel. So every
prompt matches for all its tokens and the last-position logits are llama.cpp's exactly -- against the set
recorded on a CPU of this one's kind: llama.cpp itself runs other kernel variants on each (AVX2 or AVX-512
repacked Q4_K products, 8- or 16-float attention sums), whose last bits differ. Other CPUs run the tests that
hold on any of them.
"""

from __future__ import annotations

import json
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
from tandem.layers.linear import GGMLLinear
from tandem.layers.norm import rms_norm
from tandem.models.cpu_graph import FLASH_ENV

FIXTURES = Path(__file__).parent / "fixtures"


def _recorded_kind() -> str | None:
    """The suffix of the fixture set recorded on a CPU of this one's kind, None if there is none."""
    if ggml.ggml_cpu_has_avx512() and ggml.ggml_cpu_has_avx512_vnni():
        return ""
    if ggml.ggml_cpu_has_avx2() and not ggml.ggml_cpu_has_avx512():
        return "_avx2"
    return None


RECORDED = _recorded_kind()
FIXTURE = FIXTURES / f"gemma3_270m_llamacpp{RECORDED or ''}.json"
OPS = FIXTURES / f"gemma3_270m_llamacpp{RECORDED or ''}_ops.npz"

recording_cpu = pytest.mark.skipif(
    RECORDED is None,
    reason="the fixtures hold the last bits of llama.cpp's AVX-512 VNNI and AVX2 builds; this CPU runs other "
    "kernel variants of both engines",
)


@pytest.fixture(scope="module")
def fixture() -> dict:
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def gemma() -> Iterator[tandem.LLM]:
    """Attention as the fixtures' llama.cpp computed it, without flash attention (TANDEM_CPU_FLASH_ATTN=0, read
    when the model's graphs are made); tandem's default, flash attention as llama.cpp's CLI default, below."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(FLASH_ENV, "0")
        llm = tandem.LLM(default_model_path(), n_ctx=512, threads=2)
    yield llm
    llm.close()


def greedy(llm: tandem.LLM, case: dict) -> list[int]:
    """llama.cpp's recording starts every prompt from an empty context: so does this (tandem would
    otherwise reuse the common prefix and prefill the rest in another batch shape, which picks other
    ggml kernels)."""
    llm.engine.reset()
    return llm.generate_ids(case["prompt_ids"], max_tokens=len(case["tokens"]), temperature=0)


def cpu_linears(llm: tandem.LLM) -> list[GGMLLinear]:
    model = llm.model
    found = [model.output]
    for block in model.blocks:
        for part in (block.mixer, block.ffn):
            found.extend(v for v in vars(part).values() if isinstance(v, GGMLLinear))
    return [linear for linear in found if isinstance(linear, GGMLLinear)]


@recording_cpu
def test_cpu_weights_held_as_llamacpp_holds_them(gemma: tandem.LLM) -> None:
    """The 27 Q4_K matrices repacked (rows a multiple of 8), the rest (the 9 Q6_K ffn_down, Q5_0, Q8_0 with K =
    640) in the memory map."""
    linears = cpu_linears(gemma)
    assert len(linears) == 18 * 7 + 1
    by_type: dict[str, tuple[int, int]] = {}
    for linear in linears:
        w = linear.weight
        repacked, plain = by_type.get(w.qtype.name, (0, 0))
        by_type[w.qtype.name] = (repacked + (w.repacked is not None), plain + (w.repacked is None))
    assert by_type == {"Q4_K": (27, 0), "Q6_K": (0, 9), "Q5_0": (0, 81), "Q8_0": (0, 10)}


@recording_cpu
def test_greedy_tokens_match_llamacpp(gemma: tandem.LLM, fixture: dict) -> None:
    cases = fixture["greedy"]
    assert len(cases) >= 5
    for case in cases:
        assert len(case["tokens"]) >= 32
        assert greedy(gemma, case) == case["tokens"], f"prompt {case['prompt']!r}"


@recording_cpu
def test_last_logits_match_llamacpp_exactly(gemma: tandem.LLM, fixture: dict) -> None:
    for case in fixture["logits"]:
        gemma.engine.reset()
        ours = gemma.logits(case["prompt_ids"])[-1]
        assert all(float(ours[token]) == logit for token, logit in case["top50"])


def test_greedy_prefix_matches_llamacpp(gemma: tandem.LLM, fixture: dict) -> None:
    """On any CPU (whatever kernel variants run): every prompt's first 3 greedy tokens."""
    for case in fixture["greedy"]:
        assert greedy(gemma, case)[:3] == case["tokens"][:3], f"prompt {case['prompt']!r}"


def test_prompt_tokenization_matches_llamacpp(gemma: tandem.LLM, fixture: dict) -> None:
    for case in fixture["greedy"]:
        assert gemma.tokenize(case["prompt"]) == case["prompt_ids"]


def test_top_logits_close_to_llamacpp(gemma: tandem.LLM, fixture: dict) -> None:
    for case in fixture["logits"]:
        gemma.engine.reset()
        ours = gemma.logits(case["prompt_ids"])[-1]
        top = case["top50"]  # [(id, logit), ...] from llama.cpp, most likely first
        assert int(ours.argmax()) == top[0][0]
        # On any CPU. Measured with ggml's plain products (no repacking, no tiled kernel): at most 0.44 apart.
        for token, logit in top:
            assert abs(float(ours[token]) - logit) < 0.5, (token, float(ours[token]), logit)


def _ops() -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in np.load(OPS).items()}


def _same(ours: torch.Tensor, ref: torch.Tensor) -> None:
    ours = ours.reshape(ref.shape)
    assert torch.equal(ours, ref), f"{int((ours != ref).sum())} of {ref.numel()} differ"


def test_ops_match_llamacpp_bit_for_bit(gemma: tandem.LLM) -> None:
    """llama.cpp's own inputs through tandem's CPU ops give llama.cpp's outputs exactly, on any x86 CPU (these
    ops add in no vector-width-dependent order): RMS norm, local and global rope, and GEGLU's f16 GELU table."""
    ops = _ops()
    blocks = gemma.model.blocks
    assert gemma.config.activation == "gelu_tanh_ggml"
    _same(rms_norm(ops["norm_x"], blocks[1].mixer_norm, blocks[1].eps), ops["norm_y"])
    prefill = torch.arange(ops["ids"].numel())
    for kind, layer in (("local", 0), ("global", 5)):
        _same(blocks[layer].mixer.rope.apply(ops[f"rope_{kind}_x"], prefill), ops[f"rope_{kind}_y"])
    _same(ACTIVATIONS["gelu_tanh_ggml"](ops["geglu_gate"]) * ops["geglu_up"], ops["geglu_out"])


@recording_cpu
def test_attention_matches_llamacpp_bit_for_bit(gemma: tandem.LLM) -> None:
    """Attention with an f16 cache while prefilling (7 rows) and while decoding (1 row at position 12, whose
    query has f16-subnormal elements once scaled): the outputs of llama.cpp's build on this kind of CPU exactly
    (its sums run in 16-float lanes with AVX-512, in 8-float ones with AVX2, and so do tandem's)."""
    ops = _ops()
    blocks = gemma.model.blocks
    prefill = torch.arange(ops["ids"].numel())
    shape = blocks[0].mixer.shape
    out = attend(ops["prefill_q"], ops["prefill_k"].half(), ops["prefill_v"].half(), prefill, shape)
    _same(out, ops["prefill_out"])
    position = torch.tensor([ops["decode_ids"].numel() - 1])
    out = attend(ops["decode_q"], ops["decode_k"].half(), ops["decode_v"].half(), position, blocks[1].mixer.shape)
    _same(out, ops["decode_out"])


FLASH_FIXTURE = FIXTURES / "gemma3_270m_llamacpp_fa.json"  # llama.cpp with flash attention (its CPU default)


@pytest.fixture(scope="module")
def gemma_flash() -> Iterator[tandem.LLM]:
    """tandem's defaults: the CPU step graphs' attention as ggml's flash-attention node (an f16 cache, the
    switch TANDEM_CPU_FLASH_ATTN unset)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(FLASH_ENV, raising=False)
        llm = tandem.LLM(default_model_path(), n_ctx=512, threads=2)
    assert llm.engine.runner.cpu_graph is not None and llm.engine.runner.cpu_graph.flash
    yield llm
    llm.close()


@pytest.mark.skipif(RECORDED != "", reason="llama.cpp's flash-attention fixture holds the last bits of its AVX-512 "
                    "VNNI build; this CPU runs other kernel variants of both engines")  # fmt: skip
def test_flash_attention_is_llamacpp_default_bit_for_bit(gemma_flash: tandem.LLM) -> None:
    """With flash attention, llama.cpp's CPU default (`-fa auto`), every greedy token and the last logits of each
    prompt are those llama.cpp's build computes with it (recorded with `--flash-attn`): one node per sequence
    over a view of 256-cell multiples, as llama.cpp's cache gives it, so that the kernel takes the same path and
    splits the keys between the threads alike. They differ from the fixture without it (4 of 8 prompts' tokens,
    logits by up to 0.43)."""
    fixture = json.loads(FLASH_FIXTURE.read_text())
    assert fixture["meta"]["flash_attn"] is True
    for case in fixture["greedy"]:
        assert greedy(gemma_flash, case) == case["tokens"], f"prompt {case['prompt']!r}"
    for case in fixture["logits"]:
        gemma_flash.engine.reset()
        ours = gemma_flash.logits(case["prompt_ids"])[-1]
        assert all(float(ours[token]) == logit for token, logit in case["top50"])
    plain = json.loads(FIXTURE.read_text())
    assert sum(a["tokens"] != b["tokens"] for a, b in zip(plain["greedy"], fixture["greedy"], strict=True)) >= 1


LONG_FIXTURE = FIXTURES / "gemma3_270m_llamacpp_fa_long.json"  # prompts of 600 and 1,000 tokens, flash attention


@pytest.mark.skipif(RECORDED != "", reason="llama.cpp's fixture holds the last bits of its AVX-512 VNNI build; this "
                    "CPU runs other kernel variants of both engines")  # fmt: skip
def test_long_prompts_are_llamacpp_default_bit_for_bit() -> None:
    """Prompts of 600 and 1,000 random tokens read in chunks of 512 rows, as llama.cpp's n_batch reads them, with
    flash attention (llama.cpp's CPU default and tandem's): the last position's 50 largest logits are the bits
    llama.cpp computed. Chunks of 64 rows and more take ggml's tiled attention there and tandem's kernel here
    (quant/flash_attention), float32 on every x86 build (scripts/record_llamacpp_fixtures.py --long)."""
    fixture = json.loads(LONG_FIXTURE.read_text())
    assert fixture["meta"]["flash_attn"] is True and fixture["meta"]["n_batch"] == 512
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(FLASH_ENV, raising=False)
        llm = tandem.LLM(default_model_path(), n_ctx=2048, threads=2)
    try:
        assert llm.engine.n_batch == 512
        for case in fixture["long"]:
            llm.engine.reset()
            ours = llm.logits(case["prompt_ids"])[-1]
            assert all(float(ours[token]) == logit for token, logit in case["top50"]), len(case["prompt_ids"])
    finally:
        llm.close()
