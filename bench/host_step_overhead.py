"""What Python adds around ggml in a decode step's host op (runs anywhere: CPU only).

    python bench/host_step_overhead.py [--threads 2] [--calls 20000]

A `--cpu-moe` decode step calls, once per MoE layer, the function `CPUKernels.gated_experts_into` prepared
on the host op's fixed buffers: it points the layer's cached ggml graph at this layer's weights and buffers,
then computes it. Here the experts are tiny (8 experts of 32 x 64, Q8_0), so the graph's own compute is mostly
ggml's thread start and barriers; the prepared call is timed against `ggml_backend_graph_compute` of the
same graph called directly. The difference is the Python a host op runs per layer on top of ggml (the lock,
the pointer writes, the ctypes call), to set beside a layer's ~0.4 ms of expert products on the GPU machine.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from tandem.quant.expert_ffn import ExpertFFN
from tandem.quant.ggml_cpu import CPUKernels
from tandem.quant.ggml_weights import GGMLWeight


def _stack(e: int, n: int, k: int) -> GGMLWeight:
    block, type_size = GGML_QUANT_SIZES[Q.Q8_0]
    return GGMLWeight(np.zeros(e * n * (k // block) * type_size, np.uint8), Q.Q8_0, (e, n, k))


def _per_call_us(fn: object, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()  # type: ignore[operator]
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args()
    e, f, k, d, slots = 8, 32, 64, 64, 8
    ffn = ExpertFFN(down=_stack(e, d, f), glu="swiglu", gate=_stack(e, f, k), up=_stack(e, f, k))
    with CPUKernels(args.threads) as kernels:
        x, out = torch.zeros(1, k), torch.zeros(1, d)
        ids, weights = torch.zeros(1, slots, dtype=torch.int32), torch.zeros(1, slots)
        prepared = kernels.gated_experts_into(out, x, ffn, ids, weights)
        prepared()  # builds nothing more: the graph was built above; this warms the threads
        (graph,) = kernels._ffn_graphs.values()  # the one graph built for `prepared` (a private look, for timing)
        bare = lambda: kernels._compute(graph.graph)  # noqa: E731
        for fn in (prepared, bare):
            _per_call_us(fn, args.calls // 10)
        with_python, direct = _per_call_us(prepared, args.calls), _per_call_us(bare, args.calls)
    print(f"threads {args.threads}, {args.calls} calls each")
    print(f"prepared host-op call  {with_python:8.2f} us")
    print(f"graph compute alone    {direct:8.2f} us")
    print(f"Python around ggml     {with_python - direct:8.2f} us per layer")


if __name__ == "__main__":
    main()
