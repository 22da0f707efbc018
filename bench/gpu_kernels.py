"""Time the GPU quantized kernels against the memory-bandwidth floor (run on the device).

python bench/gpu_kernels.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
import triton
from gguf import GGMLQuantizationType as Q

from tandem.cuda import qkernels as qk
from tandem.cuda.qlinear import GPUQuantWeight, _align_slots, _tile_rows, qmatmul, qmatmul_id

HBM_BYTES_PER_S = 4.0e12  # H200 measured copy rate is ~4.3 TB/s; the floor uses 4.0


def _weight(qtype: Q, shape: tuple[int, ...]) -> GPUQuantWeight:
    import sys

    sys.path.insert(0, "tests")
    from qblocks import random_blocks

    raw = random_blocks(qtype, shape, np.random.default_rng(0))
    return GPUQuantWeight(torch.from_numpy(raw.reshape(-1).copy()).cuda(), qtype, shape)


def _host_us(fn: Callable[[], object], calls: int = 50) -> float:
    """Host (launch) time per call, the GPU left to run behind: the part a prefill pays per product."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return host


def main() -> None:
    rows = []
    for qtype in (Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_0):
        w = _weight(qtype, (4096, 2048))
        for m in (1, 512):
            x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
            ms = triton.testing.do_bench(lambda: qmatmul(x, w), return_mode="median")  # noqa: B023
            floor = w.data.numel() / HBM_BYTES_PER_S * 1e3
            tflops = 2 * m * 4096 * 2048 / ms / 1e9
            rows.append((f"{qtype.name} 4096x2048", m, ms, floor, tflops))
    # Qwen3-30B-A3B-shaped experts: gate/up (Q4_K, x shared by a token's experts) and down (Q6_K, x per slot)
    for qtype, (e, n, k), per_slot in ((Q.Q4_K, (128, 768, 2048), False), (Q.Q6_K, (128, 2048, 768), True)):
        we = _weight(qtype, (e, n, k))
        for t in (1, 512):
            ids = torch.stack([torch.randperm(e, device="cuda")[:8] for _ in range(t)])
            x = (
                torch.randn(t, 8, k, device="cuda", dtype=torch.bfloat16)
                if per_slot
                else torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            )
            ms = triton.testing.do_bench(lambda: qmatmul_id(x, we, ids), return_mode="median")  # noqa: B023
            used = len(torch.unique(ids)) * we.expert_bytes
            name = f"{qtype.name} experts {e}x{n}x{k} top8"
            rows.append((name, t, ms, used / HBM_BYTES_PER_S * 1e3, 2 * t * 8 * n * k / ms / 1e9))
            if t > 1:  # the slot grouping alone (sort + one kernel), and the grouped GEMM's tuned shape
                flat, bm = ids.reshape(-1), _tile_rows(ids.numel(), e)
                ms = triton.testing.do_bench(lambda: _align_slots(flat, e, bm), return_mode="median")  # noqa: B023
                rows.append((f"  slot grouping (BM {bm})", t, ms, 0.0, 0.0))
                print(f"{name}, {t} rows: grouped GEMM config {qk._grouped_qmm.best_config}")
                print(f"{name}, {t} rows: host time per call {_host_us(lambda: qmatmul_id(x, we, ids)):.1f} us")  # noqa: B023
    print(f"{'kernel':34s} {'rows':>5s} {'ms':>8s} {'floor ms':>9s} {'TFLOP/s':>8s}")
    for name, m, ms, floor, tf in rows:
        print(f"{name:34s} {m:5d} {ms:8.4f} {floor:9.4f} {tf:8.2f}")


if __name__ == "__main__":
    main()
