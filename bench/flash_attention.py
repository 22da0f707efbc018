"""Flash attention on the CPU: ggml's FLASH_ATTN_EXT node against tandem's kernel (tandem.quant.flash_attention), on
random f16 keys and values.

    python bench/flash_attention.py [--shape 128,32,4] [--rows 1,512] [--keys 512,1024,3072,8192] [--threads 1,2,16]
                                    [--reps 30]

--shape: head size, query heads, key heads (Qwen3-30B-A3B's 128,32,4 by default); --rows: query rows (1: a decode
step; 64 and more: a prompt chunk, the last of the keys' positions, causal). For each row count, key count and
thread count both graphs run taking turns (3 warm-ups, then --reps computes each); prints µs per compute (medians),
the ratio and whether every output bit agreed.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import ggml
import numpy as np

from tandem.quant import flash_attention


def tensor(ctx: int, a: np.ndarray) -> ggml.ggml_tensor_p:
    gtype = ggml.GGML_TYPE_F32 if a.dtype == np.float32 else ggml.GGML_TYPE_F16
    ne = a.shape[::-1]
    t = getattr(ggml, f"ggml_new_tensor_{len(ne)}d")(ctx, gtype, *ne)
    ctypes.memmove(ggml.ggml_get_data(t), a.ctypes.data, a.nbytes)
    return t


def measure(d: int, heads: int, groups: int, rows: int, n: int, threads: int, reps: int) -> tuple[float, float, bool]:
    size = (64 << 20) + 4 * d * n * groups + 2 * rows * n + 12 * rows * d * heads
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=False))
    try:
        rng = np.random.default_rng(0)
        q = tensor(ctx, rng.standard_normal((heads, rows, d)).astype(np.float32))
        k = tensor(ctx, rng.standard_normal((groups, n, d)).astype(np.float16))
        v = tensor(ctx, rng.standard_normal((groups, n, d)).astype(np.float16))
        causal = np.arange(rows)[:, None] < np.arange(n)[None, :] - (n - rows)
        mask = tensor(ctx, np.where(causal, -np.inf, 0.0).astype(np.float16))
        scale = d**-0.5
        nodes = (ggml.ggml_flash_attn_ext(ctx, q, k, v, mask, scale, 0.0, 0.0),
                 flash_attention.attention(ctx, q, k, v, mask, scale, None, threads, keep := []))  # fmt: skip
        graphs = []
        for node in nodes:
            graph = ggml.ggml_new_graph(ctx)
            ggml.ggml_build_forward_expand(graph, node)
            graphs.append(graph)
        times: list[list[float]] = [[], []]
        for i in range(reps + 3):
            for j, graph in enumerate(graphs):
                t0 = time.perf_counter()
                ggml.ggml_graph_compute_with_ctx(ctx, graph, threads)
                if i >= 3:
                    times[j].append(time.perf_counter() - t0)
        outs = [np.ctypeslib.as_array(ctypes.cast(ggml.ggml_get_data(node), ctypes.POINTER(ctypes.c_uint32)),
                                      shape=(heads * rows * d,)).copy() for node in nodes]  # fmt: skip
        del keep
        return statistics.median(times[0]) * 1e6, statistics.median(times[1]) * 1e6, bool(np.array_equal(*outs))
    finally:
        ggml.ggml_free(ctx)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="128,32,4")
    p.add_argument("--rows", default="1,512")
    p.add_argument("--keys", default="512,1024,3072,8192")
    p.add_argument("--threads", default="1,2,16")
    p.add_argument("--reps", type=int, default=30)
    a = p.parse_args()
    ok, why = flash_attention.available()
    if not ok:
        raise SystemExit(f"tandem's kernel is not used here: {why}")
    d, heads, groups = (int(x) for x in a.shape.split(","))
    print("| rows | keys | threads | ggml µs | tandem µs | ggml / tandem | same bits |")
    print("|---|---|---|---|---|---|---|")
    for rows in (int(x) for x in a.rows.split(",")):
        for n in (int(x) for x in a.keys.split(",")):
            for threads in (int(x) for x in a.threads.split(",")):
                ggml_us, ours_us, same = measure(d, heads, groups, rows, n, threads, a.reps)
                ratio = ggml_us / ours_us
                print(f"| {rows} | {n} | {threads} | {ggml_us:,.0f} | {ours_us:,.0f} | {ratio:.2f}× | {same} |")


if __name__ == "__main__":
    main()
