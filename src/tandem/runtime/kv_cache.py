"""Per-sequence state: one LayerState per layer (K/V buffers for attention), filled position by position."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

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

    def store(
        self, start: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v [T, H_kv, D] at positions start..start+T-1 and return the keys/values to attend to.

        A one-token step on a GPU writes by index (`positions`, a device tensor) and returns the whole
        buffer, so the step has the same shapes at every position and can be replayed as a CUDA graph;
        positions not yet written are masked by causality.
        """
        if positions is not None and self.k.is_cuda and k.shape[0] == 1:
            self.k.index_copy_(0, positions, k.to(self.k.dtype))
            self.v.index_copy_(0, positions, v.to(self.v.dtype))
            return self.k, self.v
        end = start + k.shape[0]
        self.k[start:end] = k.to(self.k.dtype)
        self.v[start:end] = v.to(self.v.dtype)
        return self.k[:end], self.v[:end]


class LayerState(Protocol):
    """Per-layer sequence state: a KV buffer for attention, conv/recurrent state for linear attention."""

    def nbytes(self) -> int: ...


@runtime_checkable
class RecurrentState(Protocol):
    """A layer state that folds every position into a fixed-size summary (linear attention): it cannot
    forget positions one by one, only go back to a snapshot taken earlier."""

    length: int  # positions folded in

    def nbytes(self) -> int: ...

    def snapshot(self) -> Any: ...

    def restore(self, snapshot: Any | None) -> None:
        """Return to `snapshot` (None: the empty sequence)."""
        ...


MAX_CHECKPOINTS = 4  # recurrent-state snapshots kept per sequence (each is a few MiB per layer)


@dataclass
class KVCache:
    """The state of one sequence: one LayerState per layer, and the tokens it holds.

    With recurrent layers, truncation can only land where their state is known: at the current length,
    at a checkpoint (see `checkpoint`), or at 0; `truncate` then keeps less than asked for.
    """

    layers: list[Any]
    n_ctx: int
    length: int = 0
    tokens: list[int] = field(default_factory=list)
    checkpoints: list[tuple[int, list[Any]]] = field(default_factory=list)  # (length, recurrent snapshots)

    @property
    def has_recurrent(self) -> bool:
        return any(isinstance(layer, RecurrentState) for layer in self.layers)

    def checkpoint(self) -> None:
        """Snapshot the recurrent layers at the current length, so that `truncate` can come back here."""
        recurrent = [layer for layer in self.layers if isinstance(layer, RecurrentState)]
        if not recurrent or any(pos == self.length for pos, _ in self.checkpoints):
            return
        self.checkpoints.append((self.length, [layer.snapshot() for layer in recurrent]))
        del self.checkpoints[:-MAX_CHECKPOINTS]

    def check_room(self, n_new: int) -> None:
        if self.length + n_new > self.n_ctx:
            raise ContextFullError(
                f"context full: {self.length} + {n_new} tokens exceed the context size {self.n_ctx} "
                f"(raise -c/--ctx-size)"
            )

    def truncate(self, length: int) -> None:
        """Forget positions >= length (they are overwritten by the next tokens).

        Recurrent layers cannot drop positions: the sequence goes back to the latest checkpoint at or
        below `length`, else to empty. Read `self.length` for what was kept."""
        length = min(self.length, length)
        recurrent = [layer for layer in self.layers if isinstance(layer, RecurrentState)]
        if recurrent and length < self.length:
            self.checkpoints = [c for c in self.checkpoints if c[0] <= length]
            at, snapshots = self.checkpoints[-1] if self.checkpoints else (0, [None] * len(recurrent))
            for layer, snap in zip(recurrent, snapshots, strict=True):
                layer.restore(snap)
            length = at
        self.length = length
        del self.tokens[length:]

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)
