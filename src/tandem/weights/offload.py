"""Weights kept in host RAM while the rest of the model computes on a GPU.

Decode (and batches under `min_batch` tokens): the inputs of a host op -- the routed hidden states,
expert ids and mixing weights -- go to page-locked host buffers, ggml computes the experts on the
mmap'd blocks, the result comes back (`HostCall`). Work the caller queues on the GPU between
`start` and the result (the shared expert, Gemma 4's dense branch) runs while the CPU computes.

Prefill (a batch of `min_batch` tokens or more): the experts the batch routes to are streamed to the
GPU through a bounded two-slot window, chunk by chunk, and computed there (`ExpertStream`), since PCIe
moves an expert faster than the CPU can compute it for many tokens.

Decode with `--pcie-experts K` (opt-in): the GPU computes K of each token's selected experts by reading their
blocks in host RAM over PCIe (device views of the page-locked file, no copy, no VRAM) while ggml computes the
others. The two readers together read host memory faster than ggml alone, so a layer's experts take less time
split (`bench/split_experts.py` measures it; docs/FLAGS.md). The weights stay where the plan put them. One token
splits by slot (its last K experts go to the GPU); a batch of several splits by expert (`ExpertStaging`): the
sequences of a batched decode share experts, so the host op copies the step's most-used ones into the prefill
window for the GPU while ggml computes the others.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

import numpy as np
import torch

from tandem.layers.linear import Experts, GGMLLinear
from tandem.layers.moe import Pending, RoutedExperts, Routing, split_routing, split_streamed

if TYPE_CHECKING:
    from tandem.cuda.graphs import SegmentedGraph
    from tandem.cuda.host_memory import HostCopies, HostFlag
    from tandem.cuda.qlinear import GPUQuantWeight

HOST_CALL_ROWS = 32  # rows of a host op's page-locked buffers (decode and small batches)
# From this many rows a --pcie-experts batch splits its experts by expert rather than by slot (ExpertStaging).
PCIE_BY_EXPERT_ROWS = 4
SLOT_BUCKET = 8  # ggml's part of a staged batch runs one prepared graph per this many of its slots


# Set to 0 to capture the decode step in segments replayed in order, without HostFlags (for measuring).
HOST_FLAGS_ENV = "TANDEM_HOST_FLAGS"
HOST_WAIT_S = 60.0  # a replayed host op waiting longer than this for the GPU raises instead of hanging


def _new_flags(device: torch.device) -> tuple[HostFlag, HostFlag] | None:
    from tandem.cuda.host_memory import HostFlag, host_flags_work

    if os.environ.get(HOST_FLAGS_ENV, "1") == "0":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return (HostFlag(), HostFlag()) if host_flags_work(index) else None


class ExpertSource(Protocol):
    """Where a layer's expert tensors are read from when building its RoutedExperts."""

    def experts(self, name: str) -> Experts: ...

    def vector(self, name: str) -> torch.Tensor: ...


