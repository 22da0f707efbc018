"""What shapes a CPU step's graph and what its leaves read: each attention layer's cache as the graphs see it
(`CacheCopies`), the step's key (its sequences' rows in query blocks, the keys each block reads, the decoding
sequences that attend as one group) and the host buffers a step program's leaves read, filled per call
(`StepInputs`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from tandem.layers.attention import AttentionShape
from tandem.models.decoder import DecoderModel
from tandem.state.kv_cache import KV_PAD, KV_PAD_FLASH, KVPool

__all__ = ["QUERY_BLOCK", "CacheCopies", "DecodeGroup", "GroupInputs", "Pieces", "QueryBlock", "StepInputs",
           "StepKey", "attention_kinds", "decode_group", "layer_windows", "sliding_ring", "step_key"]



# -- the cache as the graph sees it -------------------------------------------------------------------------------


@dataclass(eq=False)
class CacheCopies:
    """One attention layer's cache as the graphs read it, as llama.cpp's holds it for attention without flash
    attention: the pool's rows [N, R, G, Hd] (the keys, read where they lie; the layer path reads them too) and
    the values transposed [N, G, Dv, C] (C: the context rounded up to KV_PAD), which the graphs without flash
    attention write along with the rows (with it they read the values where they lie). The transposed values are
    each slot's `LayerKV.attention_rows` too, so the layer path and the graphs can take turns."""

    pool: KVPool
    vt: torch.Tensor

    @classmethod
    def of(cls, pool: KVPool) -> CacheCopies:
        n, rows, g, _ = pool.k.shape
        dv = pool.v.shape[-1]
        c = -(-rows // KV_PAD) * KV_PAD
        # zeros from numpy's allocator: untouched pages stay unallocated (masked values must be finite, and zero
        # pages are)
        dtype = np.float16 if pool.v.dtype is torch.float16 else np.float32
        vt = torch.from_numpy(np.zeros((n, g, dv, c), dtype=dtype))
        for i, kv in enumerate(pool.slots):
            kv.share_transposed(vt[i])
        return cls(pool, vt)

    @property
    def rows(self) -> int:  # the pool's rows per slot
        return int(self.pool.k.shape[1])

    @property
    def columns(self) -> int:  # transposed values per slot, head and dimension
        return int(self.vt.shape[-1])


# -- the step's shape ---------------------------------------------------------------------------------------------


class QueryBlock(NamedTuple):
    """Rows [offset, offset + n) of the step, all of one sequence, that attend together: per attention kind the
    first key position and the key count they read (multiples of KV_PAD; the keys before and after, which none of
    them sees, are left out, which changes no sum: their probabilities are 0)."""

    offset: int
    n: int
    views: tuple[tuple[int, int], ...]


class SeqKey(NamedTuple):
    """A sequence's part of a step, as far as it shapes the graph: its slot, rows, first row, and its rows' query
    blocks."""

    slot: int
    n: int
    offset: int
    blocks: tuple[QueryBlock, ...]


class StepKey(NamedTuple):
    """A step's shape (tuples: hashed and compared at C speed, per step)."""

    seqs: tuple[SeqKey, ...]
    n_logits: int | None  # rows whose logits the step returns (None: every row)
    flash: bool = False  # attention as ggml's flash-attention node (llama.cpp's -fa on), each block apart

    @property
    def n_tokens(self) -> int:
        return sum(s.n for s in self.seqs)


QUERY_BLOCK = 64  # rows of a sequence that attend together: in long prompts, fewer keys each block does not see

Pieces = Sequence[tuple[int, int, Sequence[int]]]  # per sequence: slot, position of its first token, its tokens


def sliding_ring(window: int | None, n_ctx: int, n_batch: int) -> int | None:
    """The cells of llama.cpp's cache of a sliding-window layer (n_swa + n_ubatch, in multiples of 256, at most the
    context): where a sequence's keys pass it, its ring has wrapped. None: a full-attention layer's cache never
    wraps."""
    if window is None:
        return None
    return -(-min(n_ctx, window + n_batch) // KV_PAD_FLASH) * KV_PAD_FLASH


def _flash_view(position: int, end: int, window: int | None, ring: int | None) -> tuple[int, int]:
    """The keys a sequence's flash-attention node reads: llama.cpp's view, the cells up to the last used one in
    multiples of 256 (their count decides the kernel's path and its split of the keys between threads), while its
    cache has not wrapped. Past a sliding ring's size, llama.cpp's view is the whole ring, its cells in an order of
    their own; the node reads the window's instead, in 256s (the ring's count, or a block more where the window's
first key is not on a 256 boundary)."""
    padded_end = -(-end // KV_PAD_FLASH) * KV_PAD_FLASH
    if window is None or ring is None or end <= ring:
        return 0, padded_end
    first = max(0, position - window + 1) // KV_PAD_FLASH * KV_PAD_FLASH
    return first, padded_end - first


def step_key(pieces: Pieces, windows: Sequence[int | None], all_logits: bool = False, flash: bool = False,
             rings: Sequence[int | None] | None = None) -> StepKey:
    """The shape of the step of `pieces`: logits of every row (decoding, or `all_logits`) or of each piece's last.
    `rings`: with `flash`, each window's `sliding_ring` (none: the keys from position 0)."""
    seqs, offset = [], 0
    rings = [None] * len(windows) if rings is None else rings
    for slot, position, tokens in pieces:
        n_seq = len(tokens)
        if flash:  # one node of every row over llama.cpp's view of the cache, of each kind
            views = tuple(_flash_view(position, position + n_seq, w, r) for w, r in zip(windows, rings, strict=True))
            seqs.append(SeqKey(slot, n_seq, offset, (QueryBlock(offset, n_seq, views),)))
            offset += n_seq
            continue
        blocks = []
        for r0 in range(0, n_seq, QUERY_BLOCK):
            n = min(QUERY_BLOCK, n_seq - r0)
            if 0 < n_seq - r0 - n < 2:  # no block of one row: one row's products sum otherwise (attention.py)
                n = n_seq - r0
            start = position + r0
            padded_end = -(-(start + n) // KV_PAD) * KV_PAD
            views = tuple(
                (first, padded_end - first)
                for first in (0 if w is None else max(0, (start - w + 1) // KV_PAD * KV_PAD) for w in windows)
            )
            blocks.append(QueryBlock(offset + r0, n, views))
            if r0 + n == n_seq:
                break
        seqs.append(SeqKey(slot, n_seq, offset, tuple(blocks)))
        offset += n_seq
    every_row = all_logits or all(s.n == 1 for s in seqs)
    key = StepKey(tuple(seqs), None if every_row else len(seqs), flash)
    group = decode_group(key)
    if group is None:
        return key
    # Once they attend as a group, the members' own views no longer shape the graph (their masks say which keys each
    # sees): one program serves every step whose group spans the same keys, wherever each member is in it.
    return key._replace(seqs=tuple(
        s._replace(blocks=(s.blocks[0]._replace(views=group.views),)) if j in group.members else s
        for j, s in enumerate(key.seqs)
    ))  # fmt: skip


class DecodeGroup(NamedTuple):
    """The step's decoding sequences (one row each) attending as one batch: slots lo .. lo + n_slots - 1 side by
    side (the cache's slot stride), per attention kind the key range (first, count) that covers each member's view.
    A slot of the range without a member computes a row nobody reads; a member's keys outside its own view are
    masked, which changes no sum (multiples of KV_PAD, probabilities 0), so each member's values are those of its
    own block."""

    members: tuple[int, ...]  # indices into the step's sequences
    lo: int
    n_slots: int
    views: tuple[tuple[int, int], ...]


def decode_group(key: StepKey) -> DecodeGroup | None:
    """The decoding sequences of the step as one group, or None: fewer than two, or a group whose slot range and
    key span would compute more than twice the keys its members read (one long context among short ones)."""
    members = tuple(j for j, s in enumerate(key.seqs) if s.n == 1)
    if len(members) < 2 or key.flash:  # flash attention: a node per sequence, each as it would run alone
        return None
    slots = [key.seqs[j].slot for j in members]
    lo, n_slots = min(slots), max(slots) - min(slots) + 1
    views = []
    for k in range(len(key.seqs[members[0]].blocks[0].views)):
        spans = [key.seqs[j].blocks[0].views[k] for j in members]
        first = min(f for f, _ in spans)
        views.append((first, max(f + n for f, n in spans) - first))
    read = sum(n for j in members for _, n in key.seqs[j].blocks[0].views)
    if n_slots * sum(n for _, n in views) > 2 * read:
        return None
    return DecodeGroup(members, lo, n_slots, tuple(views))


@dataclass(eq=False)
class StepInputs:
    """The host buffers a step program's leaves read, filled per call (`fill`)."""

    ids: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32
    rows: np.ndarray  # [T] int32: each row's row in the pool (slot * R + position)
    vt_index: dict[tuple[int, int], np.ndarray]  # (G, Dv) -> [T * G * Dv] int64: each value's place in V^T
    masks: list[list[np.ndarray]]  # per query block, per kind: [N, S] float32, 0 or -inf (none: the group's)
    logit_rows: np.ndarray | None  # [B] int32
    group: GroupInputs | None
    _lanes: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)

    def fill(self, pieces: Pieces, key: StepKey, windows: Sequence[int | None], rows: int, columns: int) -> None:
        n_blocks = 0
        for (slot, start, tokens), seq in zip(pieces, key.seqs, strict=True):
            o, n = seq.offset, seq.n
            if n == 1:  # decoding: no arrays made
                self.ids[o], self.positions[o] = tokens[0], start
                self.rows[o] = slot * rows + start
            else:
                self.ids[o : o + n] = tokens
                self.positions[o : o + n] = np.arange(start, start + n)
                self.rows[o : o + n] = self.positions[o : o + n] + slot * rows  # below 2^31 (`unsupported`)
            for block in seq.blocks:
                if self.masks[n_blocks]:
                    self._mask(block, start + block.offset - o, windows, self.masks[n_blocks])
                n_blocks += 1
        if self.group is not None:
            self.group.fill([pieces[j][1] for j in self.group.shape.members], windows)
        slots = (self.rows // max(rows, 1)).astype(np.int64)  # rows 0: no attention layer, no vt_index
        for (g, dv), index in self.vt_index.items():  # ((slot * G + g) * Dv + d) * C + position, t major
            lanes = self._lanes.get((g * dv, columns))
            if lanes is None:
                lanes = self._lanes[(g * dv, columns)] = np.arange(g * dv, dtype=np.int64) * columns  # (g*Dv + d) * C
            base = slots * (g * dv * columns) + self.positions  # slot * G * Dv * C + position
            np.add(base[:, None], lanes[None, :], out=index.reshape(len(self.ids), g * dv))
        if self.logit_rows is not None:
            self.logit_rows[:] = [seq.offset + seq.n - 1 for seq in key.seqs]

    @staticmethod
    def _mask(block: QueryBlock, start: int, windows: Sequence[int | None], masks: list[np.ndarray]) -> None:
        """0 where a row of `block` (at positions start ..) sees a key of its views, -inf elsewhere."""
        for (first, n_keys), window, mask in zip(block.views, windows, masks, strict=True):
            mask.fill(-np.inf)
            if block.n == 1:  # one row (decoding): the keys it sees are one run
                mask[0, (0 if window is None else max(0, start - window + 1 - first)) : start + 1 - first] = 0.0
                continue
            q_pos = np.arange(start, start + block.n, dtype=np.int64)[:, None]
            distance = q_pos - np.arange(first, first + n_keys, dtype=np.int64)[None, :]
            allowed = distance >= 0
            if window is not None:
                allowed &= distance < window
            mask[allowed] = 0.0


@dataclass(eq=False)
class GroupInputs:
    """The host buffers of a DecodeGroup: the step row each slot of its range takes its query from, the row of the
    group's output each member takes back and the member's row of the step (both fixed by the step's shape), and
    per kind the mask [n_slots, 1, 1, S], filled per call."""

    shape: DecodeGroup
    query_rows: np.ndarray  # [n_slots] int32
    output_rows: np.ndarray  # [members] int32
    step_rows: np.ndarray  # [members] int32
    masks: list[np.ndarray]  # per kind [n_slots, 1, 1, S] float32, 0 or -inf

    @classmethod
    def of(cls, group: DecodeGroup, key: StepKey) -> GroupInputs:
        query_rows = np.zeros(group.n_slots, dtype=np.int32)
        output_rows = np.zeros(len(group.members), dtype=np.int32)
        step_rows = np.zeros(len(group.members), dtype=np.int32)
        for i, j in enumerate(group.members):
            seq = key.seqs[j]
            output_rows[i] = seq.slot - group.lo
            query_rows[seq.slot - group.lo] = step_rows[i] = seq.offset
        masks = [np.full((group.n_slots, 1, 1, n_keys), -np.inf, dtype=np.float32) for _, n_keys in group.views]
        for mask in masks:  # a slot of the range without a member: one key, so that its row stays finite
            mask[:, 0, 0, 0] = 0.0
        return cls(group, query_rows, output_rows, step_rows, masks)

    def fill(self, starts: Sequence[int], windows: Sequence[int | None]) -> None:
        """Each member's row of the masks: the keys up to its position (in its window)."""
        for row, start in zip(self.output_rows, starts, strict=True):
            for (first, _), window, mask in zip(self.shape.views, windows, self.masks, strict=True):
                keys = mask[row, 0, 0]
                keys.fill(-np.inf)
                keys[(0 if window is None else max(0, start - window + 1 - first)) : start + 1 - first] = 0.0


def layer_windows(model: DecoderModel) -> list[int | None]:
    """Each layer's sliding window (None: full attention, or a mixer that reads no keys)."""
    mixers = [block.mixer for block in model.blocks]  # type: ignore[attr-defined]
    return [m.shape.sliding_window if _attends(m) else None for m in mixers]


def attention_kinds(model: DecoderModel) -> list[int | None]:
    """The distinct windows of the model's attention layers (None, full attention, first): each is a kind of
    attention whose keys and mask a sequence shares between the layers of that kind."""
    windows = {w for block, w in zip(model.blocks, layer_windows(model), strict=True) if _attends(block.mixer)}  # type: ignore[attr-defined]
    return sorted(windows or {None}, key=lambda w: -1 if w is None else w)


def _attends(mixer: object) -> bool:
    """Whether a layer's mixer attends over a KV cache (a delta-net carries a state instead)."""
    return isinstance(getattr(mixer, "shape", None), AttentionShape)
