"""Selected experts in VRAM at decode batch sizes: `_qmv` (blocks read once per slot) against `_grouped_qmm`
(tiles of one expert's slots), the choice `qmatmul_id` makes by QMV_SLOTS_PER_EXPERT (run on the device).

    python bench/expert_kernels.py [--tokens 4,8,16,32,64,128] [--shapes qwen3-30b|qwen3.6] [--active 8] [--sweep]
        [--dense]

Shapes of a model's experts (qwen3-30b: 128 experts, gate/up 768 x 2048 Q4_K, down 2048 x 768 Q4_K and Q6_K;
qwen3.6: 256 experts of 512 x 2048 and 2048 x 512), uniform random routing; the blocks are random bytes (the time
does not depend on their values). Prints microseconds per product for each kernel and which one qmatmul_id picks.

--sweep: instead, `_qmv` alone at every launch configuration its layout allows for the type (the autotuner's
candidates, and more rows a program over fewer superblocks a step, for a short K such as Qwen3.6's down: K = 512 is
two superblocks a row), each checked against the autotuned result, with the rate at which it reads the distinct
experts' blocks; the autotuner's pick is marked.

--dense: first, a dense product that fits in L2 and the output head at each row count by each of `qmatmul`'s
kernels (`_qmv`, one tile of `_grouped_qmm`, bounded dequantized slices into cuBLAS), and the one it takes.
"""

from __future__ import annotations

import argparse
import functools
import math

import torch
import triton
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES

from tandem.cuda import qkernels, qlinear
from tandem.cuda.qlinear import GPUQuantWeight, qmatmul_id

# model -> (experts, [(name, N, K, type)])
SHAPES = {
    "qwen3-30b": (128, [("gate/up", 768, 2048, Q.Q4_K), ("down", 2048, 768, Q.Q4_K), ("down", 2048, 768, Q.Q6_K)]),
    "qwen3.6": (256, [("gate/up", 512, 2048, Q.Q4_K), ("down", 2048, 512, Q.Q4_K), ("down", 2048, 512, Q.Q6_K)]),
}
# model -> dense products of a decode step (--dense): one that fits in L2 and the output head, which does not
DENSE = {
    "qwen3-30b": [("q", 4096, 2048, Q.Q4_K), ("output", 151936, 2048, Q.Q6_K)],
    "qwen3.6": [("q", 4096, 2048, Q.Q4_K), ("output", 248320, 2048, Q.Q6_K)],
}
# (BN rows a program, SB superblocks a step, warps): the autotuner's candidates and a few more rows over two
# superblocks; `_qmv`'s layout takes those whose values per thread (BN * SB * 8 / warps) suit the type.
SWEEP = sorted(set(qkernels.QMV_SHAPES) | {(bn, 2, w) for bn in (2, 4, 8, 16) for w in (1, 2, 4)})


def _time_us(fn, reps: int = 50) -> float:  # type: ignore[no-untyped-def]
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def sweep(w: GPUQuantWeight, x: torch.Tensor, ids: torch.Tensor, label: str) -> None:
    """`_qmv` at each configuration of SWEEP its layout takes for w's type, against the autotuned launch."""
    _, n, k = w.shape
    qt = int(w.qtype)
    flat = ids.reshape(-1).contiguous()
    r, x_div = flat.numel(), ids.shape[1]
    y = torch.empty(r, n, dtype=x.dtype, device=x.device)
    tier = qlinear.qmv_rows_tier(r)
    args = (w.data, x, y, flat, n, k, w.row_bytes, w.expert_bytes, x_div, x.stride(0), y.stride(0), tier)
    ref = qmatmul_id(x, w, ids).reshape(r, n)  # the autotuned launch (qmatmul_id takes `_qmv` at these sizes)
    scale = ref.float().abs().max().item()  # outputs are rounded to x's type: differences relative to the largest
    best = next((c for key, c in qkernels._qmv.cache.items() if key[:5] == (n, k, qt, True, tier)), None)
    distinct = torch.unique(flat).numel() * w.expert_bytes
    allowed = qkernels._QMV_VALUES[w.qtype]
    for bn, sb, warps in SWEEP:
        if bn * sb * 8 // warps not in allowed:
            continue

        def run(bn: int = bn, sb: int = sb, warps: int = warps) -> None:
            grid = (triton.cdiv(n, bn), r)
            qkernels._qmv.fn[grid](*args, QT=qt, HAS_IDS=True, BN=bn, SB=sb, num_warps=warps)

        us = _time_us(run)
        err = (y.float() - ref.float()).abs().max().item() / scale
        picked = best is not None and (best.kwargs["BN"], best.kwargs["SB"], best.num_warps) == (bn, sb, warps)
        print(
            f"{label} BN {bn:2d} SB {sb:2d} warps {warps}: {us:8.1f} us  {distinct / us / 1e3:7.1f} GB/s distinct"
            f"  max|diff|/max|y| {err:.1e}{'  <- autotuned' if picked else ''}"
        )