class HostCall:
    """A host function called from a GPU model: inputs to page-locked buffers, the function, the result back.

    A boundary of the captured decode step (cuda/graphs.py). Where the driver allows, the step stays ONE
    graph: it sets this op's to-host HostFlag once the inputs are in host memory and waits on the device for
    its to-device flag before copying the result back; the replay runs the host part in between (spin on the
    first flag, compute, set the second). Elsewhere the graph captured so far ends where the host part must
    run, and the replay runs graphs and host parts in order, the host part waiting for an event recorded in
    the graph before it. Eager calls run the same code with the same buffers.
    """

    def __init__(
        self,
        fn: Callable[[list[torch.Tensor]], torch.Tensor],
        bind: Callable[[list[torch.Tensor], torch.Tensor], Callable[[], None] | None] | None = None,
        rows: int = HOST_CALL_ROWS,
    ) -> None:
        self.fn = fn  # CPU tensors [rows, ...] -> float32 CPU tensor of the output's size
        # Optional: fn prepared on the fixed buffers (inputs, output), which then runs with no per-call work.
        self.bind = bind
        self.rows = rows
        self.segments: SegmentedGraph | None = None
        self._buffers: list[torch.Tensor] = []  # page-locked, kept for the life of the op (graphs copy into them)
        self._bound: dict[int, Callable[[], None] | None] = {}  # per row count
        self._flags: tuple[HostFlag, HostFlag] | None = None  # (to host, to device), made at the first eager call

    def __call__(
        self, inputs: Sequence[torch.Tensor], out_shape: Sequence[int], out_dtype: torch.dtype
    ) -> torch.Tensor:
        """fn(inputs) on the host, as a tensor of `out_shape` and `out_dtype` on the inputs' GPU."""
        return self._start(inputs, out_shape, out_dtype, overlap=False)()

    def start(self, inputs: Sequence[torch.Tensor], out_shape: Sequence[int], out_dtype: torch.dtype) -> Pending:
        """Send the inputs; the returned function waits for the host part and gives the result. GPU work
        queued before calling it runs while the CPU computes."""
        return self._start(inputs, out_shape, out_dtype, overlap=True)

    def _start(self, inputs: Sequence[torch.Tensor], shape: Sequence[int], out_dtype: torch.dtype,
               overlap: bool) -> Pending:  # fmt: skip
        rows = inputs[0].shape[0]
        device = inputs[0].device
        out_shape = torch.Size(shape)
        if rows > self.rows:  # a big eager batch (a type without GPU kernels in prefill): plain copies
            assert self.segments is None, "a captured step has fixed, small shapes"
            out = self.fn([x.cpu() for x in inputs]).to(device).view(out_shape).to(out_dtype)
            return lambda: out
        host_in = [self._buffer(i, x[0].numel(), x.dtype)[:rows].view(x.shape) for i, x in enumerate(inputs)]
        for h, x in zip(host_in, inputs, strict=True):
            h.copy_(x, non_blocking=True)
        out_host = self._buffer(len(inputs), out_shape.numel() // rows, torch.float32)[:rows]
        if rows not in self._bound:  # the buffers' addresses never change: prepare once per row count
            self._bound[rows] = self.bind(host_in, out_host) if self.bind is not None else None
        bound = self._bound[rows]
        if self.segments is None and self._flags is None:
            self._flags = _new_flags(device)
        segments = self.segments
        flags = self._flags if segments is not None else None  # None: eager, or a capture split in segments
        # Split captures: an event recorded in the graph (external: the host waits for it after a replay).
        ready = torch.cuda.Event(external=segments is not None) if flags is None else None

        def inputs_ready() -> None:
            if flags is not None:
                flags[0].enqueue_set(torch.cuda.current_stream())
            else:
                assert ready is not None
                ready.record()

        def run() -> None:
            if flags is not None:
                flags[0].wait_and_clear(HOST_WAIT_S)
            else:
                assert ready is not None
                ready.synchronize()
            if bound is not None:
                bound()
            else:
                out_host.copy_(self.fn(host_in).reshape(out_host.shape))

        def finish() -> torch.Tensor:
            if not overlap:
                inputs_ready()
            if segments is None:
                run()
            elif flags is not None:
                segments.add_host_step(run, *flags)
            else:
                segments.split(run)
            return out_host.to(device, non_blocking=True).view(out_shape).to(out_dtype)

        if overlap:
            inputs_ready()
        return finish

    def _buffer(self, i: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """Page-locked buffer i, [self.rows, width]; made at the first (eager) call, so that a capture only
        records copies to and from memory that lives as long as this object."""
        from tandem.cuda.host_memory import pinned_empty

        if i == len(self._buffers):
            if self.segments is not None:
                raise RuntimeError("host buffers must exist before capture: run one eager step first")
            self._buffers.append(pinned_empty((self.rows, width), dtype))
        buf = self._buffers[i]
        if buf.shape[1] != width or buf.dtype != dtype:
            raise RuntimeError(f"host op buffer {i} changed from {buf.shape[1]} x {buf.dtype} to {width} x {dtype}")
        return buf


@dataclass(eq=False)
class HostLinear:
    """A CPU (ggml) linear used from a GPU model (`-ot` put a matrix on the CPU)."""

    inner: GGMLLinear
    host: HostCall = field(init=False)
    on_host: ClassVar[bool] = True  # a boundary of the captured step: never on a side stream (cuda/streams.py)

    def __post_init__(self) -> None:
        self.host = HostCall(lambda xs: self.inner(xs[0]))

    @property
    def out_features(self) -> int:
        return self.inner.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).float()
        return self.host([flat], (*x.shape[:-1], self.out_features), x.dtype)


@dataclass(eq=False)
class HostExperts:
    """CPU experts used one projection at a time from a GPU model (when not built through OffloadedExperts)."""

    inner: Experts
    host: HostCall = field(init=False)

    def __post_init__(self) -> None:
        self.host = HostCall(lambda xs: self.inner(xs[0], xs[1]))

    @property
    def out_features(self) -> int:
        return self.inner.out_features

    def __call__(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.host([x.float(), ids.to(torch.int32)], (*ids.shape, self.out_features), x.dtype)


class ExpertStream:
    """Streams expert blocks from host RAM to the GPU through a bounded window.

    The window has two slots of `slot_bytes` (the chunk of whole experts copied at a time) and a region
    for a layer's expert vectors (biases, scales). The copy of chunk i + 1 runs on a copy stream while the
    compute stream works on chunk i; a slot is overwritten only after the kernels that read it are done.
    Only chunks holding experts the batch routes to are copied. `source_pin` is the registration that keeps
    the source (the file mapping) page-locked; this object holds it for as long as it streams. Without one,
    each chunk first goes through one of two page-locked host buffers (a CPU copy), which still overlaps the
    GPU's work on the previous chunk.
    """

    def __init__(
        self, slot_bytes: int, vector_bytes: int, device: torch.device, source_pin: object | None = None
    ) -> None:
        self.slot_bytes = slot_bytes
        self.window = torch.empty(2 * slot_bytes + vector_bytes, dtype=torch.uint8, device=device)
        self.copy_stream = torch.cuda.Stream(device)
        self._free = [torch.cuda.Event(), torch.cuda.Event()]  # slot may be overwritten
        self._copied = [torch.cuda.Event(), torch.cuda.Event()]  # slot holds its chunk
        self.source_pin = source_pin
        self._bounce: list[torch.Tensor] | None = None
        if source_pin is None:
            from tandem.cuda.host_memory import pinned_empty

            self._bounce = [pinned_empty((slot_bytes,), torch.uint8) for _ in range(2)]
        self._next = 0

    def vectors(self, n_bytes: int) -> torch.Tensor:
        """The window's vector region (after the two slots)."""
        return self.window[2 * self.slot_bytes : 2 * self.slot_bytes + n_bytes]

    def chunks(self, w: GPUQuantWeight, tiles_per_expert: Sequence[int]) -> Iterator[tuple[int, int, GPUQuantWeight]]:
        """(first expert, end expert, blocks of those experts on the GPU) for each chunk with routed experts;
        w.data is in host RAM. Valid until the generator is advanced."""
        from tandem.cuda.qlinear import GPUQuantWeight

        n_experts, expert_bytes = w.shape[0], w.expert_bytes
        per_chunk = max(1, self.slot_bytes // expert_bytes)
        if per_chunk * expert_bytes > self.slot_bytes:
            raise ValueError(f"one expert ({expert_bytes} bytes) does not fit a staging slot of {self.slot_bytes}")
        ranges = []
        for e0 in range(0, n_experts, per_chunk):
            used = [e for e in range(e0, min(e0 + per_chunk, n_experts)) if tiles_per_expert[e]]
            if used:
                ranges.append((used[0], used[-1] + 1))
        compute = torch.cuda.current_stream()

        def copy(e0: int, e1: int) -> tuple[int, torch.Tensor]:
            slot = self._next
            self._next ^= 1
            dst = self.window[slot * self.slot_bytes : slot * self.slot_bytes + (e1 - e0) * expert_bytes]
            src = w.data[e0 * expert_bytes : e1 * expert_bytes]
            if self._bounce is not None:
                self._copied[slot].synchronize()  # the bounce buffer's previous copy to the GPU is done
                src = self._bounce[slot][: src.numel()].copy_(src)
            self.copy_stream.wait_event(self._free[slot])
            with torch.cuda.stream(self.copy_stream):
                dst.copy_(src, non_blocking=True)
                self._copied[slot].record()
            return slot, dst

        pending = copy(*ranges[0]) if ranges else None
        for i, (e0, e1) in enumerate(ranges):
            assert pending is not None
            slot, dst = pending
            if i + 1 < len(ranges):
                pending = copy(*ranges[i + 1])
            compute.wait_event(self._copied[slot])
            yield e0, e1, GPUQuantWeight(dst, w.qtype, (e1 - e0, *w.shape[1:]))
            self._free[slot].record(compute)


@dataclass(eq=False)
class OffloadedExperts:
    """Routed experts whose weights stay in host RAM, used by a model that computes on a GPU.

    Small batches run on the CPU through a HostCall (a boundary of the captured decode step); batches of
    `min_batch` tokens or more run `streamed`: the same experts built over blocks the GPU kernels read
    through an ExpertStream, after `stage_vectors` copied the layer's expert vectors into the window.

    With `pcie` (--pcie-experts K), the last K of each token's selected experts in a small batch are computed by
    `pcie` instead: the same experts built over device views of their page-locked host blocks, which the GPU
    kernels read over PCIe while the CPU computes the others. Both sides read host memory at once, and
    together they read it faster than the CPU alone (see the module's docstring).

    With `resident` (the plan's expert cache: --moe-cache, --gpu-memory), some experts of the layer are also in
    VRAM: `resident` is built over those experts alone, `slot_map` [E] int32 gives each expert's slot there (-1:
    not cached). Each step's routing is split (layers/moe.py `split_routing`, one kernel, no host sync): the
    cached experts compute on the GPU while ggml computes the others (and, with `pcie`, the GPU reads K/A of
    each token's others over PCIe); in prefill the cached ones compute from VRAM and only the others stream.
    """

    on_cpu: RoutedExperts  # built over ggml experts and CPU vectors
    streamed: RoutedExperts | None  # built over streamed blocks (None: no GPU kernel for a type)
    stage_vectors: Callable[[], None] | None
    min_batch: int  # batches this large stream the experts to the GPU (llama.cpp: 32)
    pcie: RoutedExperts | None = None  # built over device views of the host blocks (--pcie-experts)
    pcie_slots: int = 0  # of each token's selected experts, how many `pcie` computes (the last ones)
    resident: RoutedExperts | None = None  # built over the experts cached in VRAM, by slot
    slot_map: torch.Tensor | None = None  # [E] int32 on the GPU: each expert's slot in `resident`, or -1
    staged: RoutedExperts | None = None  # --pcie-experts in a batch: built over `staging`'s slots in the window
    staging: ExpertStaging | None = None
    host: HostCall = field(init=False)
    host_staged: HostCall | None = field(init=False)  # the CPU's part of a batch whose other experts are staged

    def __post_init__(self) -> None:
        def host_op() -> HostCall:
            return HostCall(
                lambda xs: self.on_cpu(xs[0], Routing(ids=xs[1], weights=xs[2])),
                bind=self._bind if hasattr(self.on_cpu, "bind") else None,
            )

        self.host_staged = None
        if self.resident is not None:  # the CPU's part of a split: packed slots, a count per row
            assert self.slot_map is not None
            self.host = HostCall(self._packed_cpu, bind=self._bind_packed if hasattr(self.on_cpu, "bind") else None)
            return
        self.host = host_op()
        if self.pcie is not None and self.pcie_slots > 0 and self.staging is not None and self.staged is not None:
            bind = self._bind_staged if hasattr(self.on_cpu, "bind") else None
            self.host_staged = HostCall(self._staged_cpu, bind=bind)

    def _bind(self, xs: list[torch.Tensor], out: torch.Tensor) -> Callable[[], None] | None:
        return self.on_cpu.bind(xs[0], Routing(ids=xs[1], weights=xs[2]), out)  # type: ignore[attr-defined]

    def _packed_cpu(self, xs: list[torch.Tensor]) -> torch.Tensor:
        """ggml's part of a split (x, ids and weights packed to the front of each row, the count per row): the
        first `width` columns, `width` the most a row of the step gives ggml; zeros when no row gives any."""
        x, ids, weights, counts = xs
        width = int(counts.max()) if counts.numel() else 0
        if width == 0:
            return torch.zeros(x.shape, dtype=torch.float32)
        return self.on_cpu(x, Routing(ids=ids[:, :width].contiguous(), weights=weights[:, :width].contiguous()))

    def _bind_packed(self, xs: list[torch.Tensor], out: torch.Tensor) -> Callable[[], None] | None:
        """`_packed_cpu` on fixed buffers: one ggml graph prepared per width, fed the first `width` columns (a
        few numpy copies); a step that gives ggml nothing leaves it idle."""
        x, ids, weights, counts = xs
        rows, a = ids.shape
        narrow = [(torch.empty(rows, w, dtype=ids.dtype), torch.empty(rows, w, dtype=weights.dtype)) for w in range(a)]
        bind = self.on_cpu.bind  # type: ignore[attr-defined]
        bound = [bind(x, Routing(ids=i, weights=w), out) for i, w in narrow[1:]]
        bound.append(bind(x, Routing(ids=ids, weights=weights), out))
        if any(b is None for b in bound):
            return None
        counts_np, ids_np, w_np, out_np = counts.numpy(), ids.numpy(), weights.numpy(), out.numpy()
        narrow_np = [(i.numpy(), w.numpy()) for i, w in narrow]

        def run() -> None:
            width = int(counts_np.max())
            if width == 0:
                out_np.fill(0.0)
                return
            if width < a:
                i, w = narrow_np[width]
                i[...] = ids_np[:, :width]
                w[...] = w_np[:, :width]
            bound[width - 1]()

        return run

    def _staged_cpu(self, xs: list[torch.Tensor]) -> torch.Tensor:
        """ggml's part of a batch whose most-used experts the GPU computes from the window (`_bind_staged`,
        prepared anew for these buffers)."""
        def eager(x: torch.Tensor, routing: Routing, y: torch.Tensor) -> Callable[[], None]:
            def run() -> None:
                y.copy_(self.on_cpu(x, routing))

            return run

        out = torch.empty(xs[0].shape, dtype=torch.float32)  # the experts map the hidden size to itself
        run = self._staged_run(xs, out, eager)
        assert run is not None
        run()
        return out

    def _bind_staged(self, xs: list[torch.Tensor], out: torch.Tensor) -> Callable[[], None] | None:
        """The host part of a staged batch on fixed buffers, ggml's graphs prepared per bucket of slots."""
        bind = self.on_cpu.bind  # type: ignore[attr-defined]
        return self._staged_run(xs, out, bind)

    def _staged_run(
        self, xs: list[torch.Tensor], out: torch.Tensor,
        bind: Callable[[torch.Tensor, Routing, torch.Tensor], Callable[[], None] | None],
    ) -> Callable[[], None] | None:  # fmt: skip
        """The host part of a staged batch: stage the step's most-used experts (the copies run meanwhile), then
        ggml computes every other slot as a token of its own ([S, 1] routing over the slots' rows of x, S
        rounded up to SLOT_BUCKET with weight-0 padding), summed back into each token's row of `out`; the copies
        are awaited last. Computing only its own slots is the point: ggml's time grows with the slots as well
        as with the experts' bytes. `bind(x, routing, out)` prepares ggml's graph over those buffers."""
        assert self.staging is not None
        x, ids, weights = xs
        rows, a = ids.shape
        cap = -(-rows * a // SLOT_BUCKET) * SLOT_BUCKET
        x_s = torch.zeros(cap, x.shape[1], dtype=torch.float32)
        ids_s = torch.zeros(cap, 1, dtype=torch.int32)
        w_s = torch.zeros(cap, 1, dtype=torch.float32)
        out_s = torch.zeros(cap, out.shape[1], dtype=torch.float32)
        runs = {}
        for s in range(SLOT_BUCKET, cap + 1, SLOT_BUCKET):
            runs[s] = bind(x_s[:s], Routing(ids=ids_s[:s], weights=w_s[:s]), out_s[:s])
            if runs[s] is None:
                return None
        staging, ids_np, w_np, ids_s_np, w_s_np = self.staging, ids.numpy(), weights.numpy(), ids_s.numpy(), w_s.numpy()

        def run() -> None:
            mine = ~staging.select(ids_np)  # [rows, A]: the slots ggml computes
            flat = np.flatnonzero(mine)
            n = len(flat)
            out.zero_()
            if n:
                s = -(-n // SLOT_BUCKET) * SLOT_BUCKET
                tokens = torch.from_numpy(flat // a)
                torch.index_select(x, 0, tokens, out=x_s[:n])
                ids_s_np[:n, 0] = ids_np.reshape(-1)[flat]
                w_s_np[:n, 0] = w_np.reshape(-1)[flat]
                ids_s_np[n:s, 0] = ids_s_np[0, 0]  # padding: an expert read anyway, weight 0
                w_s_np[n:s, 0] = 0.0
                runs[s]()  # type: ignore[misc]
                out.index_add_(0, tokens, out_s[:n])
            staging.wait()

        return run

    def __call__(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        return self.start(x, routing)()

    @property
    def hosts(self) -> list[HostCall]:
        """The host ops (boundaries of a captured step): one, and with --pcie-experts the batches' own."""
        return [self.host] if self.host_staged is None else [self.host, self.host_staged]

    def start(self, x: torch.Tensor, routing: Routing) -> Pending:
        """Begin the experts; the CPU computes them while the caller queues GPU work, until the result is asked."""
        if self.resident is not None:
            return self._start_split(x, routing)
        if self._streams(x):
            out = self._stream(x, routing)
            return lambda: out
        if self.pcie is None or self.pcie_slots == 0:
            return self.host.start(self._host_inputs(x, routing), x.shape, x.dtype)
        if x.shape[0] >= PCIE_BY_EXPERT_ROWS:  # a batch: whole experts staged, or (no room) all on the CPU
            if self.host_staged is not None:
                return self._start_staged(x, routing)
            return self.host.start(self._host_inputs(x, routing), x.shape, x.dtype)
        on_cpu = routing.ids.shape[1] - self.pcie_slots
        cpu = Routing(ids=routing.ids[:, :on_cpu], weights=routing.weights[:, :on_cpu])
        gpu = Routing(ids=routing.ids[:, on_cpu:], weights=routing.weights[:, on_cpu:])
        pending = self.host.start(self._host_inputs(x, cpu), x.shape, x.dtype)
        over_pcie = self.pcie(x, gpu)  # queued after the host op's inputs: runs while the CPU computes
        return lambda: pending() + over_pcie

    def _start_staged(self, x: torch.Tensor, routing: Routing) -> Pending:
        """A batch with --pcie-experts: the host op stages its most-used experts in the window while ggml computes
        the rest; once it returns, the GPU computes the staged ones there (their slots from `staging.slot_map`,
        which the host op wrote) and the two parts add up."""
        assert self.host_staged is not None and self.staging is not None and self.staged is not None
        pending = self.host_staged.start(self._host_inputs(x, routing), x.shape, x.dtype)
        slot_map, staged = self.staging.slot_map, self.staged

        def finish() -> torch.Tensor:
            out = pending()  # queued after the host op: the window and the slot map hold this step's experts
            ids = slot_map[routing.ids.long()]
            weights = torch.where(ids >= 0, routing.weights, 0.0)
            return out + staged(x, Routing(ids=ids, weights=weights))

        return finish

    def _start_split(self, x: torch.Tensor, routing: Routing) -> Pending:
        """The layer's cached experts on the GPU, the others on the CPU (and over PCIe), at the same time."""
        assert self.resident is not None and self.slot_map is not None
        if self._streams(x):  # prefill: the cached experts from VRAM, only the others streamed
            cached, rest = split_streamed(routing, self.slot_map)
            out = self.resident(x, cached) + self._stream(x, rest)
            return lambda: out
        split = split_routing(routing, self.slot_map, self.pcie_slots if self.pcie is not None else 0)
        pending = self.host.start([*self._host_inputs(x, split.cpu), split.cpu_counts], x.shape, x.dtype)
        on_gpu = self.resident(x, split.resident)  # queued after the host op's inputs: runs while the CPU computes
        if self.pcie is not None and split.pcie is not None:
            on_gpu = on_gpu + self.pcie(x, split.pcie)
        return lambda: pending() + on_gpu

    def _streams(self, x: torch.Tensor) -> bool:
        return self.streamed is not None and x.shape[0] >= self.min_batch

    def _stream(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        assert self.streamed is not None
        if self.stage_vectors is not None:
            self.stage_vectors()
        return self.streamed(x, routing)

    @staticmethod
    def _host_inputs(x: torch.Tensor, routing: Routing) -> list[torch.Tensor]:
        return [x.float(), routing.ids.to(torch.int32), routing.weights.float()]


@dataclass(frozen=True)
class StagedMatrix:
    """One expert tensor of a layer (a stacked matrix, or a vector of one row per expert) as `ExpertStaging`
    copies it: its bytes in host RAM (page-locked) and its region of the window, room for `capacity` experts
    (vectors: one more row, kept zero, which the slots of unstaged experts (-1) read)."""

    host: torch.Tensor  # uint8, [E * expert_bytes], in the registered file mapping
    window: torch.Tensor  # uint8 on the GPU, [capacity * expert_bytes] (vectors: [(capacity + 1) * expert_bytes])
    expert_bytes: int
    vector: bool = False


class ExpertStaging:
    """--pcie-experts in a batched decode step: the GPU computes the step's most-used CPU experts from copies
    of their bytes in the prefill window, made by the host op while ggml computes the others.

    A batch's tokens share experts, so the GPU takes whole experts. Read in place over PCIe by a GEMM's tiles
    they took twice as long as ggml computing them all (a 16-row Qwen3-30B-A3B step, H200: 540 against 271 ms):
    each tile's loads wait for the bus in turn. DMA copies of whole experts run at PCIe speed. The host op knows
    the step's routing: it takes K/A of the routed experts (most slots first) up to what the window holds,
    copies their bytes (runs of consecutive ids in one copy each), a zero row after each vector's slots and the
    layer's slot map [E] (-1: not staged, in the window too: no VRAM of its own) on the copy stream, has ggml
    compute the other slots, and waits for the copies before it returns. Decode steps and prefill steps never
    overlap (a step's tokens are read on the host before the next), and a layer's host op runs after the
    previous layer's kernels, so the window is free when it is written.
    """

    def __init__(self, matrices: list[StagedMatrix], capacity: int, slot_map: torch.Tensor, pcie_slots: int,
                 copies: HostCopies) -> None:  # fmt: skip
        from tandem.cuda.host_memory import pinned_empty

        self.matrices, self.capacity, self.pcie_slots = matrices, capacity, pcie_slots
        self.copies = copies  # on the window's copy stream
        self.slot_map = slot_map  # [E] int32, a view of the window
        self._slot_map_host = pinned_empty(tuple(slot_map.shape), torch.int32)
        zero_bytes = max((m.expert_bytes for m in matrices if m.vector), default=0)
        self._zeros = pinned_empty((max(zero_bytes, 1),), torch.uint8).zero_()
        self.staged_total = 0  # experts staged so far (tests, profiles)

    def choose(self, ids: np.ndarray) -> np.ndarray:
        """The experts to stage for a step routed to `ids` [T, A], sorted by id."""
        counts = np.bincount(ids.ravel(), minlength=self._slot_map_host.numel())
        routed = np.flatnonzero(counts)
        share = self.pcie_slots / ids.shape[1]
        n = min(self.capacity, len(routed) - 1, int(len(routed) * share + 0.5))
        if n <= 0:
            return routed[:0]
        return np.sort(routed[np.argsort(-counts[routed], kind="stable")[:n]])

    def select(self, ids: np.ndarray) -> np.ndarray:
        """Stage the chosen experts for `ids` [T, A] (the copies enqueued, not awaited: `wait`); returns which
        slots the GPU computes [T, A] bool."""
        chosen = self.choose(ids)
        slots = self._slot_map_host.numpy()
        slots.fill(-1)
        slots[chosen] = np.arange(len(chosen), dtype=np.int32)
        copies = self.copies
        if len(chosen):
            breaks = np.flatnonzero(np.diff(chosen) != 1) + 1
            starts, ends = np.concatenate(([0], breaks)), np.concatenate((breaks, [len(chosen)]))
            for m in self.matrices:
                eb, dst, src = m.expert_bytes, m.window.data_ptr(), m.host.data_ptr()
                for s0, s1 in zip(starts.tolist(), ends.tolist(), strict=True):
                    copies.enqueue(dst + s0 * eb, src + int(chosen[s0]) * eb, (s1 - s0) * eb)
                if m.vector:  # the row the unstaged slots (-1) read: zero, as the window may hold anything
                    copies.enqueue(dst + self.capacity * eb, self._zeros.data_ptr(), eb)
        copies.enqueue(self.slot_map.data_ptr(), self._slot_map_host.data_ptr(), slots.nbytes)
        self.staged_total += len(chosen)
        return slots[ids] >= 0

    def wait(self) -> None:
        self.copies.wait()
