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
