"""The batch descriptor of one step: which sequences (slots) advance by which tokens, at which positions.

Shapes: T = tokens of the step (every sequence's, one after the other), B = sequences of the step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SeqSpan:
    """One sequence's part of a step: rows [offset, offset + n) of the step, at positions start .. start + n - 1
    of the sequence in `slot`."""

    slot: int
    start: int
    n: int
    offset: int

    @property
    def rows(self) -> slice:
        return slice(self.offset, self.offset + self.n)


@dataclass(frozen=True)
class RowSpans:
    """Spans of a step taken row by row (by their `offsets`): `rows` [R] their rows of the step and `slots` [R]
    each row's slot (device tensors, int64; None when no span is); `every_row` when they are all of the step's
    rows, in order."""

    offsets: frozenset[int]
    rows: torch.Tensor | None
    slots: torch.Tensor | None
    every_row: bool


@dataclass
class StepBatch:
    """What the layers read about a step (they infer nothing from a tensor's length).

    `decode`: every sequence advances by one token. On a GPU such a step is `pooled` (`slots` set): the mixers
    address the state pool by slot and position through device tensors and build no Python per sequence, so
    the step can be captured as a CUDA graph per batch size; rows whose slot is -1 are padding up to the
    graph's size (their state is neither read nor written, their logits are ignored). A pooled step that is
    not `decode` is one sequence's prompt chunk (`chunk`), captured per length and `key_rows`. Every other
    step (chunks of several sequences, any step on the CPU) runs each sequence's mixer part on its slot's
    state, `spans` in order."""

    ids: torch.Tensor  # [T] token ids (host)
    positions: torch.Tensor  # [T] each token's position in its sequence (compute device)
    spans: tuple[SeqSpan, ...]
    decode: bool
    slots: torch.Tensor | None = None  # [T] each row's slot (compute device): pooled decode steps
    logit_rows: torch.Tensor | None = None  # [B] rows whose logits the step returns (None: every row)
    # A pooled chunk: the leading rows of a full KV buffer its attention reads (a power of two past its last
    # position, so that a few graphs serve every start; the rows past a query's position are masked).
    key_rows: int = 0
    # The spans whose rows attend one by one by slot, made by the first attention layer that asks and kept for
    # the step's other layers (layers/attention.py `_row_spans`).
    attention_rows: RowSpans | None = field(default=None, compare=False, repr=False)

    @property
    def n_tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def pooled(self) -> bool:
        return self.slots is not None

    @classmethod
    def chunk(cls, slot: int, start: int, tokens: Sequence[int], device: torch.device) -> StepBatch:
        """The pooled step of one sequence's prompt chunk on a GPU: `tokens` after the `start` ones of `slot`,
        logits of the last one."""
        n = len(tokens)
        return cls(
            ids=torch.tensor(list(tokens), dtype=torch.long),
            positions=torch.arange(start, start + n, device=device),
            spans=(),
            decode=False,
            slots=torch.full((n,), slot, dtype=torch.long, device=device),
            logit_rows=torch.tensor([n - 1], device=device),
            key_rows=1 << (start + n - 1).bit_length(),
        )

    @classmethod
    def build(
        cls,
        pieces: Sequence[tuple[int, int, Sequence[int]]],
        device: torch.device,
        all_logits: bool = False,
        pad_to: int | None = None,
    ) -> StepBatch:
        """The step of `pieces`: (slot, position of the first token, token ids) per sequence. Logits of each
        sequence's last token, or of every token with `all_logits`. `pad_to` (decode steps): padding rows up to
        that many (slot -1, position 0, token 0). A decode step on a GPU is pooled."""
        spans, ids, positions, offset = [], [], [], 0
        for slot, start, tokens in pieces:
            spans.append(SeqSpan(slot, start, len(tokens), offset))
            ids.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
            offset += len(tokens)
        decode = all(s.n == 1 for s in spans)
        slots = [s.slot for s in spans] if decode and device.type == "cuda" else None
        if pad_to is not None:
            assert slots is not None and pad_to >= len(ids), (pad_to, len(ids))
            pad = pad_to - len(ids)
            ids, positions, slots = ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad
        logit_rows = None
        if not all_logits and not decode:
            logit_rows = torch.tensor([s.offset + s.n - 1 for s in spans], device=device)
        return cls(
            ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            spans=tuple(spans),
            decode=decode,
            slots=None if slots is None else torch.tensor(slots, dtype=torch.long, device=device),
            logit_rows=logit_rows,
        )
