"""One decode step's routed-expert products through two builds of ggml's CPU backend, side by side.

    python bench/ggml_versions.py [--like qwen3-30b-a3b] [--threads 16] [--tokens 1] [--lib DIR ...] [--reps 200]

tandem computes CPU experts with ggml-python's bindings around the ggml of llama.cpp's tree (0.25.3,
scripts/build_ggml_python.sh; `--own-ggml` builds ggml-python's own 0.15.3), llama.cpp's `--cpu-moe` with its own
build of that ggml (llama-cpp-python 0.3.36): build flags may differ. This times the same
graph -- the gate, up and down `ggml_mul_mat_id` products of --tokens tokens (a batched decode step: one token
per sequence, each routed to its own `top_k` of the preset's experts),
Q4_K gate/up and a Q6_K down (the Q4_K_M mix's two down types: `--down Q4_K` for the other; Q8_0 where the
down rows are not a multiple of 256, llama-quantize's fallback) -- through each library's own C API, one
child process per library (two ggml builds cannot share a process), with the same weight bytes, the same
routes and `ggml_graph_compute_with_ctx` at the same thread count. Weights are random blocks with finite
scales, in the library's own (mapped-file-like, not repacked) CPU memory.

--lib takes a directory holding libggml-base.so and libggml-cpu.so; the default is ggml-python's and, where
found, llama-cpp-python's (`$TANDEM_LLAMACPP_LIB` or ~/.cache/tandem/peers/llama_cpp_{cuda,cpu}/llama_cpp/lib).
Prints one line per library: median and best µs per step over --reps computes, and the GB/s of weight bytes
read (the step's distinct experts x the three matrices, on average).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# (hidden, expert intermediate, experts, top-k): the routed-expert shapes of the synth presets
PRESETS = {
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen3.6-35b-a3b": (2048, 512, 256, 8),
    "gemma4-26b-a4b": (2816, 704, 128, 8),
}
GGML_F32, GGML_I32 = 0, 26
QUANT = {"Q8_0": 8, "Q4_K": 12, "Q6_K": 14}  # ggml type ids


def _blocks(name: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of a (rows, k) matrix with finite scales (the tests' generator, tests/qblocks.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from gguf import GGMLQuantizationType
    from qblocks import random_blocks

    return random_blocks(GGMLQuantizationType[name], (rows, k), rng).reshape(-1)


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def _child(lib_dir: str, spec: dict) -> dict:
    """In a fresh process: load the library, build the graph, time it."""
    base = ctypes.CDLL(os.path.join(lib_dir, "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(os.path.join(lib_dir, "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    base.ggml_init.restype, base.ggml_init.argtypes = vp, [_InitParams]
    base.ggml_new_tensor_2d.restype, base.ggml_new_tensor_2d.argtypes = vp, [vp, ctypes.c_int, i64, i64]
    base.ggml_new_tensor_3d.restype, base.ggml_new_tensor_3d.argtypes = vp, [vp, ctypes.c_int, i64, i64, i64]
    base.ggml_mul_mat_id.restype, base.ggml_mul_mat_id.argtypes = vp, [vp, vp, vp, vp]
    base.ggml_get_data.restype, base.ggml_get_data.argtypes = vp, [vp]
    base.ggml_nbytes.restype, base.ggml_nbytes.argtypes = ctypes.c_size_t, [vp]
    base.ggml_new_graph.restype, base.ggml_new_graph.argtypes = vp, [vp]
    base.ggml_build_forward_expand.argtypes = [vp, vp]
    cpu.ggml_graph_compute_with_ctx.restype = ctypes.c_int
    cpu.ggml_graph_compute_with_ctx.argtypes = [vp, vp, ctypes.c_int]
    if hasattr(cpu, "ggml_cpu_init"):
        cpu.ggml_cpu_init()

    hidden, inter, experts, top_k = spec["shape"]
    rng = np.random.default_rng(0)
    gate, up = (_blocks("Q4_K", experts * inter, hidden, rng) for _ in range(2))
    down = _blocks(spec["down"], experts * hidden, inter, rng)
    # The weights, then room for the graph and the work buffer (ggml 0.25.3 wanted more than 1 GiB at 16 threads).
    ctx = base.ggml_init(_InitParams(gate.nbytes * 2 + down.nbytes + (2 << 30), None, False))

    def tensor3(qtype: int, ne0: int, ne1: int, ne2: int, data: np.ndarray) -> int:
        t = base.ggml_new_tensor_3d(ctx, qtype, ne0, ne1, ne2)
        assert base.ggml_nbytes(t) == data.nbytes
        ctypes.memmove(base.ggml_get_data(t), data.ctypes.data, data.nbytes)
        return t

    w_gate = tensor3(QUANT["Q4_K"], hidden, inter, experts, gate)
    w_up = tensor3(QUANT["Q4_K"], hidden, inter, experts, up)
    w_down = tensor3(QUANT[spec["down"]], inter, hidden, experts, down)
    tokens = spec["tokens"]
    x = tensor3(GGML_F32, hidden, 1, tokens, rng.standard_normal(hidden * tokens).astype(np.float32))
    ids = base.ggml_new_tensor_2d(ctx, GGML_I32, top_k, tokens)
    # Fresh routes per compute, as in decode (a new layer's experts each time): the same experts again would be
    # read from the cache. Each token picks its own top_k, uniformly.
    routes = [
        np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32) for _ in range(64)
    ]

    def route(i: int) -> None:
        ctypes.memmove(base.ggml_get_data(ids), routes[i % len(routes)].ctypes.data, 4 * top_k * tokens)

    route(0)
    g = base.ggml_mul_mat_id(ctx, w_gate, x, ids)  # [inter, top_k, tokens]
    u = base.ggml_mul_mat_id(ctx, w_up, x, ids)
    out = base.ggml_mul_mat_id(ctx, w_down, g, ids)  # g's rows are per slot: each goes to its own expert
    graph = base.ggml_new_graph(ctx)
    base.ggml_build_forward_expand(graph, u)
    base.ggml_build_forward_expand(graph, out)
    threads = spec["threads"]
    for i in range(10):
        route(i)
        assert cpu.ggml_graph_compute_with_ctx(ctx, graph, threads) == 0
    times = []
    for i in range(spec["reps"]):
        route(i)
        start = time.perf_counter()
        cpu.ggml_graph_compute_with_ctx(ctx, graph, threads)
        times.append(time.perf_counter() - start)
    distinct = float(np.mean([len(np.unique(r)) for r in routes]))
    weight_bytes = distinct * (2 * gate.nbytes + down.nbytes) / experts
    median = statistics.median(times)
    return {
        "median_us": median * 1e6,
        "best_us": min(times) * 1e6,
        "gb_s": weight_bytes / median / 1e9,
        "distinct": distinct,
    }


def _default_libs() -> list[str]:
    import ggml

    libs = [os.path.join(os.path.dirname(ggml.__file__), "lib")]
    env = os.environ.get("TANDEM_LLAMACPP_LIB")
    peers = Path.home() / ".cache" / "tandem" / "peers"
    for cand in ([Path(env)] if env else []) + [peers / "llama_cpp_cuda", peers / "llama_cpp_cpu"]:
        if (cand / "llama_cpp" / "lib" / "libggml-cpu.so").exists():
            libs.append(str(cand / "llama_cpp" / "lib"))
            break
    return libs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--like", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    parser.add_argument("--down", default="Q6_K", choices=sorted(QUANT))
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=1, help="tokens of the step, each with its own routes")
    parser.add_argument("--lib", action="append", help="a directory with libggml-base.so and libggml-cpu.so")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        lib_dir, spec = json.loads(args.child)
        print(json.dumps(_child(lib_dir, spec)))
        return 0
    down = args.down
    if down.endswith("_K") and PRESETS[args.like][1] % 256:  # rows of 256 do not fit: llama-quantize's fallback
        down = "Q8_0"
    if args.tokens < 1:
        parser.error("--tokens must be at least 1")
    spec = {"shape": PRESETS[args.like], "down": down, "threads": args.threads, "reps": args.reps,
            "tokens": args.tokens}  # fmt: skip
    print(f"{args.like}: {args.tokens} token(s), top-{spec['shape'][3]} of {spec['shape'][2]} experts, gate/up Q4_K, "
          f"down {down}, {args.threads} threads, {args.reps} computes")  # fmt: skip
    for lib_dir in args.lib or _default_libs():
        proc = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps([lib_dir, spec])], capture_output=True, text=True
        )
        if proc.returncode != 0:
            print(f"  {lib_dir}: failed: {proc.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        print(
            f"  {lib_dir}: {r['median_us']:.0f} µs median, {r['best_us']:.0f} best, {r['gb_s']:.1f} GB/s "
            f"({r['distinct']:.1f} distinct experts)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