def dense(shapes: list[tuple[str, int, int, Q]], tokens: list[int], dev: torch.device) -> None:
    """Dense products at decode row counts by each of `qmatmul`'s kernels (`_qmv`, one tile of `_grouped_qmm` up
    to GQMM_MAX_BM rows, bounded dequantized slices into cuBLAS), and the one `qmatmul` takes."""
    kernels = list(qlinear.DENSE_PRODUCTS)
    print(f"{'shape':>8} {'N x K':>14} {'type':>5} {'rows':>4} " + " ".join(f"{k + ' us':>10}" for k in kernels)
          + "  picked")  # fmt: skip
    for name, n, k, qtype in shapes:
        w = _random_weight(qtype, (n, k), dev)
        for t in tokens:
            x = torch.randn(t, k, device=dev, dtype=torch.float32)
            cells = []
            for kernel, product in qlinear.DENSE_PRODUCTS.items():
                fits = kernel != "grouped" or t <= qlinear.GQMM_MAX_BM
                us = _time_us(functools.partial(product, x, w, False)) if fits else None
                cells.append(f"{us:10.1f}" if us is not None else f"{'-':>10}")
            picked = qlinear.dense_kernel(t, w)
            print(f"{name:>8} {f'{n}x{k}':>14} {qtype.name:>5} {t:4d} {' '.join(cells)}  {picked}")


def _random_weight(qtype: Q, shape: tuple[int, ...], dev: torch.device) -> GPUQuantWeight:
    block, size = GGML_QUANT_SIZES[qtype]
    data = torch.randint(0, 256, (math.prod(shape) // block * size,), dtype=torch.uint8, device=dev)
    # Finite scales: every byte pair read as f16 below 2 (the codes' bytes too, which only changes values).
    data &= 0x3B
    return GPUQuantWeight(data, qtype, shape)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,4,8,16,32", help="tokens per step, at most 32 (a decode step)")
    p.add_argument("--shapes", choices=sorted(SHAPES), default="qwen3-30b")
    p.add_argument("--experts", type=int, default=None, help="default: the model's")
    p.add_argument("--active", type=int, default=8)
    p.add_argument("--sweep", action="store_true", help="_qmv alone at each launch configuration")
    p.add_argument("--dense", action="store_true", help="also the dense products (output head) by each kernel")
    args = p.parse_args()
    dev = torch.device("cuda")
    if args.dense:
        dense(DENSE[args.shapes], [int(x) for x in args.tokens.split(",")], dev)
    chosen = qlinear.QMV_SLOTS_PER_EXPERT
    n_experts, shapes = SHAPES[args.shapes]
    n_experts = args.experts or n_experts
    if not args.sweep:
        print(f"{'shape':>8} {'type':>5} {'tokens':>6} {'slots':>5} {'qmv us':>8} {'grouped us':>10}  picked")
    for name, n, k, qtype in shapes:
        w = _random_weight(qtype, (n_experts, n, k), dev)
        for t in (int(x) for x in args.tokens.split(",")):
            x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
            ids = torch.stack([torch.randperm(n_experts, device=dev)[: args.active] for _ in range(t)]).int()
            if args.sweep:
                sweep(w, x, ids, f"{name} {n}x{k} {qtype.name} T={t}")
                continue
            times = {}
            for kernel, rule in (("qmv", 1 << 30), ("grouped", 0)):
                qlinear.QMV_SLOTS_PER_EXPERT = rule
                small = t * args.active <= 2 * qlinear.QMV_MAX_ROWS
                run = functools.partial(qmatmul_id, x, w, ids)
                times[kernel] = _time_us(run) if kernel == "qmv" or not small else None
            qlinear.QMV_SLOTS_PER_EXPERT = chosen
            per_expert = t <= 2 * qlinear.QMV_MAX_ROWS and t * args.active <= chosen * n_experts
            picked = "qmv" if t * args.active <= 2 * qlinear.QMV_MAX_ROWS or per_expert else "grouped"
            grouped = f"{times['grouped']:10.1f}" if times["grouped"] is not None else f"{'-':>10}"
            print(f"{name:>8} {qtype.name:>5} {t:6d} {t * args.active:5d} {times['qmv']:8.1f} {grouped}  {picked}")


if __name__ == "__main__":
    main()
