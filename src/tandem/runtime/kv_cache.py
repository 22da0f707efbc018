"""Per-sequence state: one LayerState per layer (K/V buffers for attention), filled position by position."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from tandem.errors import TandemError

CACHE_DTYPES: dict[str, torch.dtype] = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


class ContextFullError(TandemError):
    """The sequence would grow past the context size (`-c/--ctx-size`)."""


@dataclass
class LayerKV:
    """K/V of one layer: [n_ctx, H_kv, D] each; positions [0, length) are valid."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(
        cls, n_ctx: int, n_kv_heads: int, k_dim: int, v_dim: int, dtype: torch.dtype, device: torch.device | str
    ) -> LayerKV:
        return cls(
            k=torch.zeros(n_ctx, n_kv_heads, k_dim, dtype=dtype, device=device),
            v=torch.zeros(n_ctx, n_kv_heads, v_dim, dtype=dtype, device=device),
        )

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def store(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v [T, H_kv, D] at positions start..start+T-1 and return all keys/values so far."""
        end = start + k.shape[0]
        self.k[start:end] = k.to(self.k.dtype)
        self.v[start:end] = v.to(self.v.dtype)
        return self.k[:end], self.v[:end]


class LayerState(Protocol):
    """Per-layer sequence state: a KV buffer for attention, conv/recurrent state for linear attention."""

    def nbytes(self) -> int: ...


@dataclass
class KVCache:
    """The state of one sequence: one LayerState per layer, and the tokens it holds."""

    layers: list[Any]
    n_ctx: int
    length: int = 0
    tokens: list[int] = field(default_factory=list)

    def check_room(self, n_new: int) -> None:
        if self.length + n_new > self.n_ctx:
            raise ContextFullError(
                f"context full: {self.length} + {n_new} tokens exceed the context size {self.n_ctx} "
                f"(raise -c/--ctx-size)"
            )

    def truncate(self, length: int) -> None:
        """Forget positions >= length (they are overwritten by the next tokens)."""
        self.length = min(self.length, length)
        del self.tokens[self.length :]

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)
