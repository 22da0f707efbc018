"""The scheduler: which sequences advance in the next step, and by how many tokens.

Every running sequence that has its prompt computed decodes one token per step; prompts are computed in chunks
in the token budget left (`-b/--batch-size` tokens per step), so a long prompt does not stall the sequences
decoding beside it (chunked prefill, as vLLM's and llama-server's continuous batching). A waiting sequence gets
a free slot when there is one, the slot whose tokens share the longest prefix with its prompt (the next turn of
a chat resumes where the last one ended, as `llama-server`'s slot reuse)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tandem.runtime.sequence import Sequence, Status
from tandem.state.kv_cache import KVCache
from tandem.state.pool import StatePool


@dataclass
class Work:
    """A sequence's part of the next step: its next tokens not yet in its slot; `samples`: they end with its
    last known token, so the step's logits after them give its next token."""

    seq: Sequence
    tokens: list[int]
    samples: bool


def shared_prefix(tokens: list[int], ids: list[int]) -> int:
    """How many leading tokens `tokens` and `ids` have in common."""
    n, limit = 0, min(len(tokens), len(ids))
    while n < limit and tokens[n] == ids[n]:
        n += 1
    return n


def reuse_prefix(cache: KVCache, ids: list[int]) -> None:
    """Cut `cache` to the longest prefix it shares with `ids`, short of the last token (whose logits are needed).
    Recurrent layers keep less (their latest checkpoint below it, or nothing): read `cache.length`."""
    cache.truncate(min(shared_prefix(cache.tokens, ids), max(0, len(ids) - 1)))


class Scheduler:
    """Admission, chunked prefill beside decode under a per-step token budget, finishing and aborting."""

    def __init__(self, pool: StatePool, token_budget: int) -> None:
        self.pool = pool
        self.token_budget = token_budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free = list(range(pool.n_slots))  # least recently used first

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Work]:
        """The next step's work: every decoding sequence's token first, then prompt chunks in the budget left,
        then newly admitted sequences' first chunks."""
        budget = self.token_budget
        work: list[Work] = []
        prefilling = []
        for seq in self.running:
            if len(seq.tokens) - self._cache(seq).length == 1:
                work.append(self._work(seq, 1))
                budget -= 1
            else:
                prefilling.append(seq)
        for seq in prefilling:
            if budget <= 0:
                break
            work.append(chunk := self._chunk(seq, budget))
            budget -= len(chunk.tokens)
        while budget > 0 and self.waiting and self._free:
            seq = self.waiting.popleft()
            self._admit(seq)
            work.append(chunk := self._chunk(seq, budget))
            budget -= len(chunk.tokens)
        return work

    def _cache(self, seq: Sequence) -> KVCache:
        assert seq.slot is not None
        return self.pool.caches[seq.slot]

    def _work(self, seq: Sequence, n: int) -> Work:
        """The sequence's next `n` tokens. Before its last prompt token the recurrent state (if any) is
        checkpointed: the next turn of a chat starts with this prompt and can resume there (a recurrent state
        cannot be cut back to any position)."""
        cache, tokens = self._cache(seq), seq.tokens
        start = cache.length
        if start == len(seq.prompt) - 1:
            cache.checkpoint()
        return Work(seq, tokens[start : start + n], samples=start + n == len(tokens))

    def _chunk(self, seq: Sequence, budget: int) -> Work:
        """Up to `budget` of the sequence's prompt tokens not yet computed; with recurrent layers short of the last
        one, which then runs alone after the checkpoint (`_work`)."""
        cache = self._cache(seq)
        end = len(seq.tokens) - (1 if cache.has_recurrent else 0)
        return self._work(seq, min(budget, max(1, end - cache.length)))

    def _admit(self, seq: Sequence) -> None:
        """A free slot for `seq`: the one whose tokens share the longest prefix with its prompt, cut to it."""
        def shared(slot: int) -> int:
            return shared_prefix(self.pool.caches[slot].tokens, seq.prompt)

        slot = max(self._free, key=shared)  # ties: the least recently used (max keeps the first)
        self._free.remove(slot)
        seq.slot, seq.status = slot, Status.RUNNING
        reuse_prefix(self.pool.caches[slot], seq.prompt)
        self.running.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` (running or waiting); its slot is free again, its tokens kept there for prefix reuse."""
        if seq.finished:
            return
        seq.status, seq.finish_reason = Status.FINISHED, reason
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
            assert seq.slot is not None
            self._free.append(seq.slot)
