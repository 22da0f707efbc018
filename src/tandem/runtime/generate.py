"""The generation loop: sample, stop on end-of-generation tokens, stop strings or max tokens,
and stream text without splitting UTF-8 characters or leaking a partial stop string."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from tandem.runtime.engine import Engine
from tandem.runtime.sampling import Sampler


def generate_tokens(
    engine: Engine,
    prompt: Sequence[int],
    sampler: Sampler,
    max_tokens: int,
    stop_ids: frozenset[int],
) -> Iterator[int]:
    """Yield up to `max_tokens` sampled tokens after `prompt` (a negative count: no limit, as llama.cpp's -n -1),
    a sequence of the engine's batch; an end-of-generation token ends it (and is not yielded), and so does a full
    context (as llama.cpp stops without context shift, and as vLLM finishes with "length")."""
    return engine.generate(engine.add_request(prompt, sampler, max_tokens, stop_ids))


@dataclass
class TextStream:
    """Turns token bytes into text pieces, holding back incomplete UTF-8 and possible stop strings."""

    stop: Sequence[str] = ()
    _pending: bytes = b""
    _held: str = ""
    stopped: bool = False

    def push(self, piece: bytes) -> str:
        """Add one token's bytes; return the text that is now safe to show."""
        self._pending += piece
        try:
            text = self._pending.decode("utf-8")
            self._pending = b""
        except UnicodeDecodeError as e:
            if e.reason != "unexpected end of data" or len(self._pending) - e.start > 3:
                text = self._pending.decode("utf-8", errors="replace")
                self._pending = b""
            else:
                text = self._pending[: e.start].decode("utf-8")
                self._pending = self._pending[e.start :]
        return self._release(self._held + text)

    def _release(self, text: str) -> str:
        for s in self.stop:
            at = text.find(s)
            if s and at >= 0:
                self.stopped = True
                self._held = ""
                return text[:at]
        hold = max((_overlap(text, s) for s in self.stop if s), default=0)
        self._held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        """The rest, at the end of generation."""
        if self.stopped:
            return ""
        rest = self._held + self._pending.decode("utf-8", errors="replace")
        self._held, self._pending = "", b""
        return rest


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
