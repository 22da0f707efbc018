"""Gated activations used by the MLPs and experts."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tandem.errors import UnsupportedModelError


def _silu(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": _silu,  # SwiGLU
    "gelu_tanh": _gelu_tanh,  # GEGLU
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function called `name`."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise UnsupportedModelError(f"unknown activation '{name}'") from None


GLU = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (gate, up) -> gated hidden state


def gated(act: Callable[[torch.Tensor], torch.Tensor]) -> GLU:
    """The plain gated unit act(gate) * up (SwiGLU for silu, GEGLU for gelu_tanh)."""

    def glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return act(gate) * up

    return glu


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU (ggml_swiglu_oai): g = min(gate, limit), u = clamp(up, +-limit),
    g * sigmoid(alpha * g) * (u + 1)."""
    g = gate.clamp(max=limit)
    u = up.clamp(min=-limit, max=limit)
    return g * torch.sigmoid(alpha * g) * (u + 1)
