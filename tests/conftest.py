"""Shared fixtures: tiny Hugging Face checkpoints and their F32 GGUF conversions, built once per session."""

from __future__ import annotations

import os

# ggml and torch share an OpenMP runtime whose threads spin while waiting; on the 2 shared cores of CI
# spinning threads starve each other (10x slower tests). Production keeps spinning (dedicated cores).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
from tiny_models import (
    make_tiny_gemma3,
    make_tiny_gemma4,
    make_tiny_gpt_oss,
    make_tiny_qwen3,
    make_tiny_qwen3moe,
    make_tiny_qwen3next,
    make_tiny_qwen35moe,
)

from tandem.convert import convert_hf

# The GPU machine runs only `-m gpu` tests and does not carry the server's stack (fastapi, uvicorn, openai), which
# `make test` installs; without a GPU a missing stack stays an import error, so CI cannot lose the server tests.
collect_ignore = []
if importlib.util.find_spec("openai") is None and os.path.exists("/dev/nvidia0"):
    collect_ignore += ["test_server.py", "test_server_qa.py"]


def _build(factory: pytest.TempPathFactory, name: str, make: Callable[[Path], Path]) -> tuple[Path, Path]:
    base = factory.mktemp(name)
    hf_dir = make(base / "hf")
    return hf_dir, convert_hf(hf_dir, base / f"{name}-f32.gguf", "f32")


@pytest.fixture(scope="session")
def tiny_qwen3_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(HF checkpoint dir, F32 GGUF path) of a tiny random Qwen3ForCausalLM."""
    return _build(tmp_path_factory, "tiny_qwen3", make_tiny_qwen3)


@pytest.fixture(scope="session")
def tiny_qwen3moe_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(HF checkpoint dir, F32 GGUF path) of a tiny random Qwen3MoeForCausalLM (8 experts, top-2)."""
    return _build(tmp_path_factory, "tiny_qwen3moe", make_tiny_qwen3moe)


@pytest.fixture(scope="session")
def tiny_gemma3_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(HF checkpoint dir, F32 GGUF path) of a tiny random Gemma3ForCausalLM (sliding window 16)."""
    return _build(tmp_path_factory, "tiny_gemma3", make_tiny_gemma3)


@pytest.fixture(scope="session")
def tiny_qwen35moe_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(HF checkpoint dir, F32 GGUF path) of a tiny random Qwen3_5MoeForCausalLM (delta-net + gated attention
    layers, 8 experts top-2 + shared expert, 4 value heads on 2 key heads)."""
    return _build(tmp_path_factory, "tiny_qwen35moe", make_tiny_qwen35moe)


@pytest.fixture(scope="session")
def tiny_qwen3next_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(HF checkpoint dir, F32 GGUF path) of a tiny random Qwen3NextForCausalLM (same shape as the Qwen3.5 one)."""
    return _build(tmp_path_factory, "tiny_qwen3next", make_tiny_qwen3next)


@pytest.fixture(scope="session")
def tiny_gpt_oss_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(HF checkpoint dir, F32 GGUF path) of a tiny random GptOssForCausalLM (plain rope, sliding window 8,
    4 experts top-2, random biases and sinks)."""
    return _build(tmp_path_factory, "tiny_gpt_oss", make_tiny_gpt_oss)


@pytest.fixture(scope="session")
def tiny_gpt_oss_yarn_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same tiny gpt-oss with gpt-oss's YaRN rope (compared with llama.cpp, not transformers)."""
    return _build(tmp_path_factory, "tiny_gpt_oss_yarn", lambda d: make_tiny_gpt_oss(d, yarn=True))


@pytest.fixture(scope="session")
def tiny_gemma4_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(HF checkpoint dir, F32 GGUF path) of a tiny random Gemma4ForCausalLM MoE (sliding and global layers
    with their own head sizes, K = V on global layers, dense MLP beside 4 experts top-2)."""
    return _build(tmp_path_factory, "tiny_gemma4", make_tiny_gemma4)


def _q8_0(factory: pytest.TempPathFactory, name: str, f32: tuple[Path, Path]) -> tuple[Path, Path]:
    """(HF checkpoint dir, Q8_0 GGUF path): the tiny model of `f32` converted again, to Q8_0."""
    return f32[0], convert_hf(f32[0], factory.mktemp(f"{name}_q8_0") / f"{name}-q8_0.gguf", "q8_0")


@pytest.fixture(scope="session")
def tiny_gemma4_q8_0_gguf(
    tiny_gemma4_gguf: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """The same tiny Gemma 4 converted to Q8_0 (norms, router and scales stay F32): quantized, its GEGLUs read
    ggml's f16 GELU table as llama.cpp's do (the float file keeps transformers' tanh formula)."""
    return _q8_0(tmp_path_factory, "tiny_gemma4", tiny_gemma4_gguf)


@pytest.fixture(scope="session")
def tiny_gemma3_q8_0_gguf(
    tiny_gemma3_gguf: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """The same tiny Gemma 3 in Q8_0: its llama.cpp fixture (gemma3_llamacpp.json) runs on an f16 cache."""
    return _q8_0(tmp_path_factory, "tiny_gemma3", tiny_gemma3_gguf)


@pytest.fixture(scope="session")
def tiny_qwen3_q8_0_gguf(
    tiny_qwen3_gguf: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """The same tiny Qwen3 in Q8_0: its llama.cpp fixture (qwen3_llamacpp.json) runs on an f32 cache."""
    return _q8_0(tmp_path_factory, "tiny_qwen3", tiny_qwen3_gguf)


@pytest.fixture(scope="session")
def tiny_gpt_oss_mxfp4_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same tiny gpt-oss with its experts stored as MXFP4 blocks/scales (repacked, not requantized)."""
    return _build(tmp_path_factory, "tiny_gpt_oss_mxfp4", lambda d: make_tiny_gpt_oss(d, mxfp4=True))


@pytest.fixture(scope="module")
def kernels():  # type: ignore[no-untyped-def]
    """ggml CPU kernels with 2 threads, for the ggml tests of a module."""
    from tandem.quant.ggml_cpu import CPUKernels

    k = CPUKernels(n_threads=2)
    yield k
    k.close()
