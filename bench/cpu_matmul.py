"""Time ggml's CPU product on Q4_K blocks against torch on the dequantized float32 weight, and a row lookup.

    python bench/cpu_matmul.py [--threads 2] [--n 2048] [--k 2048]

Prints one row per case: median time per call, effective GFLOP/s and weight bytes read per second,
and the per-call overhead on a tiny matrix (where the arithmetic is negligible).
On a machine whose cores are busy with other work, run with OMP_WAIT_POLICY=PASSIVE: with the default
(spinning) policy ggml's OpenMP barriers wait out whole scheduler time slices.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from tandem.quant import ggml_cpu
from tandem.quant.dequant import dequantize_rows
from tandem.quant.ggml_cpu import CPUKernels
from tandem.quant.ggml_weights import GGMLWeight


def random_q4_k(n: int, k: int, rng: np.random.Generator) -> GGMLWeight:
    """Random Q4_K bytes whose f16 scales d and dmin (bytes 0..3 of each block) are finite."""
    block, size = GGML_QUANT_SIZES[Q.Q4_K]
    nb = n * k // block
    b = rng.integers(0, 256, (nb, size), dtype=np.uint8)
    b[:, 0:4] = (rng.uniform(0.5, 1.5, (nb, 2)) * 0.01).astype(np.float16).view(np.uint8)
    return GGMLWeight(b.reshape(-1), Q.Q4_K, (n, k))


def random_f32(n: int, k: int, rng: np.random.Generator) -> GGMLWeight:
    return GGMLWeight(rng.standard_normal(n * k).astype(np.float32).view(np.uint8), Q.F32, (n, k))


def median_time(fn: Callable[[], object], min_time: float = 0.3, min_reps: int = 5) -> float:
    """Median seconds per call, after a warm-up, over at least `min_reps` calls and `min_time` s."""
    for _ in range(3):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=2048)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    kernels = CPUKernels(args.threads)

    w = random_q4_k(args.n, args.k, rng)
    w_f32 = torch.from_numpy(dequantize(w.data.reshape(args.n, -1), Q.Q4_K))
    rows: list[tuple[str, str, float, str, str]] = []
    errors: list[str] = []  # ggml vs float64 x @ dequant(W).T: the Q8_K rounding of x
    for t in (1, 128):
        x = torch.randn(t, args.k)
        out = torch.empty(t, args.n)
        flops = 2.0 * t * args.n * args.k
        for name, fn, nbytes in (
            ("ggml Q4_K", lambda x=x, out=out: kernels.matmul(x, w, out=out), w.data.nbytes),
            ("torch f32", lambda x=x, out=out: torch.matmul(x, w_f32.T, out=out), w_f32.numel() * 4),
        ):
            s = median_time(fn)
            rows.append(
                (
                    f"{args.n}x{args.k} T={t}",
                    name,
                    s * 1e6,
                    f"{flops / s / 1e9:.1f}",
                    f"{nbytes / s / 1e9:.1f}",
                )
            )
        y, ref = kernels.matmul(x, w), x.double() @ w_f32.double().T
        errors.append(f"T={t}: {float((y - ref).norm() / ref.norm()):.1e}")

    # Per-call overhead: a 32x32 F32 product at T=1 is ~2 kFLOP, so the time is the fixed cost.
    tiny = random_f32(32, 32, rng)
    x1 = torch.randn(1, 32)
    out1 = torch.empty(1, 32)
    # The cached graph's data pointers now point at x1, out1 and tiny, which stay alive below: the
    # compute-only row reruns the graph as it is (it must never run with pointers to freed tensors).
    kernels.matmul(x1, tiny, out=out1)
    graph = next(g for key, g in kernels._graphs.items() if key[2:4] == (32, 32))
    backend = kernels._backend
    tiny_f32 = torch.from_numpy(tiny.data.view(np.float32).reshape(32, 32))
    overhead = (
        ("ggml_backend_graph_compute only", lambda: ggml_cpu._graph_compute(backend, graph.graph)),
        ("CPUKernels.matmul (out=)", lambda: kernels.matmul(x1, tiny, out=out1)),
        ("CPUKernels.matmul (fresh output)", lambda: kernels.matmul(x1, tiny)),
        ("torch x @ W.T", lambda: x1 @ tiny_f32.T),
    )
    for name, fn in overhead:
        rows.append(("32x32 T=1 (overhead)", name, median_time(fn) * 1e6, "", ""))
    # One token's embedding row from a Q4_K table in host RAM (the decode step's lookup, weights/loader.py).
    one = torch.tensor([7])
    lookups = (
        ("ggml get_rows", lambda: kernels.get_rows(w, one)),
        ("tandem dequantize_rows (torch)", lambda: dequantize_rows(torch.from_numpy(w.data), Q.Q4_K, w.shape, one)),
    )
    for name, fn in lookups:
        rows.append((f"{args.n}x{args.k} 1 row", name, median_time(fn) * 1e6, "", ""))
    kernels.close()

    # torch and ggml share one libgomp; its wait policy (read once, when it loads) decides whether a
    # thread spins or sleeps at a barrier, which matters a great deal when cores are shared.
    policy = os.environ.get("OMP_WAIT_POLICY", "unset")
    print(f"threads={args.threads}  torch {torch.__version__}  OMP_WAIT_POLICY={policy}")
    header = ("case", "impl", "us/call", "GFLOP/s", "GB/s weights")
    widths = (22, 34, 10, 9, 12)
    print("  ".join(h.ljust(wd) for h, wd in zip(header, widths, strict=True)))
    for case, impl, us, gflops, gbs in rows:
        print(
            "  ".join(
                v.ljust(wd) for v, wd in zip((case, impl, f"{us:.1f}", gflops, gbs), widths, strict=True)
            )
        )
    print("ggml relative error vs float64 reference:", ", ".join(errors))


if __name__ == "__main__":
    main()
