"""ggml graphs built from Python and run on a `CPUKernels` backend: the plumbing under the CPU step graph.

A `GraphBuilder` owns one ggml context (tensor headers only: no_alloc) in which a step is described. Every tensor
whose memory exists already is a leaf pointed at it when it is made: weights in the file mapping (or their repacked
copies), norm vectors, the KV cache, and the step's inputs and outputs, whose buffers the program owns and fills per
call. Everything else is an intermediate node that a graph allocator (`ggml_gallocr`) places.

A program is one graph. The programs share one allocator per `GraphRunner`, so the memory of a step's intermediates
is that of the largest program; a program's nodes are placed again whenever another one ran on the allocator since.

Shapes here are ggml's (ne0 first: ne0 is the contiguous dimension).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, field

import ggml
import numpy as np
import torch

from tandem.quant.ggml_cpu import CPUKernels
from tandem.quant.ggml_weights import GGMLWeight, new_tensor, point_weight

__all__ = ["GraphBuilder", "GraphProgram", "GraphRunner", "Tensor"]

Tensor = ggml.ggml_tensor_p  # a pointer to a tensor header in the builder's context

_NP_TYPES = {np.dtype(np.float32): ggml.GGML_TYPE_F32, np.dtype(np.int32): ggml.GGML_TYPE_I32,
             np.dtype(np.int64): ggml.GGML_TYPE_I64, np.dtype(np.float16): ggml.GGML_TYPE_F16}  # fmt: skip
_TORCH_TYPES = {torch.float32: ggml.GGML_TYPE_F32, torch.float16: ggml.GGML_TYPE_F16,
                torch.bfloat16: ggml.GGML_TYPE_BF16, torch.int32: ggml.GGML_TYPE_I32}  # fmt: skip


@dataclass(eq=False)
class GraphProgram:
    """A step's ggml graph, the nodes the allocator places (set to NULL before it places them again), and the
    context and buffers they point into."""

    ctx: int
    graph: ggml.ggml_cgraph_p
    owned: list[ggml.ggml_tensor]
    keep: list[object]  # every buffer and weight a leaf points at: alive as long as the program
    address: int = field(init=False)  # the graph's address, for the raw compute call

    def __post_init__(self) -> None:
        self.address = ctypes.cast(self.graph, ctypes.c_void_p).value or 0

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
        self._placed: GraphProgram | None = None  # the program whose nodes the allocator's buffer holds now

    def run(self, program: GraphProgram) -> None:
        if self._placed is not program:
            for tensor in program.owned:
                tensor.data = None
                tensor.buffer = None
            if not ggml.ggml_gallocr_alloc_graph(self._allocator, program.graph):
                self._placed = None
                raise MemoryError("ggml_gallocr_alloc_graph failed")
            self._placed = program
        self.kernels.compute_graph(program.address)

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
    with `ctx`). `finish` returns the program."""

    def __init__(self, n_tensors: int) -> None:
        # The graph holds at most every tensor of the context, as nodes or as leafs: sized by the program (a fixed
        # size was outgrown by a 48-layer model's prompt of 1024 rows, and ggml aborts the process then)
        mem = ggml.ggml_tensor_overhead() * n_tensors + ggml.ggml_graph_overhead_custom(n_tensors, False) + (1 << 16)
        self.ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=mem, mem_buffer=None, no_alloc=True))
        if not self.ctx:
            raise MemoryError("ggml_init failed")
        self.keep: list[object] = []  # what the leaves and nodes point at (buffers, weights, op parameters)
        self._weights: dict[int, Tensor] = {}
        self._scratch: list[ggml.ggml_tensor] = []  # tensors of no op that the allocator places
        self._graph = ggml.ggml_new_graph_custom(self.ctx, n_tensors, False)
        if not self._graph:
            raise MemoryError("ggml_new_graph_custom failed")

    # -- leaves ---------------------------------------------------------------------------------------
    def leaf(self, gtype: int, ne: Sequence[int], ptr: int, keep: object = None) -> Tensor:
        """A tensor on memory at `ptr` (kept alive through `keep`), contiguous, of ggml shape `ne`."""
        tensor = _new(self.ctx, gtype, ne)
        tensor.contents.data = ptr
        ggml.ggml_set_input(tensor)
        if keep is not None:
            self.keep.append(keep)
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
            self.keep.append(w)
        return tensor

    def scratch(self, gtype: int, ne: Sequence[int]) -> Tensor:
        """A tensor that nodes write into (through views) and read: placed by the allocator like a node's result."""
        tensor = _new(self.ctx, gtype, ne)
        self._scratch.append(tensor.contents)
        return tensor

    # -- nodes --------------------------------------------------------------------------------------------
    def expand(self, tensor: Tensor) -> None:
        """Add `tensor` and what it depends on to the graph now (stores into the cache must come before the nodes
        that read the cache, which do not depend on them)."""
        ggml.ggml_build_forward_expand(self._graph, tensor)

    def output(self, tensor: Tensor, t: torch.Tensor) -> None:
        """Make node `tensor` compute into the contiguous float32 CPU tensor t (its shape, reversed)."""
        assert t.is_contiguous() and t.dtype is torch.float32 and _strip(tuple(t.shape)[::-1]) == _ne(tensor)
        tensor.contents.data = t.data_ptr()
        ggml.ggml_set_output(tensor)
        self.keep.append(t)
        self.expand(tensor)

    def finish(self) -> GraphProgram:
        graph = self._graph
        nodes = [ggml.ggml_graph_node(graph, i).contents for i in range(ggml.ggml_graph_n_nodes(graph))]
        owned = [node for node in nodes if not node.data]  # set now: leaves, outputs, views of those
        program = GraphProgram(self.ctx, graph, owned + self._scratch, self.keep)
        self.ctx = 0
        return program

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
