"""One tandem benchmark process for one placement: load, warm up once, time every repetition.

    python -m tandem.bench.worker -m MODEL [placement flags] --pp 512,2048 --tg 128 --reps 3 -t 16 --seed 0

The orchestrator (compare.py) starts one of these per engine x placement; it runs all the repetitions, so
the load and the warm-up (Triton's compiles and autotuning, CUDA graphs, weights paged in) are paid once.
Timing protocol, the same as llamacpp_worker.py's:
  warm-up   once per process: one prefill of min(pp, n_batch) tokens for each --pp size, then 4 decode
            steps (untimed);
  pp        per repetition r and --pp size: clear the KV cache, prefill `pp` random token ids
            (protocol.prompt_ids, seed + r);
  tg        right after the first --pp prefill, `tg` greedy decode steps (depth = first pp size).
Each repetition's result is printed (protocol.REP_MARKER) as soon as it is measured, the whole run's at
the end (protocol.RESULT_MARKER). --deadline (a time.time() value, from the orchestrator's --budget) stops
it starting a repetition that would end past it, after the first.
Exit status 0 with a result line, else non-zero with the error on stderr.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Sequence
from typing import Any

from tandem.bench.protocol import (
    emit_result,
    exit_worker,
    maybe_inject,
    peak_rss_bytes,
    prompt_ids,
    run_result,
    timed_reps,
)
from tandem.cli.main import int_list


def build_parser() -> argparse.ArgumentParser:
    # The model and placement flags are tandem's own, so the worker reads a placement exactly as `tandem` does.
    from tandem.cli.main import _add_model_flags

    p = argparse.ArgumentParser(prog="python -m tandem.bench.worker", description=__doc__)
    _add_model_flags(p)
    p.add_argument("--pp", type=int_list, default=[128], help="prompt sizes, comma-separated")
    p.add_argument("--tg", type=int, default=64, help="decode steps")
    p.add_argument("--reps", type=int, default=1, help="timed repetitions in this process")
    p.add_argument("--seed", type=int, default=0, help="first prompt seed (repetition r uses seed + r)")
    p.add_argument("--deadline", type=float, default=None, help="time.time() after which no repetition starts")
    return p


def _greedy(logits: Any) -> int:
    """The argmax of a step's logits: numpy's on the CPU, as the llama.cpp worker takes it (torch's CPU argmax
    takes ~0.4 ms over a 262k vocabulary, numpy's ~0.02), torch's on a GPU (reading it back ends the step)."""
    import numpy as np
    import torch

    return int(np.argmax(logits.numpy())) if logits.device.type == "cpu" else int(torch.argmax(logits))


def _time_rep(llm: Any, pp_sizes: Sequence[int], tg: int, seed: int, sync: Any) -> tuple[dict[int, float], float]:
    engine = llm.engine
    n_vocab = llm.config.n_vocab
    pp_s: dict[int, float] = {}
    tg_s = 0.0
    for k, pp in enumerate(pp_sizes):
        ids = prompt_ids(n_vocab, pp, seed)
        engine.reset()
        start = time.perf_counter()
        logits = engine.append(ids)
        token = _greedy(logits)  # reads the logits back: the prefill is finished on any device
        pp_s[pp] = time.perf_counter() - start
        if k == 0:
            start = time.perf_counter()
            for _ in range(tg):
                token = _greedy(engine.append([token]))
            sync()
            tg_s = time.perf_counter() - start
    return pp_s, tg_s


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Load the model with the placement flags, warm up once, time up to `args.reps` repetitions."""
    from tandem.bench.vram import VramReading, VramSampler

    sampler = VramSampler().start()  # baseline before anything touches the GPU
    import torch

    from tandem.api import LLM

    start = time.perf_counter()
    llm = LLM(
        args.model,
        device=args.device,
        n_ctx=args.ctx_size,
        threads=args.threads,
        cache_type=args.cache_type,
        n_batch=args.batch_size,
        cpu_moe=args.cpu_moe,
        n_cpu_moe=args.n_cpu_moe,
        override_tensor=args.override_tensor,
        gpu_memory=args.gpu_memory,
        tp=args.tp,
        n_gpu_layers=args.n_gpu_layers,
        repack_experts=args.repack_experts,
        pcie_experts=args.pcie_experts,
        moe_cache=args.moe_cache,
        moe_cache_refresh=args.moe_cache_refresh,
        expert_stats=args.expert_stats,
        **({"dtype": args.dtype} if getattr(args, "dtype", None) else {}),
    )
    on_gpu = llm.plan.compute_device != "cpu"

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    def torch_peak() -> int | None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(max(torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count())))
        return None

    def memory(vram: VramReading) -> dict[str, Any]:
        return {"peak_rss_bytes": peak_rss_bytes(), "vram": vram.as_dict(), "torch_peak_bytes": torch_peak()}

    sync()
    load_s = time.perf_counter() - start
    try:
        # Where the weights are once loaded (the loader's own account when it gives one), else the plan.
        summary = getattr(llm, "placement_summary", None)
        weight_bytes = dict(summary() if callable(summary) else llm.plan.weight_bytes)
        start = time.perf_counter()
        warm = sorted({min(pp, args.batch_size) for pp in args.pp})
        _time_rep(llm, warm, min(args.tg, 4), seed=-1, sync=sync)
        warmup_s = time.perf_counter() - start
        common = {"engine": "tandem", "load_s": load_s, "warmup_s": warmup_s, "threads": llm.threads}
        common |= {"weight_bytes": weight_bytes, "version": _version(), "notices": list(llm.notices)}
        time_rep = functools.partial(_time_rep, llm, sync=sync)
        done = timed_reps("tandem", time_rep, args.pp, args, common, lambda: memory(sampler.reading))
    finally:
        llm.close()
    return run_result(common, done, args.reps, args.pp, memory(sampler.stop()))


def _version() -> str:
    from tandem import __version__

    return __version__


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; each repetition, then the whole run, goes to stdout as a marked JSON line."""
    maybe_inject("tandem")
    args = build_parser().parse_args(argv)
    emit_result(run(args))
    return 0


if __name__ == "__main__":
    exit_worker(main)
