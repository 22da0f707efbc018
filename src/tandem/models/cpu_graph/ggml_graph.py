"""ggml graphs built from Python and run on a `CPUKernels` backend: the plumbing under the CPU step graph.

A `GraphBuilder` owns one ggml context (tensor headers only: no_alloc) in which a step is described. Every tensor
whose memory exists already is a leaf pointed at it when it is made: weights in the file mapping (or their repacked
copies), norm vectors, the KV cache, and the step's inputs and outputs, whose buffers the program owns and fills per
call. Everything else is an intermediate node that a graph allocator (`ggml_gallocr`) places.

A program is one graph, or a few (`Segment`s) with host work between them (`HostStage`, e.g. a product ggml cannot
compute as llama.cpp does): the tensors that cross from one segment to the next live in buffers of the program's
own. The segments of every program share one allocator per `GraphRunner`, so the memory of a step's intermediates
is that of its largest segment; a segment is placed again whenever another one ran on the allocator since.

Shapes here are ggml's (ne0 first: ne0 is the contiguous dimension).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import ggml
import numpy as np
import torch

from tandem.quant.ggml_cpu import CPUKernels
from tandem.quant.ggml_weights import GGMLWeight, new_tensor, point_weight

__all__ = ["GraphBuilder", "GraphProgram", "GraphRunner", "HostStage", "Segment", "Tensor"]

Tensor = ggml.ggml_tensor_p  # a pointer to a tensor header in the builder's context

_NP_TYPES = {np.dtype(np.float32): ggml.GGML_TYPE_F32, np.dtype(np.int32): ggml.GGML_TYPE_I32,
             np.dtype(np.int64): ggml.GGML_TYPE_I64, np.dtype(np.float16): ggml.GGML_TYPE_F16}  # fmt: skip
_TORCH_TYPES = {torch.float32: ggml.GGML_TYPE_F32, torch.float16: ggml.GGML_TYPE_F16,
                torch.bfloat16: ggml.GGML_TYPE_BF16, torch.int32: ggml.GGML_TYPE_I32}  # fmt: skip


@dataclass(eq=False)
class Segment:
    """One ggml graph of a program, and the nodes the allocator places (set to NULL before it places them again)."""

    graph: ggml.ggml_cgraph_p
    owned: list[ggml.ggml_tensor] = field(default_factory=list)
    address: int = field(init=False)  # the graph's address, for the raw compute call

    def __post_init__(self) -> None:
        self.address = ctypes.cast(self.graph, ctypes.c_void_p).value or 0


@dataclass(eq=False)
class HostStage:
    """Work done on the host between two segments (it reads and writes the program's buffers)."""

    run: Callable[[], None]


@dataclass(eq=False)
class GraphProgram:
    """A step's graphs and host stages, in order, with the context and buffers they point into."""

    ctx: int
    stages: list[Segment | HostStage]
    keep: list[object]  # every buffer and weight a leaf points at: alive as long as the program

    def __del__(self) -> None:
        try:  # interpreter shutdown may have torn ggml down already
            ggml.ggml_free(self.ctx)
        except Exception:
            pass


class GraphRunner:
    """Runs programs on a CPUKernels' backend (its threads), their intermediates placed by one allocator."""

    def __init__(self, kernels: CPUKernels) -> None:
        self.kernels = kernels
        self._allocator = kernels.new_graph_allocator()
        self._placed: Segment | None = None  # the segment whose nodes the allocator's buffer holds now

    def run(self, program: GraphProgram) -> None:
        for stage in program.stages:
            if isinstance(stage, HostStage):
                stage.run()
                continue
            if self._placed is not stage:
                for tensor in stage.owned:
                    tensor.data = None
                    tensor.buffer = None
                if not ggml.ggml_gallocr_alloc_graph(self._allocator, stage.graph):
                    self._placed = None
                    raise MemoryError("ggml_gallocr_alloc_graph failed")
                self._placed = stage
            self.kernels.compute_graph(stage.address)

    def close(self) -> None:
        if self._allocator is not None:
            ggml.ggml_gallocr_free(self._allocator)
            self._allocator = None
            self._placed = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class GraphBuilder:
    """Describes a program: leaves on existing memory, nodes by ggml's ops (through `ops`, the ggml module, called
    with `ctx`), segments cut where host work must run. `finish` returns the program."""

    def __init__(self, n_tensors: int, n_segments: int = 1) -> None:
        # A segment's graph holds at most every tensor of the context, as nodes or as leafs: sized by the program
        # (a fixed size was outgrown by a 48-layer model's prompt of 1024 rows, and ggml aborts the process then)
        self._graph_size = n_tensors
        mem = ggml.ggml_tensor_overhead() * n_tensors
        mem += (n_segments + 1) * ggml.ggml_graph_overhead_custom(n_tensors, False) + (1 << 16)
        self.ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=mem, mem_buffer=None, no_alloc=True))
        if not self.ctx:
            raise MemoryError("ggml_init failed")
        self._stages: list[Segment | HostStage] = []
        self._keep: list[object] = []
        self._weights: dict[int, Tensor] = {}
        self._scratch: list[ggml.ggml_tensor] = []  # the current segment's tensors of no op that the allocator places
        self._graph = self._new_graph()

    # -- leaves ---------------------------------------------------------------------------------------
    def leaf(self, gtype: int, ne: Sequence[int], ptr: int, keep: object = None) -> Tensor:
        """A tensor on memory at `ptr` (kept alive through `keep`), contiguous, of ggml shape `ne`."""
        tensor = _new(self.ctx, gtype, ne)
        tensor.contents.data = ptr
        ggml.ggml_set_input(tensor)
        if keep is not None:
            self._keep.append(keep)
        return tensor

    def array(self, array: np.ndarray) -> Tensor:
        """A leaf on a C-contiguous numpy array (ggml shape: the array's, reversed)."""
        assert array.flags.c_contiguous
        return self.leaf(_NP_TYPES[array.dtype], array.shape[::-1], array.ctypes.data, array)

    def torch_leaf(self, t: torch.Tensor) -> Tensor:
        """A leaf on a contiguous CPU torch tensor (ggml shape: the tensor's, reversed)."""
        assert t.is_contiguous() and t.device.type == "cpu"
        return self.leaf(_TORCH_TYPES[t.dtype], tuple(t.shape)[::-1], t.data_ptr(), t)

    def vector(self, t: torch.Tensor) -> Tensor:
        """A float32 vector or matrix (norm weights, scales) as a leaf, made float32-contiguous if it is not."""
        t = t.detach().to(device="cpu", dtype=torch.float32).contiguous()
        return self.torch_leaf(t)

    def weight(self, w: GGMLWeight) -> Tensor:
        """A GGUF weight where it lies (or its repacked copy, whose buffer picks ggml's repacked kernels): one leaf
        per weight, shared by every node that reads it."""
        tensor = self._weights.get(id(w))
        if tensor is None:
            tensor = new_tensor(self.ctx, int(w.qtype), w.shape[::-1])
            point_weight(tensor.contents, w)
            ggml.ggml_set_input(tensor)
            self._weights[id(w)] = tensor
            self._keep.append(w)
        return tensor

    def scratch(self, gtype: int, ne: Sequence[int]) -> Tensor:
        """A tensor of the current segment that nodes write into (through views) and read: placed by the allocator
        like a node's result."""
        tensor = _new(self.ctx, gtype, ne)
        self._scratch.append(tensor.contents)
        return tensor

    # -- nodes and segments ---------------------------------------------------------------------------
    def expand(self, tensor: Tensor) -> None:
        """Add `tensor` and what it depends on to the current segment now (stores into the cache must come before
        the nodes that read the cache, which do not depend on them)."""
        ggml.ggml_build_forward_expand(self._graph, tensor)

    def output(self, tensor: Tensor, t: torch.Tensor) -> None:
        """Make node `tensor` compute into the contiguous float32 CPU tensor t (its shape, reversed)."""
        assert t.is_contiguous() and t.dtype is torch.float32 and _strip(tuple(t.shape)[::-1]) == _ne(tensor)
        tensor.contents.data = t.data_ptr()
        ggml.ggml_set_output(tensor)
        self._keep.append(t)
        self.expand(tensor)

    def cut(self, host: Callable[[], None]) -> None:
        """End the current segment (its outputs in buffers of the program's: `output`), run `host` after it, and
        start the next segment (whose leaves read those buffers)."""
        self._end_segment()
        self._stages.append(HostStage(host))
        self._graph = self._new_graph()

    def finish(self) -> GraphProgram:
        self._end_segment()
        program = GraphProgram(self.ctx, self._stages, self._keep)
        self.ctx = 0
        return program

    def _new_graph(self) -> ggml.ggml_cgraph_p:
        graph = ggml.ggml_new_graph_custom(self.ctx, self._graph_size, False)
        if not graph:
            raise MemoryError("ggml_new_graph_custom failed")
        return graph

    def _end_segment(self) -> None:
        graph = self._graph
        n = ggml.ggml_graph_n_nodes(graph)
        if n == 0:
            return
        nodes = [ggml.ggml_graph_node(graph, i).contents for i in range(n)]
        owned = [node for node in nodes if not node.data]  # set now: leaves, outputs, views of those
        self._stages.append(Segment(graph, owned + self._scratch))
        self._scratch = []

    def __del__(self) -> None:
        if getattr(self, "ctx", 0):  # not finished (an error while building)
            ggml.ggml_free(self.ctx)


def _new(ctx: int, gtype: int, ne: Sequence[int]) -> Tensor:
    ne = [int(n) for n in ne]
    make = (ggml.ggml_new_tensor_1d, ggml.ggml_new_tensor_2d, ggml.ggml_new_tensor_3d, ggml.ggml_new_tensor_4d)
    return make[len(ne) - 1](ctx, gtype, *ne)


def _ne(tensor: Tensor) -> tuple[int, ...]:
    """A tensor's ggml shape without its trailing ones (at least one dimension)."""
    return _strip(tuple(int(n) for n in tensor.contents.ne))


def _strip(ne: tuple[int, ...]) -> tuple[int, ...]:
    while len(ne) > 1 and ne[-1] == 1:
        ne = ne[:-1]
    return ne
