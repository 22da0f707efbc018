"""The engine's one thread: it loads the model, then loops, taking new requests from a queue into the engine,
stepping it while there is work, and handing each request's text pieces to the asyncio side.

A model must be used from the thread that loaded it (ggml's OpenMP teams are per calling thread: docs/FLAGS.md),
so everything that touches the model or its tokenizer runs here: chat templates, tokenization, `Engine.step`,
detokenization and stop strings (`TextStream`). The HTTP side (asyncio) only submits `Job`s and reads their
events, which this thread puts on each job's asyncio queue with `loop.call_soon_threadsafe`. A job whose client
went away is `cancel`led: its sequence is aborted before the next step."""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.api import LLM
from tandem.errors import TandemError
from tandem.runtime.generate import TextStream
from tandem.runtime.sampling import Sampler
from tandem.runtime.sequence import Sequence as EngineSequence
from tandem.server.protocol import APIError, Generation
from tandem.state.kv_cache import ContextFullError

WAITING_PER_SLOT = 4  # requests allowed to wait for a slot, per slot; more are refused with 429


# -- the events a job's queue receives, in this order: Started, Piece..., then Finished or Failed -----------------
@dataclass
class Started:
    prompt_tokens: int


@dataclass
class Piece:
    text: str


@dataclass
class Finished:
    reason: str  # "stop" (end-of-generation token or stop string) or "length" (max_tokens or a full context)
    prompt_tokens: int
    completion_tokens: int
    prompt_seconds: float  # from submission to the first token
    total_seconds: float


@dataclass
class Failed:
    error: APIError


Event = Started | Piece | Finished | Failed


@dataclass(eq=False)
class Job:
    """A request on its way through the worker. The HTTP side reads `events`; the worker owns the rest."""

    gen: Generation
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    seq: EngineSequence | None = None
    text: TextStream | None = None
    reason: str | None = None
    first_token: float | None = None


