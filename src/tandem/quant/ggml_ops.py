"""ggml's own non-product ops on its CPU backend: the exact values llama.cpp's CPU graph computes for the
steps tandem's CPU path would otherwise have to emulate (its rope's cos/sin and GELU table through
`ggml_elementwise`; query rows' attention over an f16 cache through `ggml_attention`)."""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import ggml
import numpy as np

__all__ = ["ATTENTION_THREADED_FROM", "ggml_attention", "ggml_elementwise", "ggml_gated_delta_rule"]


def ggml_elementwise(x: np.ndarray, ops: Sequence[str]) -> list[np.ndarray]:
    """ggml's unary ops (names such as "cos", "gelu") applied to x (float32 or float16, any shape) on
    ggml's CPU backend, one thread: the exact values ggml's own kernels give (its cos/sin call the C
    library, its gelu reads its f16 table). One result per op, in x's dtype and shape."""
    gtype = {np.dtype(np.float32): ggml.GGML_TYPE_F32, np.dtype(np.float16): ggml.GGML_TYPE_F16}[x.dtype]
    flat = np.ascontiguousarray(x).reshape(-1)
    n = flat.size
    if n == 0:
        return [flat.reshape(x.shape).copy() for _ in ops]
    mem = (
        (len(ops) + 1) * flat.nbytes + (len(ops) + 4) * ggml.ggml_tensor_overhead() + ggml.ggml_graph_overhead() + 4096
    )
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=mem, mem_buffer=None, no_alloc=False))
    if not ctx:
        raise MemoryError("ggml_init failed")
    try:
        src = ggml.ggml_new_tensor_1d(ctx, gtype, n)
        ctypes.memmove(ggml.ggml_get_data(src), flat.ctypes.data, flat.nbytes)
        outs = [getattr(ggml, f"ggml_{op}")(ctx, src) for op in ops]
        graph = ggml.ggml_new_graph(ctx)
        for out in outs:
            ggml.ggml_build_forward_expand(graph, out)
        ggml.ggml_graph_compute_with_ctx(ctx, graph, 1)
        results = []
        for out in outs:
            buf = (ctypes.c_char * flat.nbytes).from_address(ggml.ggml_get_data(out))
            results.append(np.frombuffer(buf, dtype=x.dtype).copy().reshape(x.shape))
        return results
    finally:
        ggml.ggml_free(ctx)


@dataclass(eq=False)
class _OpGraph:
    """A small graph of ggml ops (`ggml_attention`, `ggml_gated_delta_rule`): its contexts, graph, plan and the
    input tensors repointed per call, the output's memory and the plan's work buffer."""

    contexts: tuple[int, int]
    graph: ggml.ggml_cgraph_p
    plan: ggml.ggml_cplan
    inputs: tuple[ggml.ggml_tensor, ...]
    out: np.ndarray
    work: np.ndarray

    @classmethod
    def finish(
        cls,
        contexts: tuple[int, int],
        inputs: Sequence[ggml.ggml_tensor_p],
        out: ggml.ggml_tensor_p,
        out_shape: tuple[int, ...],
        n_threads: int,
        after: Sequence[ggml.ggml_tensor_p] = (),
    ) -> _OpGraph:
        """The graph computing `out` (float32, read as `out_shape`) from `inputs`, then the nodes `after` (which
        write into inputs' memory), planned for n_threads."""
        graph = ggml.ggml_new_graph_custom(contexts[1], 16, False)
        for node in (out, *after):
            ggml.ggml_build_forward_expand(graph, node)
        plan = ggml.ggml_graph_plan(graph, n_threads, None)
        work = np.empty(max(int(plan.work_size), 1), dtype=np.uint8)
        plan.work_data = work.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        result = np.ctypeslib.as_array(ctypes.cast(ggml.ggml_get_data(out), ctypes.POINTER(ctypes.c_float)), out_shape)
        return cls(contexts, graph, plan, tuple(t.contents for t in inputs), result, work)

    def compute(self, arrays: Sequence[np.ndarray]) -> None:
        """Runs the graph on `arrays` (the inputs' memory, in order; kept alive by the caller meanwhile)."""
        for tensor, array in zip(self.inputs, arrays, strict=True):
            tensor.data = array.ctypes.data
        status = ggml.ggml_graph_compute(self.graph, ctypes.byref(self.plan))
        if status != 0:
            raise RuntimeError(f"ggml graph compute failed with status {status}")

    def __del__(self) -> None:
        # Interpreter shutdown may have torn down ggml already; freeing is best effort then.
        try:
            for ctx in self.contexts:
                ggml.ggml_free(ctx)
        except Exception:
            pass


