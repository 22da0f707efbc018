"""Sequence state: one LayerState per layer (K/V buffers for attention), filled position by position, and the
pools that hold every slot's buffers along a leading slot axis (a batched decode step reads them by slot)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from tandem.errors import TandemError

CACHE_DTYPES: dict[str, torch.dtype] = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


class ContextFullError(TandemError):
    """The sequence would grow past the context size (`-c/--ctx-size`)."""


class StateOrderError(TandemError):
    """A recurrent state was asked to continue at a position other than the one it holds."""


@dataclass
class LayerKV:
    """K/V of one layer for one sequence (a slot of a `KVPool`): [R, H_kv, D] each, position p in row p % R;
    positions [0, length) were written.

    R is n_ctx (every position stays), or for a sliding-window layer on a GPU, a ring of window + n_batch - 1
    rows (`window` set): enough for the last query of a batch of n_batch tokens to see its window, as
    llama.cpp's SWA cache keeps n_swa + n_ubatch cells. Older positions are overwritten, so a ring can only
    go back a few positions (`can_truncate`)."""

    k: torch.Tensor
    v: torch.Tensor
    window: int | None = None  # a ring's sliding window (None: a full buffer)
    # float32 copies for ggml's attention on the CPU (`float32_rows`): keys [C, H_kv, D], values
    # transposed [H_kv, Dv, C], positions [0, _f32_valid) up to date
    _f32: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False)
    _f32_valid: int = field(default=0, init=False, repr=False)

    @property
    def rows(self) -> int:
        return self.k.shape[0]

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + (sum(t.nbytes for t in self._f32) if self._f32 is not None else 0)

    def can_truncate(self, length: int, to: int) -> bool:
        """Whether a cache holding positions [0, length) still holds what a sequence cut to `to` attends to."""
        return self.window is None or max(0, to - self.window + 1) >= length - self.rows

    def store(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Write k/v [T, H_kv, D] at positions start..start+T-1 and return (keys, values, first): the keys and
        values to attend to, those of positions first, first + 1, ..., in order. (A decode step on a GPU writes
        the pool's rows by index instead: `KVPool`.)"""
        end = start + k.shape[0]
        if self.window is None:
            self.k[start:end] = k.to(self.k.dtype)
            self.v[start:end] = v.to(self.v.dtype)
            self._f32_valid = min(self._f32_valid, start)
            return self.k[:end], self.v[:end], 0
        room = self.rows - self.window + 1
        if k.shape[0] > room:
            raise ValueError(f"{k.shape[0]} tokens in one step; a sliding-window ring of {self.rows} rows takes {room}")
        device = self.k.device
        rows = torch.arange(start, end, device=device) % self.rows
        self.k.index_copy_(0, rows, k.to(self.k.dtype))
        self.v.index_copy_(0, rows, v.to(self.v.dtype))
        first = max(0, end - self.rows)
        held = torch.arange(first, end, device=device) % self.rows
        return self.k.index_select(0, held), self.v.index_select(0, held), first

    def share_float32(self, k32: torch.Tensor, vt32: torch.Tensor) -> None:
        """Keep the float32 copies in k32 [C, H_kv, D] and vt32 [H_kv, Dv, C] (views of a pool-wide pair that the CPU
        step graph writes along with the f16 rows: tandem.models.cpu_graph), C at least the rows of any padded read.
        They are refilled from the f16 rows on their first read here, so whoever wrote them last, they stay right."""
        assert self.window is None and k32.shape[1:] == self.k.shape[1:] and vt32.shape[:2] == self.v.shape[1:]
        self._f32 = (k32, vt32)
        self._f32_valid = 0

    def float32_rows(self, end: int, padded: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [0, padded) of a full buffer in float32, keys [padded, H_kv, D] and values transposed
        [H_kv, Dv, padded] (views), for ggml's attention on the CPU (layers/attention.py). Only the
        positions written since the last call, below `end`, are copied: each step then copies one row instead of
        the whole cache, which at long contexts cost a third of a CPU token. Rows from
        `end` on hold zeros or stale finite values, which the caller masks."""
        assert self.window is None and end <= padded
        size = self._f32[0].shape[0] if self._f32 is not None else 0
        if padded > size:  # grow by doubling (a copy of what is valid): host RAM follows the sequence
            new = max(padded, 2 * size)
            k32 = torch.zeros(new, *self.k.shape[1:], dtype=torch.float32)
            vt32 = torch.zeros(self.v.shape[1], self.v.shape[2], new, dtype=torch.float32)
            if self._f32 is not None:
                k32[:size], vt32[..., :size] = self._f32
            self._f32 = (k32, vt32)
        k32, vt32 = self._f32
        valid = min(self._f32_valid, end)
        k32[valid:end] = self.k[valid:end]
        vt32[..., valid:end] = self.v[valid:end].permute(1, 2, 0)
        self._f32_valid = end
        return k32[:padded], vt32[..., :padded]


@dataclass
class KVPool:
    """One layer's K/V of every slot: [N, R, H_kv, D] each (N slots), and each slot's `LayerKV` (views of its
    rows, with its own float32 copies for the CPU attention). A decode step on a GPU writes and reads the pool
    by slot and position, device tensors only, so that it can be captured as a CUDA graph; every other step
    works on the slots' views one sequence at a time."""

    k: torch.Tensor
    v: torch.Tensor
    window: int | None
    slots: list[LayerKV]

    @classmethod
    def allocate(
        cls,
        n_slots: int,
        n_ctx: int,
        n_kv_heads: int,
        k_dim: int,
        v_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        window: int | None = None,
        n_batch: int = 1,
    ) -> KVPool:
        """Per slot a full buffer of n_ctx rows, or with `window`, a ring of window + n_batch - 1 rows where that
        is fewer."""
        rows = n_ctx if window is None else min(n_ctx, window + n_batch - 1)
        ring = window if rows < n_ctx else None
        k = torch.zeros(n_slots, rows, n_kv_heads, k_dim, dtype=dtype, device=device)
        v = torch.zeros(n_slots, rows, n_kv_heads, v_dim, dtype=dtype, device=device)
        return cls(k, v, ring, [LayerKV(k=k[i], v=v[i], window=ring) for i in range(n_slots)])

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    def slot(self, i: int) -> LayerKV:
        return self.slots[i]

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + sum(kv.nbytes() - kv.k.nbytes - kv.v.nbytes for kv in self.slots)


class LayerState(Protocol):
    """Per-layer sequence state: a KV buffer for attention, conv/recurrent state for linear attention."""

    def nbytes(self) -> int: ...


@runtime_checkable
class RecurrentState(Protocol):
    """A layer state that folds every position into a fixed-size summary (linear attention): it cannot
    forget positions one by one, only go back to a snapshot taken earlier."""

    length: int  # positions folded in (counted by `KVCache.advance` after each step, never by the layer)

    def nbytes(self) -> int: ...

    def snapshot(self) -> Any: ...

    def restore(self, snapshot: Any | None) -> None:
        """Return to `snapshot` (None: the empty sequence)."""
        ...


MAX_CHECKPOINTS = 4  # recurrent-state snapshots kept per sequence (each is a few MiB per layer)


@dataclass
class KVCache:
    """The state of one sequence (one slot of a `StatePool`): one LayerState per layer, and the tokens it holds.

    With recurrent layers, truncation can only land where their state is known: at the current length,
    at a checkpoint (see `checkpoint`), or at 0; `truncate` then keeps less than asked for.
    """

    layers: list[Any]
    n_ctx: int
    length: int = 0
    tokens: list[int] = field(default_factory=list)
    checkpoints: list[tuple[int, list[Any]]] = field(default_factory=list)  # (length, recurrent snapshots)

    _recurrent_layers: list[Any] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def has_recurrent(self) -> bool:
        return bool(self._recurrent())

    def _recurrent(self) -> list[RecurrentState]:
        # found once (the layers are the pool's, fixed): an isinstance check against a runtime-checkable Protocol
        # costs tens of microseconds per layer, and this runs twice per step
        if self._recurrent_layers is None:
            self._recurrent_layers = [layer for layer in self.layers if isinstance(layer, RecurrentState)]
        return self._recurrent_layers

    def check_order(self) -> None:
        """Before a step: every recurrent state holds exactly the cache's positions (a step that failed halfway,
        or a length set by hand, would otherwise fold the next tokens in at the wrong place)."""
        for layer in self._recurrent():
            if layer.length != self.length:
                raise StateOrderError(f"recurrent state holds {layer.length} positions, the cache {self.length}")

    def advance(self, tokens: Sequence[int]) -> None:
        """Count `tokens` as computed after the current ones (the runner, after every step: a replayed CUDA graph
        runs no Python, so no layer counts positions itself)."""
        for layer in self._recurrent():
            layer.length += len(tokens)
        self.length += len(tokens)
        self.tokens.extend(tokens)

    def checkpoint(self) -> None:
        """Snapshot the recurrent layers at the current length, so that `truncate` can come back here."""
        recurrent = self._recurrent()
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
        below `length`, else to empty. Sliding-window rings have overwritten their oldest positions: where
        one no longer holds the window before `length`, the sequence goes back to empty. Read `self.length`
        for what was kept."""
        length = min(self.length, length)
        if not all(layer.can_truncate(self.length, length) for layer in self.layers if isinstance(layer, LayerKV)):
            length = 0
        recurrent = self._recurrent()
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
