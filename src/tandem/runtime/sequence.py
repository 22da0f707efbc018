"""A request of the engine: its tokens, sampling, stop conditions, slot and status."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tandem.runtime.sampling import Sampler


class Status(enum.Enum):
    WAITING = "waiting"  # not yet given a slot
    RUNNING = "running"  # in a slot: prefilling its prompt, then decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One generation: `prompt` then the sampled `output`, up to `max_tokens` (negative: until the context is
    full). An end-of-generation token in `stop_ids` ends it without being added. `finish_reason` once finished:
    "stop" (an end-of-generation token, or the caller stopped it at a stop string), "length" (max_tokens or a
    full context) or "abort"."""

    id: int
    prompt: list[int]
    sampler: Sampler
    max_tokens: int
    stop_ids: frozenset[int]
    status: Status = Status.WAITING
    slot: int | None = None
    finish_reason: str | None = None
    # the prompt, then each sampled token: one list the scheduler slices every step, not built anew each time
    tokens: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)

    @property
    def n_output(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt) :]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
