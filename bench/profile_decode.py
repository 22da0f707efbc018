"""Where a decode step spends its time (run on the device): per-token latency eager vs graphs, and the
top CUDA kernels of a few graph-less steps.

    python bench/profile_decode.py MODEL [--cpu-moe] [--n-cpu-moe N]
"""

from __future__ import annotations

import argparse
import time

import torch

import tandem


def _time(llm: tandem.LLM, n: int) -> float:
    engine = llm.engine
    engine.reset()
    logits = engine.feed(list(range(100, 164)))
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        logits = engine.append([int(torch.argmax(logits))])
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--cpu-moe", action="store_true")
    p.add_argument("--n-cpu-moe", type=int, default=0)
    p.add_argument("-t", "--threads", type=int, default=16)
    a = p.parse_args()
    flags = {"device": "cuda", "cpu_moe": a.cpu_moe, "n_cpu_moe": a.n_cpu_moe, "threads": a.threads, "n_ctx": 1024}
    for graphs in (False, True):
        with tandem.LLM(a.model, cuda_graphs=graphs, **flags) as llm:
            _time(llm, 3)
            print(f"graphs={graphs}: {_time(llm, 32):.2f} ms/token")
            if not graphs:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    _time(llm, 4)
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))


if __name__ == "__main__":
    main()