def _contexts(n_inputs: int, compute_bytes: int) -> tuple[int, int]:
    """A context holding only the input tensors' headers (their memory is the caller's, set per call) and one for
    the rest of the graph, `compute_bytes` of tensor data."""
    inputs_ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=ggml.ggml_tensor_overhead() * n_inputs,
                                                      mem_buffer=None, no_alloc=True))  # fmt: skip
    mem = compute_bytes + 16 * ggml.ggml_tensor_overhead() + ggml.ggml_graph_overhead_custom(16, False) + 4096
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=mem, mem_buffer=None, no_alloc=False))
    if not inputs_ctx or not ctx:
        raise MemoryError("ggml_init failed")
    return inputs_ctx, ctx


# Graphs kept for the next call: one-row steps (decoding), whose shapes repeat; several rows' (prefill) are freed
_GRAPHS: OrderedDict[tuple[str | int | float | bool, ...], _OpGraph] = OrderedDict()
_MAX_GRAPHS = 16  # decode needs one per layer geometry and scale; attention's moves on every 64 positions
_graphs_lock = threading.Lock()  # a graph's input pointers are rewritten per call


def _run_graph(
    key: tuple[str | int | float | bool, ...],
    keep: bool,
    build: Callable[[], _OpGraph],
    arrays: Sequence[np.ndarray],
    prepare: Callable[[_OpGraph], None] | None = None,
) -> np.ndarray:
    """Computes the graph of `key` (built by `build` unless kept from an earlier call; kept when `keep`) on
    `arrays`, after `prepare` (e.g. the inputs' strides of this call); returns a copy of its output."""
    with _graphs_lock:
        graph = _GRAPHS.get(key)
        if graph is None:
            graph = build()
            if keep:
                _GRAPHS[key] = graph
                while len(_GRAPHS) > _MAX_GRAPHS:
                    _GRAPHS.popitem(last=False)
        else:
            _GRAPHS.move_to_end(key)
        if prepare is not None:
            prepare(graph)
        graph.compute(arrays)
        return graph.out.copy()


# From this many positions x query rows the attention runs on all of torch's threads (below, one: a thread's wake-up
# costs more than its share; above, one thread is too slow for long contexts)
ATTENTION_THREADED_FROM = 1024


def _build_attention(
    h: int, g: int, d: int, dv: int, n: int, t: int, kq_scale: float, n_threads: int, sinks: bool
) -> _OpGraph:
    """mul_mat(k, q) -> soft_max_ext(mask, kq_scale) (with `sinks`: soft_max_add_sinks, one logit per head in the
    denominator) -> mul_mat(v^T, kq) for t query rows, the nodes of llama.cpp's attention without flash attention
    over its f16 cache: each product converts its float32 side (the queries, the probabilities) to f16 and sums
    exact products in float32 (tandem's ggml is built without AVX512-FP16 arithmetic: scripts/build_ggml_python.sh);
    the inputs' memory is the caller's, the rest the compute context's."""
    inputs_ctx, ctx = _contexts(5, 4 * (2 * n * t * h + dv * t * h))  # the scores, the probabilities, the output
    f32, f16 = ggml.GGML_TYPE_F32, ggml.GGML_TYPE_F16
    q = ggml.ggml_new_tensor_3d(inputs_ctx, f32, d, t, h)
    k = ggml.ggml_new_tensor_3d(inputs_ctx, f16, d, n, g)
    vt = ggml.ggml_new_tensor_3d(inputs_ctx, f16, n, dv, g)
    mask = ggml.ggml_new_tensor_2d(inputs_ctx, f32, n, t)
    kq = ggml.ggml_soft_max_ext(ctx, ggml.ggml_mul_mat(ctx, k, q), mask, kq_scale, 0.0)  # [N, T, H]
    inputs = [q, k, vt, mask]
    if sinks:
        sink = ggml.ggml_new_tensor_1d(inputs_ctx, f32, h)
        ggml.ggml_soft_max_add_sinks(kq, sink)
        inputs.append(sink)
    out = ggml.ggml_mul_mat(ctx, vt, kq)  # [Dv, T, H]
    return _OpGraph.finish((inputs_ctx, ctx), inputs, out, (h, t, dv), n_threads)


def _set_strides(tensor: ggml.ggml_tensor, nb1: int, nb2: int) -> None:
    """A 3-d tensor's byte strides (its rows contiguous), the 4th following from the 3rd."""
    tensor.nb[1], tensor.nb[2] = nb1, nb2
    tensor.nb[3] = nb2 * tensor.ne[2]


