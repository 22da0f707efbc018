"""The one-token decode step as CUDA graphs.

Launching a decode step kernel by kernel costs more than the kernels themselves. The step is
captured once and replayed. Where the step must run host code -- experts that the plan keeps in host
RAM -- the capture is split: replay runs graph 0, host op 0, graph 1, ..., so the plan is obeyed in
the captured path exactly as in the eager one (the host ops are the same objects the eager path calls).

When every host op hands over through HostFlags (cuda/host_memory.py), the step is ONE graph: at each host
op it sets the op's to-host flag and waits on the device for its to-device flag, and the replay launches
it once and runs the host ops in order while it runs (each spins on its to-host flag, computes, sets its
to-device flag). No launch per layer (~40-55 µs each, 48 per token on Qwen3-30B-A3B with --cpu-moe, measured
on an H200 host with the per-layer segments), no event round trip. Launching the one graph (~1,000 nodes)
takes ~1.2 ms of CPU (H200 host, 13:40), which the first host op would otherwise wait out: a helper thread
(one per process) launches it while the calling thread runs the host ops.

The host ops stay on the calling thread because ggml computes through OpenMP, in the libgomp torch loads:
libgomp keeps a team of worker threads per thread that starts parallel regions, and once its threads
outnumber the CPUs it cuts every barrier's spin to ~100 iterations and puts waiting threads to sleep. A second
team (ggml's on a helper thread beside the one torch and the eager host ops made on the caller's) made every
barrier of every expert graph a futex sleep and wake-up: Qwen3-30B-A3B --cpu-moe decoded 25.9 tok/s with the
host ops on the helper thread and 35.7 with them on the caller's (same H200 host, 15:58). TANDEM_STEP_THREAD=none,
for measuring: the caller launches the graph, then runs the host ops (37.5 tok/s in that call).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from tandem.models.decoder import DecoderModel
from tandem.runtime.kv_cache import KVCache

if TYPE_CHECKING:
    from tandem.cuda.host_memory import HostFlag

STEP_THREAD_ENV = "TANDEM_STEP_THREAD"  # launch (default) or none: see the module docstring
STEP_THREAD_MODES = ("launch", "none")


class _Launcher:
    """A daemon thread that runs one job at a time for the thread that starts it: `start` returns once the job
    has begun, `wait` once it has ended, raising its error if it failed."""

    def __init__(self) -> None:
        self._start = threading.Semaphore(0)
        self._started = threading.Semaphore(0)
        self._done = threading.Semaphore(0)
        self._job: Callable[[], None] | None = None
        self._error: BaseException | None = None
        threading.Thread(target=self._serve, name="tandem-launch", daemon=True).start()

    def _serve(self) -> None:
        while True:
            self._start.acquire()
            assert self._job is not None
            self._started.release()
            try:
                self._job()
            except BaseException as e:  # handed to the waiting thread
                self._error = e
            self._done.release()

    def start(self, job: Callable[[], None]) -> None:
        """Run `job` on the thread; return once it is about to run. A caller that then spins in Python holds the
        GIL, so the job must have got to code that releases it (a graph launch) first, or it would wait out a
        switch interval (5 ms)."""
        self._job, self._error = job, None
        self._start.release()
        self._started.acquire()

    def wait(self) -> None:
        """Until the job ends; raises its error."""
        self._done.acquire()
        error, self._error = self._error, None
        if error is not None:
            raise error


# One launcher per process, made at the first one-graph replay, used by one step at a time.
_LAUNCHER: _Launcher | None = None
_LAUNCHER_LOCK = threading.Lock()


def _launcher() -> _Launcher:
    global _LAUNCHER
    if _LAUNCHER is None:
        _LAUNCHER = _Launcher()
    return _LAUNCHER


class HostBoundary(Protocol):
    """A host op of the step (runtime/offload.py HostCall): while `segments` is set, it calls
    `segments.split` where its host part must run instead of running it."""

    segments: SegmentedGraph | None


class SegmentedGraph:
    """One captured step: one graph with host steps that hand over through HostFlags while it runs, or
    (without flags) graphs and the host steps between them, replayed in order."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.steps: list[Callable[[], object]] = []  # graph, host step, graph, ..., graph (split captures)
        self.host_steps: list[Callable[[], object]] = []  # run while the one graph runs (flag captures)
        self._to_host: list[HostFlag] = []
        self._to_device: list[HostFlag] = []
        self._current: torch.cuda.CUDAGraph | None = None
        self._thread_mode = os.environ.get(STEP_THREAD_ENV, "launch")  # read once, not at every token
        if self._thread_mode not in STEP_THREAD_MODES:
            raise ValueError(
                f"{STEP_THREAD_ENV} must be one of {', '.join(STEP_THREAD_MODES)}, not {self._thread_mode!r}"
            )

    @property
    def one_graph(self) -> bool:
        """Whether the step is one graph with its host steps handing over through flags."""
        return bool(self.host_steps)

    def _begin(self) -> None:
        self._current = torch.cuda.CUDAGraph()
        self._current.capture_begin(pool=self.pool)

    def _end(self) -> None:
        assert self._current is not None
        self._current.capture_end()
        self.steps.append(self._current.replay)
        self._current = None

    def capture(self, fn: Callable[[], torch.Tensor], boundaries: Sequence[HostBoundary]) -> torch.Tensor:
        """Capture `fn` (run eagerly at least once before, so kernels are compiled); returns its output."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        for b in boundaries:
            b.segments = self
        try:
            with torch.cuda.stream(stream):
                self._begin()
                out = fn()
                self._end()
        except BaseException:
            if self._current is not None:  # leave no stream capturing behind an error
                try:
                    self._current.capture_end()
                except Exception:
                    pass
                self._current = None
            raise
        finally:
            for b in boundaries:
                b.segments = None
        if self.host_steps and len(self.steps) > 1:
            raise RuntimeError("a captured step mixes host ops with and without flags")
        torch.cuda.current_stream().wait_stream(stream)
        return out

    def split(self, host_step: Callable[[], object]) -> None:
        """Called by a host op without flags during capture: end the graph so far; replay runs `host_step`
        after it, then the graph captured next."""
        self._end()
        self.steps.append(host_step)
        self._begin()

    def add_host_step(self, host_step: Callable[[], object], to_host: HostFlag, to_device: HostFlag) -> None:
        """Called by a host op with flags during capture (the graph has just set `to_host`): replay runs
        `host_step` while the graph runs; the graph goes on once `to_device` is set, which the replay does
        when `host_step` returns (or fails)."""
        self.host_steps.append(host_step)
        self._to_host.append(to_host)
        self._to_device.append(to_device)
        to_device.enqueue_wait_and_clear(torch.cuda.current_stream())

    @torch.inference_mode()
    def replay(self) -> None:
        if not self.host_steps:
            for step in self.steps:
                step()
            return
        (graph,) = self.steps
        if self._thread_mode == "none":
            graph()
            self._settle(self._run_host_steps)
            return
        stream = torch.cuda.current_stream()
        with _LAUNCHER_LOCK:
            launcher = _launcher()
            launcher.start(lambda: self._launch(graph, stream))
            try:
                self._run_host_steps()  # on this thread: ggml's OpenMP team stays the one torch uses here
            except BaseException:
                try:
                    launcher.wait()
                except BaseException:
                    pass  # the first error is the one raised
                self._forget()
                raise
            self._settle(launcher.wait)

    def _launch(self, graph: Callable[[], None], stream: torch.cuda.Stream) -> None:
        """On the launcher: launch the graph on the caller's stream; if that fails, let the host ops through
        (they compute on what the buffers hold), so that the caller gets to the error."""
        try:
            with torch.cuda.stream(stream):
                graph()
        except BaseException:
            for flag in self._to_host:
                flag.set()
            raise

    def _settle(self, wait: Callable[[], None]) -> None:
        """Wait for the other side; if it failed, forget the step's hand-overs, then raise."""
        try:
            wait()
        except BaseException:
            self._forget()
            raise

    def _forget(self) -> None:
        """After a failure (a host op releases the graph from there on; a failed launch lets the host ops
        through): let the graph end, then clear the hand-overs left set, for the next replay."""
        torch.cuda.current_stream().synchronize()
        for flag in (*self._to_host, *self._to_device):
            flag.clear()

    def _run_host_steps(self) -> None:
        """The host ops in order, on this thread (inside `replay`'s inference mode)."""
        for i, host_step in enumerate(self.host_steps):
            try:
                host_step()
            except BaseException:
                for flag in self._to_device[i:]:  # release the graph from here on so that it ends
                    flag.set()
                raise
            self._to_device[i].set()


class DecodeGraph:
    """The model's one-token step with static input buffers, captured on first use."""

    def __init__(self, model: DecoderModel, cache: KVCache, boundaries: Sequence[HostBoundary]) -> None:
        self.model = model
        self.cache = cache
        self.boundaries = boundaries
        self.x = torch.zeros(1, model.cfg.hidden, dtype=model.dtype, device=model.device)
        self.positions = torch.zeros(1, dtype=torch.long, device=model.device)
        self.graph: SegmentedGraph | None = None
        self.logits: torch.Tensor | None = None

    def __call__(self, token: int) -> torch.Tensor:
        """Logits [V] after `token` at the cache's next position (the caller does the bookkeeping)."""
        # The embedding lookup stays outside the graph: the table may be in host RAM (as llama.cpp keeps it).
        self.x.copy_(self.model.embed_tokens(torch.tensor([token])))
        self.positions.fill_(self.cache.length)
        if self.graph is None:
            graph = SegmentedGraph()
            self.logits = graph.capture(
                lambda: self.model.blocks_and_head(self.x, self.positions, self.cache, start=0), self.boundaries
            )
            self.graph = graph
        self.graph.replay()
        assert self.logits is not None
        return self.logits[-1]
