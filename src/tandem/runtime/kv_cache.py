"""Per-sequence attention state: one K and V buffer per layer, filled position by position."""

from __future__ import annotations

from dataclasses import dataclass, field

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

    def store(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v [T, H_kv, D] at positions start..start+T-1 and return all keys/values so far."""
        end = start + k.shape[0]
        self.k[start:end] = k.to(self.k.dtype)
        self.v[start:end] = v.to(self.v.dtype)
        return self.k[:end], self.v[:end]


@dataclass
class KVCache:
    """The attention state of one sequence."""

    layers: list[LayerKV]
    n_ctx: int
    length: int = 0
    tokens: list[int] = field(default_factory=list)

    @classmethod
    def allocate(
        cls,
        n_layers: int,
        n_ctx: int,
        n_kv_heads: list[int],
        k_dims: list[int],
        v_dims: list[int],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        """Zeroed buffers for `n_ctx` positions, one pair per layer (heads/dims may differ by layer)."""
        layers = [
            LayerKV(
                k=torch.zeros(n_ctx, n_kv_heads[i], k_dims[i], dtype=dtype, device=device),
                v=torch.zeros(n_ctx, n_kv_heads[i], v_dims[i], dtype=dtype, device=device),
            )
            for i in range(n_layers)
        ]
        return cls(layers=layers, n_ctx=n_ctx)

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
        return sum(layer.k.nbytes + layer.v.nbytes for layer in self.layers)
