"""Sequence state: one LayerState per layer (K/V buffers for attention), filled position by position, and the
pools that hold every slot's buffers along a leading slot axis (a batched decode step reads them by slot)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from tandem.errors import TandemError

CACHE_DTYPES: dict[str, torch.dtype] = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
# ggml's attention on the CPU reads keys in runs of this many positions, as llama.cpp pads its KV view: the padding
# decides where ggml's vector runs end and a scalar tail starts (layers/attention.py)
KV_PAD = 64
# llama.cpp's cache views with flash attention: a multiple of 256 cells (its n_kv), which decides the kernel's
# path and its split of the keys between threads
KV_PAD_FLASH = 256


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
    # the values transposed [H_kv, Dv, C] in the cache's dtype, for ggml's attention on the CPU (`attention_rows`):
    # positions [0, _vt_valid) up to date
    _vt: torch.Tensor | None = field(default=None, init=False, repr=False)
    _vt_valid: int = field(default=0, init=False, repr=False)

    @property
    def rows(self) -> int:
        return self.k.shape[0]

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + (self._vt.nbytes if self._vt is not None else 0)

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
            self._vt_valid = min(self._vt_valid, start)
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

    def forget(self, length: int) -> None:
        """Positions >= length are to be written again: their transposed values too, whoever rewrites the rows (a
        CPU step graph with flash attention writes the rows alone)."""
        self._vt_valid = min(self._vt_valid, length)

    def share_transposed(self, vt: torch.Tensor) -> None:
        """Keep the transposed values in vt [H_kv, Dv, C] (a view of a pool-wide tensor that the CPU step graph
        writes along with the rows: tandem.models.cpu_graph), C at least the rows of any padded read. They are
        refilled from the rows on their first read here, so whoever wrote them last, they stay right."""
        assert self.window is None and vt.shape[:2] == self.v.shape[1:] and vt.dtype == self.v.dtype
        self._vt = vt
        self._vt_valid = 0

    def attention_rows(self, end: int, padded: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [0, padded) of a full buffer as ggml's attention on the CPU reads them (layers/attention.py),
        in the cache's dtype: keys [padded, H_kv, D] (the rows themselves) and values transposed
        [H_kv, Dv, padded], as llama.cpp's cache holds them for attention without flash attention. Only the values
        written since the last call, below `end`, are transposed again: one row per decode step, not the whole
        cache. Positions from `end` on hold zeros or stale finite values, which the caller masks."""
        assert self.window is None and end <= padded
        size = self._vt.shape[-1] if self._vt is not None else 0
        if padded > size:  # grow by doubling (a copy of what is valid): host RAM follows the sequence
            vt = self.v.new_zeros(*self.v.shape[1:], max(padded, 2 * size))
            if self._vt is not None:
                vt[..., :size] = self._vt
            self._vt = vt
        valid = min(self._vt_valid, end)
        self._vt[..., valid:end] = self.v[valid:end].permute(1, 2, 0)
        self._vt_valid = end
        return _first_rows(self.k, padded), self._vt[..., :padded]


def _first_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """t's first n rows; past its end (a padded read), the memory after it where its storage has it (a pool's
    next slot or its tail: finite values that the reader masks), else zeros in a copy."""
    if n <= t.shape[0]:
        return t[:n]
    room = (t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()) // t.stride(0)
    if room >= n and t.is_contiguous():
        return t.as_strided((n, *t.shape[1:]), t.stride())
    padded = t.new_zeros(n, *t.shape[1:])
    padded[: t.shape[0]] = t
    return padded


@dataclass
class KVPool:
    """One layer's K/V of every slot: [N, R, H_kv, D] each (N slots), and each slot's `LayerKV` (views of its
    rows, with its values transposed for the CPU attention). A decode step on a GPU writes and reads the pool
    by slot and position, device tensors only, so that it can be captured as a CUDA graph; every other step
    works on the slots' views one sequence at a time."""

    k: torch.Tensor
    v: torch.Tensor
    window: int | None
    slots: list[LayerKV]
    tail: int = 0  # rows of keys' and values' memory after the last slot's (ggml's padded reads on the CPU stay in it)

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
        # On the CPU the keys and values have rows after the last slot's: ggml reads them in padded runs
        tail = KV_PAD_FLASH if ring is None and torch.device(device).type == "cpu" else 0

        def buffer(dim: int) -> torch.Tensor:
            flat = torch.zeros(n_slots * rows + tail, n_kv_heads, dim, dtype=dtype, device=device)
            return flat[: n_slots * rows].view(n_slots, rows, n_kv_heads, dim)

        k, v = buffer(k_dim), buffer(v_dim)
        return cls(k, v, ring, [LayerKV(k=k[i], v=v[i], window=ring) for i in range(n_slots)], tail)

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

    def snapshot(self, device: torch.device | str | None = None) -> Any:
        """A copy of the state as it is now, on `device` (None: where the state is)."""
        ...

    def restore(self, snapshot: Any | None) -> None:
        """Return to `snapshot` (None: the empty sequence)."""
        ...


MAX_CHECKPOINTS = 4  # recurrent-state snapshots kept per sequence (each is a few MiB per layer)
# Where checkpoints live: host memory, as llama-server keeps its context checkpoints. In VRAM they were outside the
# plan, one per slot at least (16 slots of Qwen3.6-35B-A3B: ~1 GiB); a checkpoint is taken once per prompt and
# restored only when a new prompt diverges after it, so the copies over PCIe cost little.
CHECKPOINT_DEVICE = "cpu"


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
        self.checkpoints.append((self.length, [layer.snapshot(CHECKPOINT_DEVICE) for layer in recurrent]))
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
        for layer in self.layers:
            if isinstance(layer, LayerKV):
                layer.forget(length)
        self.length = length
        del self.tokens[length:]

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)
