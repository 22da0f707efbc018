"""The one-token decode step as CUDA graphs.

Launching a decode step kernel by kernel costs more than the kernels themselves. The step is
captured once and replayed. Where the step must run host code -- experts that the plan keeps in host
RAM -- the capture is split: replay runs graph 0, host op 0, graph 1, ..., so the plan is obeyed in
the captured path exactly as in the eager one (the host ops are the same objects the eager path calls).

When every host op hands over through HostFlags (cuda/host_memory.py), the graph never waits on the host's
side of a launch: at each host op it sets the op's to-host flag and waits on the device for its to-device
flag, and the host runs the op in between (spin on the first flag, compute, set the second). No event round
trip, and the launches leave the critical path. How the step's graphs are launched is TANDEM_STEP_LAUNCH:

- `ahead` (the default): a graph per host op (cut where the graph waits for the op's result), launched two
  ahead by the thread that runs the host ops: after host op i it launches graph i + 2 while the GPU runs graph
  i + 1, time it would otherwise spend spinning on a flag. A launch costs ~1 µs per node (~30 per layer), less
  than the GPU's part of a layer, so the launches hide in it;
- `thread`: one graph (~1,000 nodes, ~2 ms of CPU to launch on an H200 host, 17:20), launched by a helper
  thread while the calling thread runs the host ops. That helper is a 17th runnable thread beside ggml's 16;
- `first`: one graph that the calling thread launches before it runs the host ops, the first of which waits
  out the launch.

The host ops stay on the calling thread because ggml computes through OpenMP, in the libgomp torch loads:
libgomp keeps a team of worker threads per thread that starts parallel regions, and once its threads
outnumber the CPUs it cuts every barrier's spin to ~100 iterations and puts waiting threads to sleep. A second
team (ggml's on a helper thread beside the one torch and the eager host ops made on the caller's) made every
barrier of every expert graph a futex sleep and wake-up: Qwen3-30B-A3B --cpu-moe decoded 25.9 tok/s with the
host ops on the helper thread and 35.7 with them on the caller's (same H200 host, 15:58).
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

STEP_LAUNCH_ENV = "TANDEM_STEP_LAUNCH"  # see the module docstring
STEP_LAUNCH_MODES = ("ahead", "thread", "first")
LAUNCH_AHEAD = 2  # graphs launched before the first host op runs: the one it waits for and the next


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
    """One captured step: graphs whose host steps hand over through HostFlags while they run (TANDEM_STEP_LAUNCH
    says how they are launched), or (without flags) graphs and the host steps between them, replayed in order."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        # Split captures: graph, host step, graph, ..., graph. Flag captures: the graphs only (one, or one more
        # than the host steps when launched ahead), with the host steps in `host_steps`.
        self.steps: list[Callable[[], object]] = []
        self.host_steps: list[Callable[[], object]] = []  # run while the graphs run (flag captures)
        self._to_host: list[HostFlag] = []
        self._to_device: list[HostFlag] = []
        self._current: torch.cuda.CUDAGraph | None = None
        self._split = False
        self._launch_mode = os.environ.get(STEP_LAUNCH_ENV, "ahead")  # read once, not at every token
        if self._launch_mode not in STEP_LAUNCH_MODES:
            raise ValueError(
                f"{STEP_LAUNCH_ENV} must be one of {', '.join(STEP_LAUNCH_MODES)}, not {self._launch_mode!r}"
            )

    @property
    def uses_flags(self) -> bool:
        """Whether the host steps hand over through flags while the graphs run (else: replayed in order)."""
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
        if self.host_steps and self._split:
            raise RuntimeError("a captured step mixes host ops with and without flags")
        torch.cuda.current_stream().wait_stream(stream)
        return out

    def split(self, host_step: Callable[[], object]) -> None:
        """Called by a host op without flags during capture: end the graph so far; replay runs `host_step`
        after it, then the graph captured next."""
        self._split = True
        self._end()
        self.steps.append(host_step)
        self._begin()

    def add_host_step(self, host_step: Callable[[], object], to_host: HostFlag, to_device: HostFlag) -> None:
        """Called by a host op with flags during capture (the graph has set `to_host`, and may have queued work
        that runs while the host computes): replay runs `host_step` while the graph runs; the graph goes on
        once `to_device` is set, which the replay does when `host_step` returns (or fails). Launched ahead, the
        graph ends here and the next one begins by waiting for `to_device`."""
        self.host_steps.append(host_step)
        self._to_host.append(to_host)
        self._to_device.append(to_device)
        if self._launch_mode == "ahead":
            self._end()
            self._begin()
        to_device.enqueue_wait_and_clear(torch.cuda.current_stream())

    @torch.inference_mode()
    def replay(self) -> None:
        if not self.host_steps:
            for step in self.steps:
                step()
            return
        if self._launch_mode == "ahead":
            self._replay_ahead()
            return
        (graph,) = self.steps
        if self._launch_mode == "first":
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

    def _replay_ahead(self) -> None:
        """Graph i + LAUNCH_AHEAD launched right after host step i, which released graph i + 1 (module
        docstring). On any failure every graph launched is released, so that the stream drains."""
        graphs = self.steps
        for graph in graphs[:LAUNCH_AHEAD]:
            graph()
        later = iter(graphs[LAUNCH_AHEAD:])

        def launch_next(i: int) -> None:
            graph = next(later, None)
            if graph is not None:
                graph()

        try:
            self._run_host_steps(launch_next)
        except BaseException:
            for flag in self._to_device:
                flag.set()
            self._forget()
            raise

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

    def _run_host_steps(self, after: Callable[[int], None] | None = None) -> None:
        """The host ops in order, on this thread (inside `replay`'s inference mode); `after(i)` once host op i
        has released the graph."""
        for i, host_step in enumerate(self.host_steps):
            try:
                host_step()
            except BaseException:
                for flag in self._to_device[i:]:  # release the graph from here on so that it ends
                    flag.set()
                raise
            self._to_device[i].set()
            if after is not None:
                after(i)


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
