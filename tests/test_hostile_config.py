"""Hostile hyper-parameters and tensor shapes (issue 18): refused when the config is read, before any allocation."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from gguf import GGUFValueType as T

from tandem.cli.main import main
from tandem.errors import TandemError
from tandem.fuzz.gguf_edit import GGUFParts, Value
from tandem.gguf import open_gguf
from tandem.models import read_config

# (fixture, metadata key -> (type, value) or tensor name -> ggml dims, part of the message)
CASES: dict[str, tuple[str, dict[str, tuple[int, int]], dict[str, list[int]], str]] = {
    "block_count 2^32-1": ("tiny_qwen3_gguf", {"qwen3.block_count": (T.UINT32, 2**32 - 1)}, {}, "block_count"),
    "block_count 2^63": ("tiny_qwen3_gguf", {"qwen3.block_count": (T.UINT64, 2**63)}, {}, "block_count"),
    "gemma4 block_count": ("tiny_gemma4_gguf", {"gemma4.block_count": (T.UINT32, 2**32 - 1)}, {}, "block_count"),
    "experts used -1": ("tiny_qwen3moe_gguf", {"qwen3moe.expert_used_count": (T.INT32, -1)}, {}, "experts used"),
    "experts used 2^31": ("tiny_qwen3moe_gguf", {"qwen3moe.expert_used_count": (T.UINT32, 2**31)}, {}, "experts used"),
    "experts used > experts": ("tiny_gpt_oss_gguf", {"gpt-oss.expert_used_count": (T.UINT32, 5)}, {}, "experts used"),
    "rope dims 2^31": ("tiny_gpt_oss_gguf", {"gpt-oss.rope.dimension_count": (T.UINT32, 2**31)}, {}, "rotates"),
    "rope dims odd": ("tiny_qwen35moe_gguf", {"qwen35moe.rope.dimension_count": (T.UINT32, 7)}, {}, "even"),
    "value_length + 1": ("tiny_qwen3_gguf", {"qwen3.attention.value_length": (T.UINT32, 33)}, {}, "value size"),
    "ssm state 2^40": ("tiny_qwen35moe_gguf", {"qwen35moe.ssm.state_size": (T.UINT64, 2**40)}, {}, "ssm.state_size"),
    "ssm inner 65": ("tiny_qwen3next_gguf", {"qwen3next.ssm.inner_size": (T.UINT32, 65)}, {}, "ssm.inner_size 65"),
    "ssm inner x2": ("tiny_qwen35moe_gguf", {"qwen35moe.ssm.inner_size": (T.UINT32, 128)}, {}, "ssm"),
    "eps NaN": ("tiny_qwen3_gguf", {"qwen3.attention.layer_norm_rms_epsilon": (T.FLOAT32, float("nan"))}, {}, "eps"),
    "vocab below tokens": ("tiny_qwen3_gguf", {"qwen3.vocab_size": (T.UINT32, 100)}, {}, "tokens for a vocabulary"),
    "sinks": ("tiny_gpt_oss_gguf", {}, {"blk.0.attn_sinks.weight": [3]}, "query heads is 4"),
    "q bias": ("tiny_gpt_oss_gguf", {}, {"blk.1.attn_q.bias": [60]}, "heads x head size is 64"),
    "expert bias": ("tiny_gpt_oss_gguf", {}, {"blk.0.ffn_gate_exps.bias": [31, 4]}, "expert FFN size is 32"),
    "router": ("tiny_gpt_oss_gguf", {}, {"blk.0.ffn_gate_inp.weight": [64, 3]}, "expert count is 4"),
    "k norm": ("tiny_gemma4_gguf", {}, {"blk.0.attn_k_norm.weight": [15]}, "head size is 16"),
    "ssm_a": ("tiny_qwen35moe_gguf", {}, {"blk.0.ssm_a": [3]}, "ssm value heads is 4"),
    "qkv": ("tiny_qwen35moe_gguf", {}, {"blk.0.attn_qkv.weight": [64, 120]}, "ssm q, k and v size is 128"),
    "shared expert": ("tiny_qwen35moe_gguf", {}, {"blk.1.ffn_down_shexp.weight": [40, 64]}, "shared expert FFN"),
    "query twice as tall": ("tiny_qwen3_gguf", {}, {"blk.1.attn_q.weight": [64, 256]}, "a gated query"),
    "ffn sizes disagree": ("tiny_qwen3_gguf", {}, {"blk.0.ffn_down.weight": [120, 64]}, "other tensors give FFN size"),
    "expert dims": ("tiny_qwen3moe_gguf", {}, {"blk.1.ffn_up_exps.weight": [128, 30, 8]}, "expert FFN size is 32"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_config(
    request: pytest.FixtureRequest, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    fixture, values, shapes, message = CASES[case]
    parts = GGUFParts.read(request.getfixturevalue(fixture)[1])
    for key, (vtype, value) in values.items():
        parts.metadata[key] = Value(vtype, value)
    for tensor in parts.tensors:
        tensor.ne = shapes.get(tensor.name, tensor.ne)
    path = parts.write(tmp_path / "hostile.gguf")
    start = time.monotonic()
    with pytest.raises(TandemError) as e:
        read_config(open_gguf(path))
    assert time.monotonic() - start < 2.0
    assert message in str(e.value) and "\n" not in str(e.value)
    capsys.readouterr()  # what building the fixture printed
    assert main(["run", "-m", str(path), "-p", "hi", "-n", "1", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err


def test_special_token_id_past_the_vocabulary_is_ignored(tiny_qwen3_gguf: tuple[Path, Path], tmp_path: Path) -> None:
    """Issue 18's `eos_token_id` 2^32-1: ignored, as llama.cpp ignores a bad special id (it warns), not an error at
    the first generated token."""
    parts = GGUFParts.read(tiny_qwen3_gguf[1])
    parts.metadata["tokenizer.ggml.eos_token_id"] = Value(T.UINT32, 2**32 - 1)
    path = parts.write(tmp_path / "eos.gguf")
    assert main(["run", "-m", str(path), "-p", "hi", "-n", "3", "--device", "cpu", "--temp", "0"]) == 0
