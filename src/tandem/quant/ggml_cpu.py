"""Matrix products on quantized GGUF blocks through ggml's CPU kernels (zero copy).

The weights are never dequantized nor copied: a ggml tensor's `data` is pointed at the raw GGUF
bytes (a view into the file's memory map), the activation and output tensors at the memory of torch
tensors, and ggml's CPU backend runs `ggml_mul_mat` / `ggml_mul_mat_id` on them. The arithmetic is
llama.cpp's: ggml converts the activations to the weight type's `vec_dot_type` (Q8_0, Q8_1 or Q8_K
for quantized weights, F16/BF16 for those weights, F32 for F32) and runs its integer dot products.

Per-call cost is kept low for decode (one call per layer per token): the CPU backend, its work
buffer and its threadpool live as long as the `CPUKernels` object, and the one-node graph of each
distinct problem (type, shape, token count) is built once and cached; a call then only writes three
or four `data` pointers into the cached ggml tensors and runs the graph.

The matrices of a CPU model are held as llama.cpp's CPU backend holds them (repacked copies:
`tandem.quant.ggml_weights`), and ggml is the version llama.cpp runs (`require_ggml`: its tiled K-quant kernel for 8
rows or more among others), so that the products are llama.cpp's to the bit. One exception, beside a GPU: a batched
step's routed experts in host RAM go to tandem's own kernel where it takes them (`tandem.quant.moe_kernel`: ggml's
integers, float32 sums in another order).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import ggml
import numpy as np
import torch
from gguf import GGMLQuantizationType

from tandem.errors import InstallationError, UnsupportedModelError
from tandem.quant import moe_kernel
from tandem.quant.expert_ffn import ExpertFFN, as_f32, expert_ffn_nodes
from tandem.quant.ggml_weights import (
    GGMLWeight,
    RepackedTensor,
    mul_mat_supported,
    new_tensor,
    point_tensor,
    point_weight,
)

__all__ = ["CPUKernels"]

# Graphs kept per CPUKernels. A model has a handful of (type, N, K) combinations per layer kind, and
# decode uses one token count; prefill adds one set per distinct chunk length. Each entry is ~3 KiB.
_MAX_CACHED_GRAPHS = 256
_GRAPH_NODES = 4

# The raw ctypes function, with plain pointer arguments: passing ints is the cheapest conversion.
_graph_compute = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(
    ctypes.cast(ggml.ggml_backend_graph_compute, ctypes.c_void_p).value
)


class _Graph:
    """A cached one-node ggml graph; the tensors' `data` pointers are filled in at each call."""

    __slots__ = ("ctx", "graph", "w", "x", "ids", "out")  # x: the activations, or a lookup's row ids

    def __init__(self, ctx: int, graph: int, w: ggml.ggml_tensor, x: ggml.ggml_tensor,
                 ids: ggml.ggml_tensor | None, out: ggml.ggml_tensor) -> None:  # fmt: skip
        self.ctx = ctx
        self.graph = graph
        # ctypes structs that alias the ggml tensors' memory: `t.data = p` writes into ggml directly.
        self.w = w
        self.x = x
        self.ids = ids
        self.out = out


@dataclass(eq=False)
class _FFNGraph:
    """A cached graph of several nodes: its context, graph, allocator and the tensors repointed per call (the
    inputs, then the output)."""

    ctx: int
    graph: int
    allocator: int
    inputs: list


# The ggml that llama-cpp-python 0.3.36 vendors, whose products (the tiled K-quant kernel for 8 rows or more,
# tinyBLAS) give llama.cpp's bits; ggml-python vendors an older one (0.15.3) that lacks them.
GGML_MIN_VERSION = (0, 25)


def require_ggml() -> None:
    """Raise InstallationError unless the loaded ggml library is at least GGML_MIN_VERSION and sums f16 products in
    float32, as llama.cpp's portable builds do (CPU attention reads the f16 cache through them)."""
    version = ggml.ggml_version().decode()
    if tuple(int(part) for part in version.split(".")[:2]) < GGML_MIN_VERSION:
        raise InstallationError(
            f"ggml-python runs ggml {version}; tandem needs ggml >= {'.'.join(map(str, GGML_MIN_VERSION))}, the one "
            "llama.cpp runs: install ggml-python with scripts/build_ggml_python.sh (`make` does)"
        )
    if not _f16_products_sum_in_float32():
        raise InstallationError(
            "ggml-python's ggml sums f16 products in f16 (built natively for a CPU with AVX512-FP16), which rounds "
            "attention scores to f16: install ggml-python with scripts/build_ggml_python.sh (`make` does)"
        )


