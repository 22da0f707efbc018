"""Where a run's VRAM goes: the driver's used memory, torch's caching allocator and the plan, stage by stage, and
the allocator's segments grouped by the Python line that made them.

    python bench/vram_breakdown.py MODEL.gguf [--cpu-moe] [--pcie-experts K] [--seqs 16] [--pp 128] [--tg 16]
                                   [--ctx 256 --batch 2048 --ubatch 512]

--ctx/--batch/--ubatch: a slot's context, -b and -ub, as a server runs with them (`tandem serve -np 16 -c 256 -b 2048
-ub 512` against llama-server's defaults; default: pp + tg, 512, -b).

Stages: after load, after one sequence's prefill and decode, after N sequences at once (bench's run_concurrent).
At each: the driver's used memory over what it was before this process touched the GPU, torch's reserved and
allocated bytes and its allocated peak; the gap between the driver and torch's reserved is what torch does not
allocate (the CUDA context and its modules, cuBLAS handles, host-mapped memory's bookkeeping, graph executables).
The first stage, "context", is a bare CUDA context with torch's allocator touched: what any torch process pays
before tandem loads anything. Each stage also gives the context's per-thread stack (cuCtxGetLimit): the driver
keeps local memory for that many bytes times every thread the GPU can hold, and grows it for good when a kernel
that needs more is launched. Then the plan's figures (weights, KV pool, workspace, staging window, expert cache)
and torch's segments by memory pool (the default one, or a CUDA graph's) and by the first frame inside tandem of
the allocation that made them. tandem gives torch's allocator expandable segments unless PYTORCH_CUDA_ALLOC_CONF
is set: run it again with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False to see what fixed segments cost. For
the gap between tandem's batched `--cpu-moe` runs and llama.cpp's (docs/PERFORMANCE.md, sessions 15 and 34).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import time
from typing import Any

import torch

from tandem import LLM
from tandem.bench.runner import run_concurrent, time_prefill_decode
from tandem.bench.vram import VramSampler, _open_source
from tandem.runtime.devices import prefer_expandable_segments

MIB = 2**20


def _where(frames: list[dict[str, Any]]) -> str:
    """The innermost frame in tandem's code (else the innermost Python frame) of an allocation's stack."""
    for fr in frames:
        if "/tandem/" in fr.get("filename", ""):
            return f"{fr['filename'].split('/tandem/', 1)[1]}:{fr['line']} {fr['name']}"
    return next((f"{fr['filename']}:{fr['line']} {fr['name']}" for fr in frames if fr.get("filename")), "?")


def _stack_bytes() -> int | None:
    """The current context's per-thread stack limit (CU_LIMIT_STACK_SIZE), or None without the driver library."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    value = ctypes.c_size_t()
    return value.value if cuda.cuCtxGetLimit(ctypes.byref(value), 0) == 0 else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--cpu-moe", action="store_true")
    p.add_argument("--pcie-experts", type=int, default=0)
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--pp", type=int, default=128)
    p.add_argument("--tg", type=int, default=16)
    p.add_argument("-t", "--threads", type=int, default=16)
    p.add_argument("--ctx", type=int, help="a slot's context (default: pp + tg)")
    p.add_argument("--batch", type=int, default=512, help="-b: the tokens a step schedules")
    p.add_argument("--ubatch", type=int, help="-ub: the tokens one computation takes (default: -b)")
    args = p.parse_args()

    prefer_expandable_segments()  # as tandem.LLM does, before this script's own first CUDA call
    driver = _open_source()
    baseline = driver.used() if driver is not None else None  # before this process's CUDA context
    sampler = VramSampler().start()
    torch.cuda.memory._record_memory_history(max_entries=200_000, context="all", stacks="python")
    n_ctx = args.ctx or args.pp + args.tg
    print(f"{args.model}: --cpu-moe {args.cpu_moe}, --pcie-experts {args.pcie_experts}, {args.seqs} slots of "
          f"{n_ctx} tokens, -b {args.batch} -ub {args.ubatch or args.batch}")  # fmt: skip
    print(f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r}")
    print(
        "| stage | s | driver MiB | torch reserved | allocated | peak allocated | peak reserved | driver - reserved "
        "| stack B/thread |"
    )
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    t0 = time.perf_counter()

    def stage(name: str) -> None:  # printed at once: a run cut short still says how far it got
        torch.cuda.synchronize()
        used = None if driver is None or baseline is None else driver.used() - baseline
        res = torch.cuda.memory_reserved()
        u, gap = ("—", "—") if used is None else (f"{used / MIB:,.0f}", f"{(used - res) / MIB:,.0f}")
        print(f"| {name} | {time.perf_counter() - t0:.0f} | {u} | {res / MIB:,.0f} | "
              f"{torch.cuda.memory_allocated() / MIB:,.0f} | {torch.cuda.max_memory_allocated() / MIB:,.0f} | "
              f"{torch.cuda.max_memory_reserved() / MIB:,.0f} | {gap} | {_stack_bytes()} |", flush=True)  # fmt: skip

    torch.empty(1, device="cuda")
    stage("context")
    llm = LLM(args.model, device="cuda", threads=args.threads, n_ctx=n_ctx, n_parallel=args.seqs, n_batch=args.batch,
              n_ubatch=args.ubatch, cpu_moe=args.cpu_moe, pcie_experts=args.pcie_experts)  # fmt: skip
    stage("loaded")
    plan = llm.plan
    gpu = plan.compute_device
    print(f"plan: weights {plan.weight_bytes.get(gpu, 0) / MIB:,.0f} MiB, KV pool {plan.kv_bytes / MIB:,.0f}, "
          f"workspace {plan.workspace_bytes / MIB:,.0f}, staging window {plan.staging_bytes / MIB:,.0f}, "
          f"expert cache {plan.expert_cache.bytes / MIB:,.0f}; total {plan.gpu_bytes() / MIB:,.0f} MiB",
          flush=True)  # fmt: skip

    time_prefill_decode(llm, args.pp, args.tg, seed=0)
    stage("one sequence")
    run_concurrent(llm, [args.seqs], args.pp, args.tg, 1)
    stage(f"{args.seqs} sequences")
    peak = sampler.stop()
    if peak.used_bytes is not None:
        print(f"driver peak over baseline (what bench reports): {peak.used_bytes / MIB:,.0f} MiB")
    snap = torch.cuda.memory._snapshot()
    by_site: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    by_pool: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for seg in snap["segments"]:
        frames = seg.get("frames") or next((b.get("frames") for b in seg["blocks"] if b.get("frames")), [])
        site = by_site[f"stream {seg['stream']} {_where(frames)}"]
        site[0] += seg["total_size"]
        site[1] += 1
        pool_id = tuple(seg.get("segment_pool_id", (0, 0)))
        pool = by_pool["default" if pool_id == (0, 0) else f"graph pool {pool_id}"]
        pool[0] += seg["total_size"]
        pool[1] += seg["allocated_size"]
        pool[2] += 1
    print("torch's segments by memory pool (MiB reserved, MiB allocated now, count):")
    for name, (size, used, n) in sorted(by_pool.items(), key=lambda kv: -kv[1][0]):
        print(f"  {size / MIB:9,.1f} {used / MIB:9,.1f} {n:4d}  {name}")
    print("torch's segments by where they were made (MiB, count):")
    for site, (size, n) in sorted(by_site.items(), key=lambda kv: -kv[1][0])[:20]:
        print(f"  {size / MIB:9,.1f} {n:4d}  {site}")
    llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