def ggml_attention(
    q: np.ndarray,
    k: np.ndarray,
    vt: np.ndarray,
    mask: np.ndarray,
    kq_scale: float,
    n_threads: int = 1,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """Query rows' attention on ggml's CPU backend, as llama.cpp computes it without flash attention: the same
    nodes over the same f16 cache (`_build_attention`).

    q: [H, T, D] float32 (scaled first where the model scales the queries; ggml's product converts it to f16),
    k: [N, G, D] and vt: [G, Dv, N] float16; mask: [T, N] float32 (0 or -inf). q and mask C-contiguous; k and vt
    may be views with strides of their own (a longer buffer's first N positions), their last axis contiguous.
    Query head h reads KV head h // (H / G). sinks: [H] float32 (or None), each head's extra logit in the
    softmax's denominator (gpt-oss), as llama.cpp adds them to the same kernel. n_threads: ggml's threads; each
    output is one thread's sum, so the values do not depend on it. One row's graph (decoding) is kept for the
    next call; several rows' graphs (prefill, whose key count grows) are freed after it.
    Returns [H, T, Dv] float32 (a fresh array)."""
    h, t, d = q.shape
    n, g, _ = k.shape
    dv = vt.shape[1]
    assert k.dtype == vt.dtype == np.float16 and k.strides[2] == vt.strides[2] == 2, "f16 rows, contiguous"
    key = ("attention", h, g, d, dv, n, t, float(kq_scale), n_threads, sinks is not None)

    def build() -> _OpGraph:
        return _build_attention(h, g, d, dv, n, t, float(kq_scale), n_threads, sinks is not None)

    def strides(graph: _OpGraph) -> None:
        _set_strides(graph.inputs[1], k.strides[0], k.strides[1])  # k [N, G, D] is ggml's (D, N, G)
        _set_strides(graph.inputs[2], vt.strides[1], vt.strides[0])  # vt [G, Dv, N] is ggml's (N, Dv, G)

    arrays = (q, k, vt, mask) if sinks is None else (q, k, vt, mask, sinks)
    return _run_graph(key, t == 1, build, arrays, strides)


def ggml_gated_delta_rule(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, state: np.ndarray, n_threads: int
) -> np.ndarray:
    """The gated delta rule over one sequence's T tokens as llama.cpp's CPU backend computes it: ggml's fused
    `gated_delta_net` op, token by token, the heads split over the threads (each head's values do not depend on
    their number).

    q, k: [T, H, D] (l2-normalised, not scaled: the op scales its outputs by 1/sqrt(D)), v: [T, H, D], g (the log
    decay) and beta: [T, H], all float32 and C-contiguous; state: [H, D, D] float32, C-contiguous, in ggml's
    layout (state[h, j, i] holds S[i][j] of S [Dk, Dv]), updated in place. Returns o [T, H, D] (a fresh array).
    One token's graph (decoding) is kept for the next call."""
    t, h, d = q.shape
    n_out = d * h * t

    def build() -> _OpGraph:
        inputs_ctx, ctx = _contexts(7, 4 * (n_out + d * d * h))
        f32 = ggml.GGML_TYPE_F32
        q_, k_, v_ = (ggml.ggml_new_tensor_4d(inputs_ctx, f32, d, h, t, 1) for _ in range(3))
        g_, beta_ = (ggml.ggml_new_tensor_4d(inputs_ctx, f32, 1, h, t, 1) for _ in range(2))
        state_ = ggml.ggml_new_tensor_4d(inputs_ctx, f32, d, d, h, 1)
        out = ggml.ggml_gated_delta_net(ctx, q_, k_, v_, g_, beta_, state_, 1)  # [o | the final state]
        # The final state back into the caller's, a node after the op (which has read it by then), as llama.cpp
        # copies it into its state cache: on the threads, head by head
        state_to = ggml.ggml_new_tensor_2d(inputs_ctx, f32, d * d, h)
        final = ggml.ggml_view_2d(ctx, out, d * d, h, 4 * d * d, 4 * n_out)
        copy = ggml.ggml_cpy(ctx, final, state_to)  # a view of state_to: its data pointer is set per call too
        inputs = (q_, k_, v_, g_, beta_, state_, state_to, copy)
        return _OpGraph.finish((inputs_ctx, ctx), inputs, out, (n_out,), n_threads, after=(copy,))

    arrays = (q, k, v, g, beta, state, state, state)
    return _run_graph(("gated_delta_net", t, h, d, n_threads), t == 1, build, arrays).reshape(t, h, d)
