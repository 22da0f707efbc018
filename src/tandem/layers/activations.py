"""Gated activations used by the MLPs and experts."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from tandem.errors import UnsupportedModelError
from tandem.quant.ggml_ops import ggml_elementwise


def _silu(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


@functools.cache
def ggml_gelu_table() -> torch.Tensor:
    """ggml's GELU lookup table [65536] (float32 values of f16 results), indexed by the f16 bit pattern
    of the input: ggml computes it at start-up from the tanh formula and reads it through its own
    `gelu` op here, so that the entries are exactly the ones ggml uses."""
    bits = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    (table,) = ggml_elementwise(bits, ["gelu"])
    table = table.astype(np.float32)
    return torch.from_numpy(table)


def _gelu_tanh_ggml(x: torch.Tensor) -> torch.Tensor:
    """GELU (tanh approximation) as ggml's CPU backend computes it for float32 (`ggml_vec_gelu_f32` and
    `ggml_vec_geglu_f32` with GGML_GELU_FP16): 0 at or below -10, x at or above 10, and in between
    the f16 table entry of x rounded to f16. That is up to ~1e-3 away from the formula; llama.cpp's
    tokens depend on it. On a GPU this is the formula (torch's fused kernel)."""
    if x.is_cuda:
        return F.gelu(x, approximate="tanh")
    return gelu_from_table(x, ggml_gelu_table())


def gelu_from_table(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """ggml's table GELU of x, with `table` (`ggml_gelu_table`) on x's device."""
    x32 = x.float()
    index = x32.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    y = table[index]
    y = torch.where(x32 >= 10.0, x32, y)
    y = torch.where(x32 <= -10.0, torch.zeros_like(y), y)
    return y.to(x.dtype)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": _silu,  # SwiGLU
    "gelu_tanh": _gelu_tanh,  # GEGLU
    # GEGLU with ggml's f16 GELU table (on the CPU): what llama.cpp computes for the same file
    "gelu_tanh_ggml": _gelu_tanh_ggml,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function called `name`."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise UnsupportedModelError(f"unknown activation '{name}'") from None


# ggml's gated units computing act(gate) * up for these activations. ggml's GELU is the tanh form read from its
# f16 table on the CPU, which `gelu_tanh_ggml` reproduces: the formula (`gelu_tanh`, ~1e-3 away) has none.
_GGML_GATED = {_silu: "swiglu", _gelu_tanh_ggml: "geglu"}


class GLU(Protocol):
    """A gated unit (gate, up) -> hidden state, and the ggml op that computes the same values from the two
    tensors on the CPU: `ggml` names it ("swiglu", "geglu": ggml_swiglu_split / ggml_geglu_split;
    "swiglu_oai"; None when ggml has none), `ggml_params` are its float arguments after the tensors."""

    @property
    def ggml(self) -> str | None: ...

    @property
    def ggml_params(self) -> tuple[float, ...]: ...

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class Gated:
    """The plain gated unit act(gate) * up (SwiGLU for silu, GEGLU for gelu_tanh); ggml's op follows from act."""

    act: Callable[[torch.Tensor], torch.Tensor]
    ggml: str | None = field(init=False)
    ggml_params: tuple[float, ...] = field(default=(), init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ggml", _GGML_GATED.get(self.act))

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.act(gate) * up


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's clamped SwiGLU (ggml_swiglu_oai): g = min(gate, limit), u = clamp(up, +-limit),
    g * sigmoid(alpha * g) * (u + 1)."""

    alpha: float = 1.702
    limit: float = 7.0
    ggml: ClassVar[str] = "swiglu_oai"

    @property
    def ggml_params(self) -> tuple[float, ...]:
        return (self.alpha, self.limit)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        g = gate.clamp(max=self.limit)
        u = up.clamp(min=-self.limit, max=self.limit)
        return g * torch.sigmoid(self.alpha * g) * (u + 1)


swiglu_oai = ClampedSwiGLU()  # gpt-oss's constants
