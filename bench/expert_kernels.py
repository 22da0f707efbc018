"""Selected experts in VRAM at decode batch sizes: `_qmv` (blocks read once per slot) against `_grouped_qmm`
(tiles of one expert's slots), the choice `qmatmul_id` makes by QMV_SLOTS_PER_EXPERT (run on the device).

    python bench/expert_kernels.py [--tokens 4,8,16,32,64,128] [--experts 128] [--active 8]

Shapes of Qwen3-30B-A3B's experts (gate/up 768 x 2048 Q4_K, down 2048 x 768 Q4_K and Q6_K), uniform random
routing; the blocks are random bytes (the time does not depend on their values). Prints microseconds per
product for each kernel and which one qmatmul_id picks.
"""

from __future__ import annotations

import argparse
import functools

import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES

from tandem.cuda import qlinear
from tandem.cuda.qlinear import GPUQuantWeight, qmatmul_id

SHAPES = [("gate/up", 768, 2048, Q.Q4_K), ("down", 2048, 768, Q.Q4_K), ("down", 2048, 768, Q.Q6_K)]


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,4,8,16,32", help="tokens per step, at most 32 (a decode step)")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--active", type=int, default=8)
    args = p.parse_args()
    dev = torch.device("cuda")
    chosen = qlinear.QMV_SLOTS_PER_EXPERT
    print(f"{'shape':>8} {'type':>5} {'tokens':>6} {'slots':>5} {'qmv us':>8} {'grouped us':>10}  picked")
    for name, n, k, qtype in SHAPES:
        block, size = GGML_QUANT_SIZES[qtype]
        data = torch.randint(0, 256, (args.experts * n * k // block * size,), dtype=torch.uint8, device=dev)
        # Finite scales: every byte pair read as f16 below 2 (the codes' bytes too, which only changes values).
        data &= 0x3B
        w = GPUQuantWeight(data, qtype, (args.experts, n, k))
        for t in (int(x) for x in args.tokens.split(",")):
            x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
            ids = torch.stack([torch.randperm(args.experts, device=dev)[: args.active] for _ in range(t)]).int()
            times = {}
            for kernel, rule in (("qmv", 1 << 30), ("grouped", 0)):
                qlinear.QMV_SLOTS_PER_EXPERT = rule
                small = t * args.active <= 2 * qlinear.QMV_MAX_ROWS
                run = functools.partial(qmatmul_id, x, w, ids)
                times[kernel] = _time_us(run) if kernel == "qmv" or not small else None
            qlinear.QMV_SLOTS_PER_EXPERT = chosen
            per_expert = t <= 2 * qlinear.QMV_MAX_ROWS and t * args.active <= chosen * args.experts
            picked = "qmv" if t * args.active <= 2 * qlinear.QMV_MAX_ROWS or per_expert else "grouped"
            grouped = f"{times['grouped']:10.1f}" if times["grouped"] is not None else f"{'-':>10}"
            print(f"{name:>8} {qtype.name:>5} {t:6d} {t * args.active:5d} {times['qmv']:8.1f} {grouped}  {picked}")


if __name__ == "__main__":
    main()
