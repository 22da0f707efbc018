"""tandem's flash attention on the CPU (`flash_attention.c`): ggml's FLASH_ATTN_EXT over an f16 cache, bit for bit,
with the query heads that share a key head reading each cached row together.

ggml's kernel converts the f16 keys and values to float32 once per query head. For one query row (a decode step)
over 512 keys or more, built without AVX512-FP16 arithmetic as tandem's ggml is (`require_ggml`), those conversions
are most of its time; llama.cpp built natively on a CPU with AVX512-FP16 adds the values in f16 lanes instead,
faster and rounded differently. For 64 query rows and more (a prompt chunk, ggml's tiled path, float32 in both
builds) they are a third of it. This kernel converts each row once for its group of query heads and otherwise
repeats ggml's arithmetic in ggml's order (see the C source), so a step's logits stay those of llama.cpp's portable
builds: one decode row over 512 keys or more (ggml's split of the keys between the threads, reproduced: two nodes,
the chunks' partial sums, then their merge), or 64 rows and more (one node).

The CPU step graphs (models/cpu_graph) take it in place of a FLASH_ATTN_EXT node where `takes` says so: f16 keys and
values, head sizes that are multiples of 64, one mask for all heads. Built with the machine's C compiler on first
use (quant/native), for x86-64 CPUs with AVX-512F; on load it computes a random case of each path both ways and is
used only if every bit agrees. `TANDEM_CPU_FLASH_KERNEL=ggml` keeps ggml's node everywhere; `available()` says why
the kernel is not used, where it is not.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import ggml
import numpy as np

from tandem.quant import native

SOURCE = Path(__file__).with_name("flash_attention.c")
ENV = "TANDEM_CPU_FLASH_KERNEL"  # "auto" (default): where it takes the shape; "ggml" ("off", "0"): never
MIN_KEYS = 512  # ggml's split-KV path for one query row starts here (ops.cpp)
MIN_ROWS = 64  # and its tiled path for a prompt chunk (its tile of query rows)
MAX_D, MAX_GROUP = 512, 32  # flash_attention.c's decode buffers
_FLAGS = ("-O3", "-march=native")

Tensor = ggml.ggml_tensor_p
_TensorArray = ctypes.POINTER(ggml.ggml_tensor)


def setting() -> str:
    """TANDEM_CPU_FLASH_KERNEL as "auto" or "ggml"; TandemError for a value it does not know."""
    return native.setting(ENV)


def _layout_matches(lib: ctypes.CDLL) -> bool:
    """Whether the C file's copy of ggml's tensor header has the offsets of the ggml this process runs."""
    t = ggml.ggml_tensor
    lib.flash_attention_offset.restype = ctypes.c_size_t
    lib.flash_attention_offset.argtypes = [ctypes.c_int]
    expected = (t.ne.offset, t.nb.offset, t.src.offset, t.data.offset, ctypes.sizeof(t))
    return tuple(lib.flash_attention_offset(i) for i in range(5)) == expected


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    """The kernel built for this machine and '', or None and why not."""
    if setting() == "auto" and not ggml.ggml_cpu_has_avx512():
        return None, "the CPU has no AVX-512F"
    lib, why = native.library(ENV, SOURCE, _FLAGS)
    if lib is None:
        return None, why
    if not _layout_matches(lib):
        return None, "ggml's tensor header differs from the one flash_attention.c was written for"
    if not _agrees_with_ggml(lib):
        return None, "its bits differ from ggml's flash attention here (another compiler's rounding)"
    return lib, ""


def available() -> tuple[bool, str]:
    """Whether the kernel is built, checked and loaded here, and if not, why. Raises TandemError for a
    TANDEM_CPU_FLASH_KERNEL value it does not know."""
    lib, why = _library()
    return lib is not None, why


def takes(n_queries: int, n_keys: int, k: Tensor, v: Tensor, n_heads: int, mask: Tensor | None) -> bool:
    """Whether a FLASH_ATTN_EXT node of n_queries rows over these keys and values [D, n_keys, G] is this kernel's:
    one row over MIN_KEYS keys or more, or MIN_ROWS rows and more."""
    kc, vc = k.contents, v.contents
    dk, dv, groups = kc.ne[0], vc.ne[0], kc.ne[2]
    return (
        ((n_queries == 1 and n_keys >= MIN_KEYS) or n_queries >= MIN_ROWS)
        and kc.type == ggml.GGML_TYPE_F16 and vc.type == ggml.GGML_TYPE_F16
        and kc.nb[0] == 2 and vc.nb[0] == 2 and kc.ne[3] == 1 and vc.ne[2] == groups
        and dk % 64 == 0 and dv % 64 == 0 and dk <= MAX_D and dv <= MAX_D
        and n_heads % groups == 0 and n_heads // groups <= MAX_GROUP
        and (mask is None or (mask.contents.type == ggml.GGML_TYPE_F16 and mask.contents.ne[2] == 1))
        and _library()[0] is not None
    )  # fmt: skip


def attention(
    ctx: int, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, sinks: Tensor | None,
    n_threads: int, keep: list[object], lib: ctypes.CDLL | None = None,
) -> Tensor:  # fmt: skip
    """The nodes computing what ggml_flash_attn_ext(ctx, q, k, v, mask, scale, 0, 0) (and its sinks) computes for
    queries q [Dk, N, H] -> [Dv, H, N], in graphs run with at most n_threads threads; keep holds the scale's memory
    as long as the graph lives. lib: another build of the kernel (tests), else this machine's."""
    if lib is None:
        lib = _library()[0]
        assert lib is not None, "attention() without takes()"
    box = ctypes.c_float(scale)
    keep.append(box)
    args = (_TensorArray * 5)()
    for i, t in enumerate((q, k, v, mask, sinks)):
        if t is not None:
            args[i] = t
    dv, rows, heads, f32 = v.contents.ne[0], q.contents.ne[1], q.contents.ne[2], ggml.GGML_TYPE_F32
    scale_at = ctypes.cast(ctypes.pointer(box), ctypes.c_void_p)
    # n_tasks -1: every thread of the graph, as ggml's own node (a decode row's chunks of keys are by their number)
    if rows > 1:
        return ggml.ggml_custom_4d(ctx, f32, dv, heads, rows, 1, args, 5, _op(lib.flash_prefill), -1, scale_at)
    partials = ggml.ggml_custom_4d(ctx, f32, 2 + dv, heads, n_threads, 1, args, 5, _op(lib.flash_decode_partials), -1,
                                   scale_at)  # fmt: skip
    merged = (_TensorArray * 1)(partials)
    return ggml.ggml_custom_4d(ctx, f32, dv, heads, 1, 1, merged, 1, _op(lib.flash_decode_merge), -1, None)