@functools.cache
def _f16_products_sum_in_float32() -> bool:
    """Whether a decode step's f16 product (one query row over 64 keys) sums in float32: each key 2048 and 255
    ones, where a sum kept in f16 lanes loses the ones added to 2048 (f16's spacing there is 2)."""
    n, rows = 256, 64
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=1 << 20, mem_buffer=None, no_alloc=False))
    if not ctx:
        raise MemoryError("ggml_init failed")
    try:
        a = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F16, n, rows)
        b = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, n, 1)
        keys, query = np.ones((rows, n), dtype=np.float16), np.ones(n, dtype=np.float32)
        keys[:, 0] = 2048
        ctypes.memmove(ggml.ggml_get_data(a), keys.ctypes.data, keys.nbytes)
        ctypes.memmove(ggml.ggml_get_data(b), query.ctypes.data, query.nbytes)
        out = ggml.ggml_mul_mat(ctx, a, b)
        graph = ggml.ggml_new_graph(ctx)
        ggml.ggml_build_forward_expand(graph, out)
        ggml.ggml_graph_compute_with_ctx(ctx, graph, 1)
        scores = np.ctypeslib.as_array(ctypes.cast(ggml.ggml_get_data(out), ctypes.POINTER(ctypes.c_float)), (rows,))
        return bool((scores == 2048 + n - 1).all())
    finally:
        ggml.ggml_free(ctx)


