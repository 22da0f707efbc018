"""The engine: sequences in the slots of one state pool, advanced together step by step.

`step()` is the whole loop: the scheduler picks each sequence's tokens (scheduler.py), the runner runs them as
one batch (runner.py), the engine samples the sequences whose step ended at their last token and finishes those
that are done. `LLM.generate` and `tandem run` are a batch of one through the same loop; `feed`, `append` and
`all_logits` drive slot 0 directly (logits for tests and fidelity checks)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Tokens
from dataclasses import dataclass

import torch

from tandem.models.decoder import DecoderModel
from tandem.runtime.runner import ModelRunner
from tandem.runtime.sampling import Sampler, sample_rows
from tandem.runtime.scheduler import Scheduler, reuse_prefix
from tandem.runtime.sequence import Sequence
from tandem.state.kv_cache import ContextFullError, KVCache
from tandem.state.pool import StatePool

# Makes the engine's runner from the model, the state pool and whether decode may be captured (ModelRunner; under
# --tp rank 0's TPRunner, which sends each step to the other ranks).
RunnerFactory = Callable[[DecoderModel, StatePool, bool], ModelRunner]


@dataclass
class StepOutput:
    """A token sampled for `seq` in a step (None: it finished without one, e.g. on an end-of-generation token)."""

    seq: Sequence
    token: int | None


class Engine:
    """Owns a model, the state pool of `n_slots` sequences of up to n_ctx tokens, the runner and the scheduler.
    A step schedules up to `step_tokens` tokens (llama.cpp's logical batch, -b; default n_batch) and computes
    them in runs of at most n_batch (its physical batch, -ub), sampling once they are all done: prompts that
    arrive together give their first tokens together, in the memory of n_batch tokens."""

    def __init__(
        self,
        model: DecoderModel,
        n_ctx: int,
        cache_dtype: torch.dtype,
        n_batch: int = 512,
        graphs: bool = True,
        n_slots: int = 1,
        runner: RunnerFactory = ModelRunner,
        step_tokens: int | None = None,
    ) -> None:
        self.model = model
        self.n_batch = n_batch
        self.n_ctx = n_ctx
        self.pool = model.new_pool(n_slots, n_ctx, cache_dtype, n_batch)
        self.runner = runner(model, self.pool, graphs)
        self.scheduler = Scheduler(self.pool, step_tokens or n_batch)
        self._ids = itertools.count()
        # called where a new text begins (a request added, slot 0 emptied): --expert-stats counts texts apart
        self.on_new_text: Callable[[], None] | None = None

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, prompt: Tokens[int], sampler: Sampler, max_tokens: int, stop_ids: frozenset[int]) -> Sequence:
        """Queue a generation of up to `max_tokens` tokens after `prompt` (negative: until the context is full)."""
        if len(prompt) > self.n_ctx:
            raise ContextFullError(
                f"context full: the prompt's {len(prompt)} tokens exceed the context size {self.n_ctx} "
                f"(raise -c/--ctx-size)"
            )
        self._new_text()
        seq = Sequence(next(self._ids), list(prompt), sampler, max_tokens, stop_ids)
        if max_tokens == 0:
            self.scheduler.finish(seq, "length")
        else:
            self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        self.scheduler.finish(seq, "abort")

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[StepOutput]:
        """One step of every running sequence (and of those admitted now); the tokens sampled in it."""
        work = self.scheduler.schedule()
        if not work:
            return []
        try:
            logits = self._run([(w.seq.slot, w.tokens) for w in work])  # type: ignore[misc]
        except BaseException:
            for w in work:  # their slots' states are unknown after a failed step: forget them
                self.pool.caches[w.seq.slot].truncate(0)  # type: ignore[index]
                self.scheduler.finish(w.seq, "abort")
            raise
        sampled = [(w.seq, row) for w, row in zip(work, logits, strict=True) if w.samples]
        if not sampled:
            return []
        rows = torch.stack([row for _, row in sampled]) if len(sampled) < len(work) else logits
        tokens = sample_rows([seq.sampler for seq, _ in sampled], rows, [seq.tokens for seq, _ in sampled])
        out = []
        for (seq, _), token in zip(sampled, tokens, strict=True):
            if token in seq.stop_ids:
                self.scheduler.finish(seq, "stop")
                out.append(StepOutput(seq, None))
                continue
            seq.tokens.append(token)
            out.append(StepOutput(seq, token))
            cache = self.pool.caches[seq.slot]  # type: ignore[index]
            if seq.n_output == seq.max_tokens or cache.length >= self.n_ctx:
                self.scheduler.finish(seq, "length")
        return out

    def _run(self, pieces: list[tuple[int, list[int]]]) -> torch.Tensor:
        """The logits after each piece, computed in runs of at most n_batch tokens in the pieces' order (a piece
        longer than the room left goes on in the next run)."""
        if sum(len(tokens) for _, tokens in pieces) <= self.n_batch:
            return self.runner.run(pieces)
        rows: list[torch.Tensor | None] = [None] * len(pieces)
        run: list[tuple[int, list[int]]] = []
        ends: list[int | None] = []  # per part of the run: the piece it ends, if it does
        room = self.n_batch
        for i, (slot, tokens) in enumerate(pieces):
            at = 0
            while at < len(tokens):
                take = min(room, len(tokens) - at)
                run.append((slot, tokens[at : at + take]))
                at += take
                ends.append(i if at == len(tokens) else None)
                room -= take
                if room == 0:
                    self._run_part(run, ends, rows)
                    room = self.n_batch
        if run:
            self._run_part(run, ends, rows)
        done = [row for row in rows if row is not None]
        assert len(done) == len(pieces)
        return torch.stack(done)

    def _run_part(
        self, run: list[tuple[int, list[int]]], ends: list[int | None], rows: list[torch.Tensor | None]
    ) -> None:
        """One run of `_run`: its logits kept for the pieces it ends (copied: a captured step's logits are its
        graph's output, which the next run's replay rewrites)."""
        logits = self.runner.run(list(run))
        for end, row in zip(ends, logits, strict=True):
            if end is not None:
                rows[end] = row.clone()
        run.clear()
        ends.clear()

    def generate(self, seq: Sequence) -> Iterator[int]:
        """`seq`'s tokens as they are sampled, stepping the engine (and every other sequence in it) until it ends;
        a caller that stops early (a stop string) aborts it."""
        try:
            while not seq.finished:
                for o in self.step():
                    if o.seq is seq and o.token is not None:
                        yield o.token
        finally:
            self.abort(seq)

    # -- slot 0, driven directly -----------------------------------------------------------------
    @property
    def cache(self) -> KVCache:
        """Slot 0's cache (the one sequence of `feed`, `append` and `all_logits`)."""
        return self.pool.caches[0]

    @property
    def context_full(self) -> bool:
        """Whether slot 0 fills the context: nothing more can be appended."""
        return self.cache.length >= self.n_ctx

    def reset(self) -> None:
        self._new_text()
        self.cache.truncate(0)

    def _new_text(self) -> None:
        if self.on_new_text is not None:
            self.on_new_text()

    def feed(self, ids: Tokens[int]) -> torch.Tensor:
        """Make slot 0's sequence equal to `ids` and return the logits [V] after its last token, the longest
        prefix already there kept (`reuse_prefix`); with recurrent layers a checkpoint is taken before the
        last token, so that the next call starting with `ids` resumes there."""
        ids = list(ids)
        reuse_prefix(self.cache, ids)
        start = self.cache.length
        if start == 0:
            self._new_text()
        if self.cache.has_recurrent and start < len(ids) - 1:
            self.append(ids[start:-1])
            self.cache.checkpoint()
            return self.append(ids[-1:])
        return self.append(ids[start:])

    def append(self, ids: Tokens[int]) -> torch.Tensor:
        """Run new tokens after slot 0's cached ones, in steps of n_batch; logits [V] after the last."""
        assert ids, "append() needs at least one token"
        logits = None
        for i in range(0, len(ids), self.n_batch):
            logits = self.runner.run([(0, ids[i : i + self.n_batch])])
        assert logits is not None
        return logits[-1]

    def all_logits(self, ids: Tokens[int]) -> torch.Tensor:
        """Logits [T, V] at every position of a fresh sequence `ids` in slot 0."""
        self.reset()
        chunks = [ids[i : i + self.n_batch] for i in range(0, len(ids), self.n_batch)]
        return torch.cat([self.runner.run([(0, chunk)], all_logits=True) for chunk in chunks])
