"""Time the GPU quantized kernels against the memory-bandwidth floor (run on the device).

python bench/gpu_kernels.py
"""

from __future__ import annotations

import numpy as np
import torch
import triton
from gguf import GGMLQuantizationType as Q

from tandem.cuda.qlinear import GPUQuantWeight, qmatmul, qmatmul_id

HBM_BYTES_PER_S = 4.0e12  # H200 measured copy rate is ~4.3 TB/s; the floor uses 4.0


def _weight(qtype: Q, shape: tuple[int, ...]) -> GPUQuantWeight:
    import sys

    sys.path.insert(0, "tests")
    from qblocks import random_blocks

    raw = random_blocks(qtype, shape, np.random.default_rng(0))
    return GPUQuantWeight(torch.from_numpy(raw.reshape(-1).copy()).cuda(), qtype, shape)


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
    we = _weight(Q.Q4_K, (128, 768, 2048))
    for t in (1, 512):
        ids = torch.stack([torch.randperm(128, device="cuda")[:8] for _ in range(t)])
        x = torch.randn(t, 2048, device="cuda", dtype=torch.bfloat16)
        ms = triton.testing.do_bench(lambda: qmatmul_id(x, we, ids), return_mode="median")  # noqa: B023
        used = len(torch.unique(ids)) * we.expert_bytes
        rows.append(
            ("Q4_K experts 128x768x2048 top8", t, ms, used / HBM_BYTES_PER_S * 1e3, 2 * t * 8 * 768 * 2048 / ms / 1e9)
        )
    print(f"{'kernel':34s} {'rows':>5s} {'ms':>8s} {'floor ms':>9s} {'TFLOP/s':>8s}")
    for name, m, ms, floor, tf in rows:
        print(f"{name:34s} {m:5d} {ms:8.4f} {floor:9.4f} {tf:8.2f}")


if __name__ == "__main__":
    main()
