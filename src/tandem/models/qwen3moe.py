"""Qwen3-MoE (Qwen3-30B-A3B family): Qwen3 attention, every layer's MLP is top-k routed experts.

llama.cpp always renormalises the selected experts' softmax weights for this architecture.
"""

from __future__ import annotations

import dataclasses

from tandem.gguf import GGUFFile
from tandem.models import qwen3
from tandem.models.config import ModelConfig, moe_spec


def read_config(f: GGUFFile) -> ModelConfig:
    dense = qwen3.read_config(f)
    layers = tuple(dataclasses.replace(layer, moe=True) for layer in dense.layers)
    return dataclasses.replace(dense, moe=moe_spec(f, renormalize=True), layers=layers)
