"""Shared fixtures: tiny Hugging Face checkpoints and their F32 GGUF conversions, built once per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from tiny_models import make_tiny_gemma3, make_tiny_qwen3, make_tiny_qwen3moe

from tandem.convert import convert_hf


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