@dataclass
class ChatTemplate:
    """The server's chat template choice (--chat-template NAME / --chat-template-file / --chat-template-kwargs),
    as `LLM.apply_chat_template` takes it."""

    chat_template: str | None = None
    chat_template_name: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class EngineWorker:
    """Loads the model with `load()` on its own thread and runs the engine there until `stop()`."""

    def __init__(
        self, load: Callable[[], LLM], template: ChatTemplate | None = None, max_waiting: int | None = None
    ) -> None:
        self._load = load
        self.template = template or ChatTemplate()
        self._max_waiting = max_waiting
        self._inbox: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._active: dict[EngineSequence, Job] = {}
        self._lock = threading.Lock()
        self._outstanding = 0  # submitted and not yet finished, failed or cancelled
        self._stopping = False
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="tandem-engine", daemon=True)
        self.llm: LLM | None = None
        self.capacity = 0  # slots + waiting requests allowed (set once loaded)
        self.busy_slots = 0  # read by /health and /metrics (a snapshot the worker refreshes)
        self.kv_tokens = 0  # positions held in the slots' caches, running sequences' and kept prefixes' (snapshot)
        self.on_tokens: Callable[[int, int], None] = lambda prompt, generated: None  # metrics hook

    # -- the HTTP side ---------------------------------------------------------------------------------------
    def start(self) -> LLM:
        """Start the thread and wait for the model; a load error is raised here."""
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            raise self._load_error
        assert self.llm is not None
        return self.llm

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def try_submit(self, job: Job) -> bool:
        """Queue `job` for the engine, or False when as many requests run and wait as allowed (a 429)."""
        with self._lock:  # against a stop: a job taken in after the last drain would wait forever
            if self._outstanding >= self.capacity or not self.alive:
                return False
            self._outstanding += 1
            self._inbox.put(job)
        return True

    def cancel(self, job: Job) -> None:
        """The client went away (or the answer is complete): abort the job's sequence before the next step."""
        if not job.cancelled:
            job.cancelled = True
            self._inbox.put(None)  # wakes the thread if it waits

    def stop(self, timeout: float | None = 30.0) -> None:
        self._stopping = True
        self._inbox.put(None)
        self._thread.join(timeout)

    # -- the engine thread -----------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.llm = self._load()
            slots = self.llm.engine.pool.n_slots
            self.capacity = slots + (WAITING_PER_SLOT * slots if self._max_waiting is None else self._max_waiting)
            if any(v is not None for v in vars(self.template).values()):  # a template given at start: fail now
                self.llm.apply_chat_template([{"role": "user", "content": "hi"}], **vars(self.template))
        except BaseException as e:  # the caller of start() raises it
            self._load_error = e
            if self.llm is not None:
                self.llm.close()
            return
        finally:
            self._ready.set()
        try:
            while not self._stopping:
                self._take(block=not self._active and not self.llm.engine.has_work)
                self._drop_cancelled()
                if self.llm.engine.has_work:
                    self._step()
                self._refresh()
        finally:  # stop() or a bug (its traceback follows): the requests held get a 503 instead of no answer
            with self._lock:
                why = "the server is shutting down" if self._stopping else "the engine's thread failed"
                self._stopping = True
                waiting = self._drain()
            for job in [*self._active.values(), *waiting]:
                self._fail(job, APIError(503, why, "server_error"))
            self.llm.close()

    def _drain(self) -> list[Job]:
        jobs = []
        while True:
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                return jobs
            if job is not None:
                jobs.append(job)

    def _take(self, block: bool) -> None:
        """New jobs into the engine; waits for one when there is nothing to step."""
        jobs = []
        if block:
            job = self._inbox.get()
            if job is not None:
                jobs.append(job)
        for job in [*jobs, *self._drain()]:
            if job.cancelled:
                self._done(job)
            else:
                self._admit(job)

    def _admit(self, job: Job) -> None:
        assert self.llm is not None
        try:
            ids = self._prompt_ids(job.gen)
            stop_ids = frozenset() if job.gen.ignore_eos else self.llm.tokenizer.stop_ids
            job.seq = self.llm.engine.add_request(ids, Sampler(job.gen.sampling), job.gen.max_tokens, stop_ids)
        except TandemError as e:  # a prompt too long for the context, a template that fails, a bad token id
            code = "context_length_exceeded" if isinstance(e, ContextFullError) else None
            self._fail(job, APIError(400, str(e), code=code))
            return
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            self._fail(job, APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error"))
            return
        job.text = TextStream(stop=job.gen.stop)
        self._active[job.seq] = job
        self._emit(job, Started(len(ids)))
        self.on_tokens(len(ids), 0)
        if job.seq.finished:  # max_tokens 0
            self._finish(job)

    def _prompt_ids(self, gen: Generation) -> list[int]:
        """The prompt's tokens as `LLM.chat` or `LLM.generate` make them."""
        llm = self.llm
        assert llm is not None
        if gen.messages is None:
            assert gen.prompt is not None
            return llm.prompt_ids(gen.prompt)
        template = self.template
        kwargs = {**(template.chat_template_kwargs or {}), **(gen.template_kwargs or {})}
        return llm.chat_ids(gen.messages, chat_template=template.chat_template,
                            chat_template_name=template.chat_template_name, chat_template_kwargs=kwargs)  # fmt: skip

    def _drop_cancelled(self) -> None:
        assert self.llm is not None
        for seq, job in list(self._active.items()):
            if job.cancelled:
                self.llm.engine.abort(seq)
                del self._active[seq]
                self._done(job)

    def _step(self) -> None:
        llm = self.llm
        assert llm is not None
        try:
            outputs = llm.engine.step()
        except Exception as e:  # the engine aborted the step's sequences: their requests fail, the rest go on
            traceback.print_exc(file=sys.stderr)
            error = APIError(500, f"the model failed: {type(e).__name__}: {e}", "server_error")
            for seq, job in list(self._active.items()):
                if seq.finished:
                    del self._active[seq]
                    self._fail(job, error)
            return
        now = time.perf_counter()
        generated = 0
        for out in outputs:
            job = self._active.get(out.seq)
            if job is None or out.token is None:
                continue
            generated += 1
            if job.first_token is None:
                job.first_token = now
            assert job.text is not None
            piece = job.text.push(llm.tokenizer.token_to_piece(out.token))
            if piece:
                self._emit(job, Piece(piece))
            if job.text.stopped:
                job.reason = "stop"
                llm.engine.abort(out.seq)
        if generated:
            self.on_tokens(0, generated)
        for seq, job in list(self._active.items()):
            if seq.finished:
                self._finish(job)

    def _finish(self, job: Job) -> None:
        assert job.seq is not None and job.text is not None
        del self._active[job.seq]
        rest = job.text.flush()
        if rest:
            self._emit(job, Piece(rest))
        now = time.perf_counter()
        first = job.first_token or now
        reason = job.reason or job.seq.finish_reason or "stop"
        self._emit(job, Finished(reason, len(job.seq.prompt), job.seq.n_output, first - job.submitted,
                                 now - job.submitted))  # fmt: skip
        self._done(job)

    def _fail(self, job: Job, error: APIError) -> None:
        self._emit(job, Failed(error))
        self._done(job)

    def _done(self, job: Job) -> None:
        with self._lock:
            self._outstanding -= 1

    def _emit(self, job: Job, event: Event) -> None:
        if job.cancelled:
            return
        try:
            job.loop.call_soon_threadsafe(job.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: the server stopped
            pass

    def _refresh(self) -> None:
        assert self.llm is not None
        engine = self.llm.engine
        self.busy_slots = len(engine.scheduler.running)
        self.kv_tokens = sum(cache.length for cache in engine.pool.caches)

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet in a slot."""
        return max(0, self._outstanding - self.busy_slots)