def _op(function: ctypes._CFuncPtr) -> ggml.ggml_custom_op_t:
    """A C function of the library as ggml's custom-op callback (called on ggml's threads, no Python between)."""
    return ggml.ggml_custom_op_t(ctypes.cast(function, ctypes.c_void_p).value)


def _agrees_with_ggml(lib: ctypes.CDLL) -> bool:
    """Random cases of both paths (GQA, some keys masked, sinks, 3 threads: one query row over 700 keys, 70 causal
    rows over 600) through ggml's node and the kernel's: True when every output is the same bits."""
    return all(_same_bits(lib, rows, n) for rows, n in ((1, 700), (70, 600)))


def _same_bits(lib: ctypes.CDLL, rows: int, n: int) -> bool:
    d, heads, groups, threads = 128, 4, 2, 3
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=32 << 20, mem_buffer=None, no_alloc=False))
    if not ctx:
        raise MemoryError("ggml_init failed")
    try:
        rng = np.random.default_rng(rows)
        mask = np.where(rng.random((rows, n)) < 0.2, -np.inf, 0.0).astype(np.float16)
        mask[np.arange(rows)[:, None] < np.arange(n)[None, :] - (n - rows)] = -np.inf  # causal over the last rows
        arrays = {
            "q": (rng.standard_normal((heads, rows, d)) * 2).astype(np.float32),
            "k": (rng.standard_normal((groups, n, d)) * 2).astype(np.float16),
            "v": rng.standard_normal((groups, n, d)).astype(np.float16),
            "mask": mask,
            "sinks": rng.standard_normal(heads).astype(np.float32),
        }
        types = {np.dtype(np.float32): ggml.GGML_TYPE_F32, np.dtype(np.float16): ggml.GGML_TYPE_F16}
        t = {}
        for name, a in arrays.items():
            ne = a.shape[::-1]
            t[name] = getattr(ggml, f"ggml_new_tensor_{len(ne)}d")(ctx, types[a.dtype], *ne)
            ctypes.memmove(ggml.ggml_get_data(t[name]), a.ctypes.data, a.nbytes)
        scale = 0.125
        ref = ggml.ggml_flash_attn_ext(ctx, t["q"], t["k"], t["v"], t["mask"], scale, 0.0, 0.0)
        ggml.ggml_flash_attn_ext_add_sinks(ref, t["sinks"])
        keep: list[object] = []
        out = attention(ctx, t["q"], t["k"], t["v"], t["mask"], scale, t["sinks"], threads, keep, lib)
        results = []
        for node in (ref, out):
            graph = ggml.ggml_new_graph(ctx)
            ggml.ggml_build_forward_expand(graph, node)
            ggml.ggml_graph_compute_with_ctx(ctx, graph, threads)
            pointer = ctypes.cast(ggml.ggml_get_data(node), ctypes.POINTER(ctypes.c_uint32))
            results.append(np.ctypeslib.as_array(pointer, shape=(heads * rows * d,)).copy())
        return bool(np.array_equal(*results))
    finally:
        ggml.ggml_free(ctx)