class CPUKernels:
    """ggml CPU matrix products on quantized GGUF weights, with a persistent backend and threadpool.

    Thread safety: one instance owns one ggml CPU backend (one work buffer, one threadpool) and a
    cache of graphs whose tensors' data pointers are rewritten on each call, so calls on the same
    instance are serialized by an internal lock. The GIL is released while ggml computes, so other
    Python threads (e.g. the one driving the GPU) run meanwhile. Separate instances are independent,
    but each uses `n_threads` cores: running several at once oversubscribes the CPU.

    Threads: this ggml build runs its threads through OpenMP, in the same libgomp as torch. With the
    default (spinning) OMP_WAIT_POLICY, `n_threads` larger than the cores actually free makes every
    barrier wait out a scheduler time slice (a product can take 100x longer). Give it only free cores, or set
    OMP_WAIT_POLICY=PASSIVE before torch is imported.
    Compute from one thread: libgomp keeps a team of workers per thread that starts parallel regions, and
    once all teams together outnumber the CPUs it cuts every barrier's spin to ~100 iterations and sleeps
    (decode slows by about a quarter with ggml on a second thread).
    """

    def __init__(self, n_threads: int, native: bool = True) -> None:
        """Start a ggml CPU backend that computes with `n_threads` threads. native: hand routed experts of a few
        tokens to tandem's own kernel where it takes them (tandem.quant.moe_kernel); False keeps them with ggml."""
        if n_threads < 1:
            raise ValueError(f"n_threads must be >= 1, got {n_threads}")
        require_ggml()
        self.n_threads = int(n_threads)
        self.native = native and moe_kernel.setting() == "auto"  # a bad TANDEM_MOE_KERNEL fails here, at load
        self._moe_scratch = torch.empty(0, dtype=torch.uint8)  # tandem's MoE kernel's working memory
        self._lock = threading.Lock()
        self._graphs: OrderedDict[tuple[int, ...], _Graph] = OrderedDict()
        self._ffn_graphs: dict[tuple[object, ...], _FFNGraph] = {}  # a few per model: one per (kind, T)
        backend = ggml.ggml_backend_cpu_init()
        if not backend:
            raise RuntimeError("ggml_backend_cpu_init failed")
        self._backend: int | None = backend
        ggml.ggml_backend_cpu_set_n_threads(backend, self.n_threads)
        # A persistent threadpool: without one, ggml builds and frees a disposable one on every compute.
        params = ggml.ggml_threadpool_params_default(self.n_threads)
        threadpool = ggml.ggml_threadpool_new(ctypes.byref(params))
        if not threadpool:
            ggml.ggml_backend_free(backend)
            raise RuntimeError("ggml_threadpool_new failed")
        self._threadpool: int | None = threadpool
        ggml.ggml_backend_cpu_set_threadpool(backend, threadpool)

    # -- public API -------------------------------------------------------------------------------

    def matmul(self, x: torch.Tensor, w: GGMLWeight, out: torch.Tensor | None = None) -> torch.Tensor:
        """y = x @ W^T on the quantized blocks of W.

        x: [T, K] (made contiguous float32 CPU if it is not); w: shape (N, K).
        Returns [T, N] float32: a fresh tensor, or `out` (contiguous float32 [T, N]) filled in place.
        """
        if len(w.shape) != 2:
            raise ValueError(f"matmul needs an (N, K) weight, got shape {w.shape}; use mul_mat_id for experts")
        n, k = w.shape
        x = as_f32(x)
        if x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"x must be [T, {k}], got {tuple(x.shape)}")
        t = x.shape[0]
        y = _output(out, (t, n))
        if t == 0:
            return y
        repacked = w.repacked
        key = (0, int(w.qtype), n, k, t, repacked is not None)
        with self._lock:
            g = self._cached(key, lambda: self._build(key, w.qtype, (k, n), (k, t), None, repacked))
            point_weight(g.w, w)
            g.x.data = x.data_ptr()
            g.out.data = y.data_ptr()
            self._compute(g.graph)
        # x, y and w were referenced by locals throughout the (synchronous) compute.
        return y

    def get_rows(self, w: GGMLWeight, rows: torch.Tensor) -> torch.Tensor:
        """Rows `rows` of the (N, K) matrix w as float32 [T, K], decoded by ggml (`ggml_get_rows`, llama.cpp's
        token-embedding lookup: its CPU dequantization, in one C call). rows: T integer ids in [0, N)."""
        n, k = w.shape
        ids = rows.to(device="cpu", dtype=torch.int32).contiguous().view(-1)
        _check_ids(ids, n, "row")
        t = ids.numel()
        y = torch.empty(t, k, dtype=torch.float32)
        if t == 0:
            return y
        key = (4, int(w.qtype), n, k, t)
        with self._lock:
            g = self._cached(key, lambda: self._build(key, w.qtype, (k, n), (t,), None, lookup=True))
            g.w.data = w.ptr
            g.x.data = ids.data_ptr()
            g.out.data = y.data_ptr()
            self._compute(g.graph)
        return y

    def geglu(self, x: torch.Tensor, gate: GGMLWeight, up: GGMLWeight) -> torch.Tensor:
        """ggml_geglu_split(gate(x), up(x)) in one graph: both products and ggml's GEGLU (its f16 GELU table)
        for one compute call.

        x: [T, K]; gate, up: (F, K) matrices. Returns [T, F] float32."""
        x = as_f32(x)
        t = x.shape[0]
        f, k = gate.shape
        if up.shape != gate.shape or x.dim() != 2 or x.shape[1] != k or t == 0:
            raise ValueError(f"geglu needs x [T > 0, {k}] and two ({f}, {k}) weights")
        y = torch.empty(t, f, dtype=torch.float32)
        key = (3, int(gate.qtype), int(up.qtype), f, k, t, gate.repacked is not None, up.repacked is not None)
        with self._lock:
            g = self._ffn_graphs.get(key)
            if g is None:
                g = self._build_geglu(key, gate, up, x)
            for tensor, w in zip(g.inputs[:2], (gate, up), strict=True):
                point_weight(tensor, w)
            g.inputs[2].data = x.data_ptr()
            g.inputs[3].data = y.data_ptr()
            self._compute(g.graph)
        return y

    def _build_geglu(self, key: tuple[int, ...], gate: GGMLWeight, up: GGMLWeight, x: torch.Tensor) -> _FFNGraph:
        """Build the `geglu` graph; the products' outputs get memory from a graph allocator."""
        if self._backend is None:
            raise RuntimeError("CPUKernels is closed")
        f, k = gate.shape
        t = x.shape[0]
        mem = ggml.ggml_tensor_overhead() * 8 + ggml.ggml_graph_overhead_custom(8, False)
        ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=mem, mem_buffer=None, no_alloc=True))
        if not ctx:
            raise MemoryError("ggml_init failed")
        try:
            g_t = new_tensor(ctx, int(gate.qtype), (k, f))
            u_t = new_tensor(ctx, int(up.qtype), (k, f))
            x_t = new_tensor(ctx, ggml.GGML_TYPE_F32, (k, t))
            # Inputs point at real memory before allocation, so the allocator leaves them alone.
            for tensor, w in ((g_t.contents, gate), (u_t.contents, up)):
                point_weight(tensor, w)
            x_t.contents.data = x.data_ptr()
            for tensor in (g_t, u_t, x_t):
                ggml.ggml_set_input(tensor)
            out = ggml.ggml_geglu_split(ctx, ggml.ggml_mul_mat(ctx, g_t, x_t), ggml.ggml_mul_mat(ctx, u_t, x_t))
            ggml.ggml_set_output(out)
            graph, allocator = self._allocated_graph(ctx, out, 8)
        except BaseException:
            ggml.ggml_free(ctx)
            raise
        g = _FFNGraph(ctx=ctx, graph=ctypes.cast(graph, ctypes.c_void_p).value or 0, allocator=allocator,
                      inputs=[g_t.contents, u_t.contents, x_t.contents, out.contents])  # fmt: skip
        self._ffn_graphs[key] = g
        return g

    def mul_mat_id(
        self, x: torch.Tensor, w: GGMLWeight, ids: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Per-token expert products through `ggml_mul_mat_id`: only the selected experts are read.

        w: stacked experts (E, N, K). ids: [T, A] integer expert indices (0 <= id < E, repeats allowed).
        x: [T, K] (the same activation for each of the A experts, e.g. gate/up projections) or
        [T, A, K] (one activation per selected expert, e.g. the down projection).
        Returns [T, A, N] float32 with out[t, a] = x[t] @ W[ids[t, a]]^T (or x[t, a] @ ...).
        """
        if len(w.shape) != 3:
            raise ValueError(f"mul_mat_id needs an (E, N, K) weight, got shape {w.shape}")
        e, n, k = w.shape
        x = as_f32(x)
        if ids.dim() != 2:
            raise ValueError(f"ids must be [T, A], got {tuple(ids.shape)}")
        t, a = ids.shape
        if x.shape == (t, k):
            x_slots = 1  # broadcast over the A selected experts
        elif x.shape == (t, a, k):
            x_slots = a
        else:
            raise ValueError(
                f"x must be [{t}, {k}] or [{t}, {a}, {k}] for ids {tuple(ids.shape)}, got {tuple(x.shape)}"
            )
        if ids.dtype is not torch.int32 or not ids.is_cpu or not ids.is_contiguous():
            ids = ids.to(device="cpu", dtype=torch.int32).contiguous()
        y = _output(out, (t, a, n))
        if t == 0 or a == 0:
            return y
        _check_ids(ids, e)
        key = (1, int(w.qtype), e, n, k, t, a, x_slots)
        with self._lock:
            g = self._cached(key, lambda: self._build(key, w.qtype, (k, n, e), (k, x_slots, t), (a, t)))
            assert g.ids is not None
            g.w.data = w.ptr
            g.x.data = x.data_ptr()
            g.ids.data = ids.data_ptr()
            g.out.data = y.data_ptr()
            self._compute(g.graph)
        return y

    def gated_experts(self, x: torch.Tensor, ffn: ExpertFFN, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """A whole routed-expert FFN in one ggml graph: the products, biases, gated unit, per-expert scale and
        the mixing by the routing weights (see ExpertFFN). One compute call per layer instead of three
        products plus torch glue: the threadpool wakes once.

        x: [T, K]; ids, weights: [T, A]. Returns [T, D] float32.
        """
        ids = ids.to(device="cpu", dtype=torch.int32).contiguous()
        y = torch.empty(ids.shape[0], ffn.down.shape[1], dtype=torch.float32)
        if y.numel() == 0 or ids.shape[1] == 0:
            return y.zero_()
        _check_ids(ids, ffn.down.shape[0])
        # named: a converted copy must outlive the compute call, which reads it through a raw pointer
        x32, w32 = as_f32(x), as_f32(weights)
        self.gated_experts_into(y, x32, ffn, ids, w32)()
        return y

    def gated_experts_into(
        self, out: torch.Tensor, x: torch.Tensor, ffn: ExpertFFN, ids: torch.Tensor, weights: torch.Tensor
    ) -> Callable[[], None]:
        """`gated_experts` prepared on fixed buffers: the returned function computes out [T, D] from what x,
        ids and weights hold when it is called, with no per-call checks or allocations (decode calls it once
        per layer per token). All four are contiguous CPU tensors (float32; ids int32 in [0, E): the caller
        vouches for them, e.g. a router's top-k) that must outlive the function.
        """
        d = ffn.down.shape[1]
        k = ffn.stacks[0].shape[-1]
        t, a = ids.shape
        expected = {"out": (out, torch.float32, (t, d)), "x": (x, torch.float32, (t, k)),
                    "ids": (ids, torch.int32, (t, a)), "weights": (weights, torch.float32, (t, a))}  # fmt: skip
        for name, (tensor, dtype, shape) in expected.items():
            if tensor.dtype is not dtype or not tensor.is_cpu or not tensor.is_contiguous() or tensor.shape != shape:
                raise ValueError(f"{name} must be a contiguous {dtype} CPU tensor of shape {shape}")
        native = self._native_experts(out, x, ffn, ids, weights)
        if native is not None:
            nbytes, compute = native
            with self._lock:
                if self._moe_scratch.numel() < nbytes:  # one buffer for every layer's calls: they hold the lock
                    self._moe_scratch = torch.empty(nbytes, dtype=torch.uint8)

            def run_native() -> None:
                with self._lock:  # one team of OpenMP threads at a time, as for ggml's graphs
                    if self._backend is None:
                        raise RuntimeError("CPUKernels is closed")
                    compute(self._moe_scratch.data_ptr())

            return run_native
        key = (2, *ffn.structure, t, a)
        with self._lock:
            g = self._ffn_graphs.get(key)
            if g is None:
                g = self._build_ffn(key, ffn, x, ids, weights)
        targets = [(ptr, repacked) for _, _, ptr, repacked in ffn.inputs.values()]
        targets += [(t.data_ptr(), None) for t in (x, ids, weights, out)]
        pointers = [(tensor, ptr, repacked) for tensor, (ptr, repacked) in zip(g.inputs, targets, strict=True)]

        def run() -> None:
            with self._lock:  # the cached graph may serve several layers: point it at this one's buffers
                for tensor, ptr, repacked in pointers:
                    point_tensor(tensor, ptr, repacked)
                self._compute(g.graph)

        return run

    def _native_experts(
        self, out: torch.Tensor, x: torch.Tensor, ffn: ExpertFFN, ids: torch.Tensor, weights: torch.Tensor
    ) -> tuple[int, Callable[[int], None]] | None:
        """tandem's kernel for a few tokens an expert (tandem.quant.moe_kernel), where it takes this FFN: its scratch
        bytes and call; else None."""
        e, _, f = ffn.down.shape
        t, a = ids.shape
        if not (self.native and ffn.kernel_takes) or t < moe_kernel.MIN_TOKENS:
            return None
        if t * a > moe_kernel.MAX_TOKENS_PER_EXPERT * e:
            return None
        return moe_kernel.experts_into(
            out, x, ids, weights, tuple((w.ptr, w.qtype) for w in ffn.stacks), (ffn.down.ptr, ffn.down.qtype), e, f,
            self.n_threads,
        )

    def _build_ffn(
        self, key: tuple[object, ...], ffn: ExpertFFN, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> _FFNGraph:
        """Build the fused expert graph for x [T, K] and ids, weights [T, A] (the order of operations is
        llama.cpp's `build_moe_ffn`); intermediates get memory from a graph allocator. Caller holds the lock."""
        if self._backend is None:
            raise RuntimeError("CPUKernels is closed")
        k = ffn.stacks[0].shape[-1]
        t, a = ids.shape
        n_nodes = 24 + 2 * a
        mem = ggml.ggml_tensor_overhead() * (n_nodes + 16) + ggml.ggml_graph_overhead_custom(n_nodes, False)
        ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=mem, mem_buffer=None, no_alloc=True))
        if not ctx:
            raise MemoryError("ggml_init failed")
        inputs: list[ggml.ggml_tensor_p] = []

        def leaf(
            gtype: int, ne: tuple[int, ...], ptr: int, repacked: RepackedTensor | None = None
        ) -> ggml.ggml_tensor_p:
            # Inputs point at real memory before allocation, so the allocator leaves them alone. Views of them
            # would keep the first address: the graph reads each input directly.
            tensor = new_tensor(ctx, gtype, ne)
            point_tensor(tensor.contents, ptr, repacked)
            ggml.ggml_set_input(tensor)
            inputs.append(tensor)
            return tensor

        try:
            w = {name: leaf(*spec) for name, spec in ffn.inputs.items()}
            x_t = leaf(ggml.GGML_TYPE_F32, (k, 1, t), x.data_ptr())
            ids_t = leaf(ggml.GGML_TYPE_I32, (a, t), ids.data_ptr())
            mix_t = leaf(ggml.GGML_TYPE_F32, (1, a, t), weights.data_ptr())  # the mixing weights, a row per token
            out = expert_ffn_nodes(ctx, ffn, w, x_t, ids_t, mix_t)
            ggml.ggml_set_output(out)
            graph, allocator = self._allocated_graph(ctx, out, n_nodes)
        except BaseException:
            ggml.ggml_free(ctx)
            raise
        g = _FFNGraph(
            ctx=ctx,
            graph=ctypes.cast(graph, ctypes.c_void_p).value or 0,
            allocator=allocator,
            inputs=[tensor.contents for tensor in (*inputs, out)],
        )
        self._ffn_graphs[key] = g
        return g

    def compute_graph(self, graph: int) -> None:
        """Run a graph built elsewhere (tandem.models.cpu_graph), its tensors pointed at memory or placed by an
        allocator from `new_graph_allocator`, on this backend's threads."""
        with self._lock:
            if self._backend is None:
                raise RuntimeError("CPUKernels is closed")
            self._compute(graph)

    def new_graph_allocator(self) -> int:
        """A graph allocator (ggml_gallocr) on this backend's buffer type; the caller frees it."""
        if self._backend is None:
            raise RuntimeError("CPUKernels is closed")
        allocator = ggml.ggml_gallocr_new(ggml.ggml_backend_get_default_buffer_type(self._backend))
        if not allocator:
            raise MemoryError("ggml_gallocr_new failed")
        return allocator

    def close(self) -> None:
        """Free the graphs, the backend and the threadpool. Idempotent."""
        with self._lock:
            for g in self._graphs.values():
                ggml.ggml_free(g.ctx)
            self._graphs.clear()
            for fg in self._ffn_graphs.values():
                ggml.ggml_gallocr_free(fg.allocator)
                ggml.ggml_free(fg.ctx)
            self._ffn_graphs.clear()
            if self._backend is not None:
                ggml.ggml_backend_free(self._backend)
                self._backend = None
            if self._threadpool is not None:  # after the backend that uses it
                ggml.ggml_threadpool_free(self._threadpool)
                self._threadpool = None
            self._moe_scratch = torch.empty(0, dtype=torch.uint8)

    def __enter__(self) -> CPUKernels:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Interpreter shutdown may have torn down ggml already; close() is best effort then.
        try:
            self.close()
        except Exception:
            pass

    # -- internals --------------------------------------------------------------------------------

    def _cached(self, key: tuple[int, ...], build: Callable[[], _Graph]) -> _Graph:
        """The one-node graph of `key` (built on first use; least recently used first out). Caller holds
        the lock."""
        g = self._graphs.get(key)
        if g is None:
            return build()
        self._graphs.move_to_end(key)
        return g

    def _allocated_graph(self, ctx: int, out: object, n_nodes: int) -> tuple[object, object]:
        """The graph computing `out` in ctx, its intermediates placed by a graph allocator on the backend's
        buffer type: (graph, allocator); the caller frees ctx if this raises."""
        graph = ggml.ggml_new_graph_custom(ctx, n_nodes, False)
        ggml.ggml_build_forward_expand(graph, out)
        allocator = ggml.ggml_gallocr_new(ggml.ggml_backend_get_default_buffer_type(self._backend))
        if not allocator or not ggml.ggml_gallocr_alloc_graph(allocator, graph):
            raise MemoryError("ggml_gallocr_alloc_graph failed")
        return graph, allocator

    def _compute(self, graph: int) -> None:
        """Run a graph whose tensors point at the caller's buffers. Caller holds the lock."""
        status = _graph_compute(self._backend, graph)
        if status != 0:
            raise RuntimeError(f"ggml graph compute failed with status {status}")

    def _build(
        self,
        key: tuple[int, ...],
        qtype: GGMLQuantizationType,
        w_ne: tuple[int, ...],
        x_ne: tuple[int, ...],
        ids_ne: tuple[int, int] | None,
        repacked: RepackedTensor | None = None,
        lookup: bool = False,
    ) -> _Graph:
        """Build and cache the graph for one problem shape (ne in ggml order). Caller holds the lock.

        With `repacked`, the weight tensor stands for repacked copies: it carries one's buffer and layout
        from here on (so that the backend is asked about the product it will run), and each call points it
        at the copy it multiplies. With `lookup`, the graph is a row lookup (`ggml_get_rows`) and x holds the
        int32 row ids, x_ne their count."""
        if self._backend is None:
            raise RuntimeError("CPUKernels is closed")
        if not lookup and not mul_mat_supported(qtype):
            raise UnsupportedModelError(f"this ggml build has no CPU matrix product for {qtype.name}")
        mem = ggml.ggml_tensor_overhead() * _GRAPH_NODES + ggml.ggml_graph_overhead_custom(_GRAPH_NODES, False)
        # no_alloc: tensors get no memory of their own; their data pointers are set per call.
        ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=mem, mem_buffer=None, no_alloc=True))
        if not ctx:
            raise MemoryError("ggml_init failed")
        try:
            w_t = new_tensor(ctx, int(qtype), w_ne)
            if repacked is not None:
                point_tensor(w_t.contents, 0, repacked)
            x_t = (ggml.ggml_new_tensor_1d(ctx, ggml.GGML_TYPE_I32, x_ne[0]) if lookup
                   else new_tensor(ctx, ggml.GGML_TYPE_F32, x_ne))  # fmt: skip
            if lookup:
                ids_t = None
                out_t = ggml.ggml_get_rows(ctx, w_t, x_t)
            elif ids_ne is None:
                ids_t = None
                out_t = ggml.ggml_mul_mat(ctx, w_t, x_t)
            else:
                ids_t = new_tensor(ctx, ggml.GGML_TYPE_I32, ids_ne)
                out_t = ggml.ggml_mul_mat_id(ctx, w_t, x_t, ids_t)
            if not ggml.ggml_backend_supports_op(self._backend, out_t):
                what = "row lookup" if lookup else "product"
                raise UnsupportedModelError(f"the ggml CPU backend does not support this {what} for {qtype.name}")
            # The output must be contiguous f32 so that it can alias a torch tensor.
            if out_t.contents.type != ggml.GGML_TYPE_F32 or not ggml.ggml_is_contiguous(out_t):
                raise RuntimeError("unexpected ggml output layout")
            graph = ggml.ggml_new_graph_custom(ctx, _GRAPH_NODES, False)
            ggml.ggml_build_forward_expand(graph, out_t)
        except BaseException:
            ggml.ggml_free(ctx)
            raise
        g = _Graph(
            ctx,
            ctypes.cast(graph, ctypes.c_void_p).value or 0,
            w_t.contents,
            x_t.contents,
            ids_t.contents if ids_t is not None else None,
            out_t.contents,
        )
        self._graphs[key] = g
        while len(self._graphs) > _MAX_CACHED_GRAPHS:
            _, old = self._graphs.popitem(last=False)
            ggml.ggml_free(old.ctx)
        return g


def _check_ids(ids: torch.Tensor, n: int, what: str = "expert") -> None:
    """ggml aborts the whole process on an out-of-range expert or row id: refuse it here instead."""
    if ids.numel() == 0:
        return
    lo, hi = torch.aminmax(ids)
    if int(lo) < 0 or int(hi) >= n:
        raise ValueError(f"{what} ids must be in [0, {n}), got range [{int(lo)}, {int(hi)}]")


def _output(out: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=torch.float32)
    if out.dtype is not torch.float32 or not out.is_cpu or not out.is_contiguous() or out.shape != shape:
        raise ValueError(f"out must be a contiguous float32 CPU tensor of shape {shape}")
    return out
