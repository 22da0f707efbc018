#!/usr/bin/env python
"""Check that llama.cpp loads `tandem synth` models and computes finite logits with them.

    python scripts/check_synth_llamacpp.py [--presets a,b] [--layers 2] [--full gpt-oss-20b] [--quant Q4_K_M]
                                           [--lib DIR] [--workdir DIR] [--keep] [--json OUT]

For each preset: write a synthetic model with --layers layers (and, for the presets named by --full, one
with the real layer count), then in a subprocess -- llama-cpp-python's CPU build on sys.path, `llama_cpp`
imported before numpy -- load it, tokenize a text, evaluate a few tokens and check every logit is finite.
Prints one line per model and a JSON summary; exits 1 if any model fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_LIB = os.path.join(os.path.expanduser("~"), ".cache", "tandem", "peers", "llama_cpp_cpu")
TOKENS = [300, 301, 1000, 2000, 5000]  # after BOS; every preset's vocabulary is far larger


def child(model: str, lib: str, threads: int) -> int:
    """Runs in the subprocess: load `model` with llama.cpp and print one JSON line."""
    sys.path.insert(0, lib)
    import llama_cpp  # noqa: I001  (must come before numpy: numpy first crashes the loader)
    from llama_cpp import Llama

    import numpy as np

    t0 = time.perf_counter()
    llm = Llama(model_path=model, n_ctx=128, n_batch=64, n_threads=threads, n_threads_batch=threads,
                logits_all=True, verbose=False)  # fmt: skip
    load_s = time.perf_counter() - t0
    text_ids = llm.tokenize(b"Hello world, the synthetic model speaks.", add_bos=False, special=True)
    ids = [llm.token_bos(), *TOKENS]
    t0 = time.perf_counter()
    llm.eval(ids)
    eval_s = time.perf_counter() - t0
    logits = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
    res = {
        "llama_cpp": llama_cpp.__version__,
        "n_vocab": llm.n_vocab(),
        "n_text_tokens": len(text_ids),
        "finite": bool(np.isfinite(logits).all()),
        "logit_std": float(logits.std()),
        "load_s": round(load_s, 2),
        "eval_s": round(eval_s, 2),
    }
    print("RESULT " + json.dumps(res))
    return 0 if res["finite"] else 1


def check(path: Path, lib: str, threads: int, timeout: int) -> dict:
    cmd = [sys.executable, __file__, "--child", str(path), "--lib", lib, "--threads", str(threads)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[len("RESULT ") :])
            return {"ok": proc.returncode == 0 and res["finite"], **res}
    tail = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()][-6:]
    return {"ok": False, "error": f"exit {proc.returncode}: " + " | ".join(tail)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--presets", default=None, help="comma-separated presets (default: all)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--full", default="", help="comma-separated presets also checked with their real layer count")
    ap.add_argument("--quant", default="Q4_K_M")
    ap.add_argument("--lib", default=DEFAULT_LIB, help="llama-cpp-python install (--target) directory")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=900, help="seconds per model")
    ap.add_argument("--workdir", default=None, help="where the models are written (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the written models")
    ap.add_argument("--json", default=None, help="also write the summary here")
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.lib, args.threads)
    if not os.path.isdir(os.path.join(args.lib, "llama_cpp")):
        print(f"no llama-cpp-python build in {args.lib} (scripts/build_llamacpp.sh makes one)", file=sys.stderr)
        return 2

    from tandem.synth.presets import PRESETS
    from tandem.synth.writer import synthesize

    names = args.presets.split(",") if args.presets else list(PRESETS)
    jobs = [(n, args.layers) for n in names] + [(n, None) for n in args.full.split(",") if n]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tandem-synth-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results = []
    for name, layers in jobs:
        path = workdir / f"{name}-{layers or 'full'}-{args.quant}.gguf"
        written = synthesize(name, path, layers=layers, quant=args.quant, overwrite=True)
        res = {"preset": name, "layers": written.plan.n_layers, "quant": written.plan.mix,
               "file_gib": round(written.file_bytes / 2**30, 3), "write_s": round(written.seconds, 2),
               **check(path, args.lib, args.threads, args.timeout)}  # fmt: skip
        results.append(res)
        status = "OK  " if res["ok"] else "FAIL"
        detail = f"logit std {res['logit_std']:.3g}, load {res['load_s']} s" if res["ok"] else res.get("error", "")
        print(f"{status} {name:20s} layers={res['layers']:<3d} {res['file_gib']:8.3f} GiB  {detail}", flush=True)
        if not args.keep:
            path.unlink(missing_ok=True)
    summary = {"lib": args.lib, "results": results}
    print(json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
