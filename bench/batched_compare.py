"""tandem's engine against llama.cpp's `llama-batched-bench` on the same batched work: N sequences of PP prompt
tokens each, then TG tokens each, decoded together; aggregate and per-stream decode tok/s and prefill tok/s.

    python bench/batched_compare.py -m MODEL.gguf --npl 1,4,16 --pp 128 --tg 64 -t 16 [--cpu-moe | --n-cpu-moe N]
        [--device cuda] [--tandem-flags "--pcie-experts 3"] --llama-bin DIR/bin/llama-batched-bench [--out DIR]

tandem: `tandem bench --concurrency NPL --json` in a process of its own (the engine with N sequences at once,
medians of --reps). llama.cpp: `llama-batched-bench -npp PP -ntg TG -npl NPL --output-format jsonl` with the same
placement flags (llama.cpp's own `--cpu-moe` / `--n-cpu-moe`), every layer on the GPU (`-ngl 99`) or none on the
CPU, its context sized for the largest N (`-c N*(PP+TG)`), and its other defaults (flash attention: auto). Both
count decode as generated tokens over the time of the decode steps after the prompts (llama.cpp's S_TG; tandem's
tokens after each sequence's first one). `--tandem-flags`: tandem's own options (no VRAM of their own, such as
--pcie-experts), which llama.cpp has no form of. Peak VRAM: the driver's used memory while each engine's process
ran, over what was used before it started (tandem.bench.vram). Build llama-batched-bench with
scripts/build_llamacpp_tools.sh.
Writes OUT/batched.json and OUT/batched.md, and prints the table; a side that fails is reported with its error.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

from tandem.bench.vram import VramSampler

_MIB = 1 << 20
PEAK_VRAM: dict[str, int | None] = {}  # engine -> the driver's peak used memory over its baseline, bytes


def _run(cmd: list[str], timeout: float, engine: str) -> tuple[str, str | None]:
    """(stdout, None), or ("", why it failed); the process's peak VRAM into PEAK_VRAM[engine]."""
    sampler = VramSampler().start()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return "", f"{type(e).__name__}: {e}"
    finally:
        PEAK_VRAM[engine] = sampler.stop().used_bytes
    if p.returncode != 0:
        return "", f"exit {p.returncode}: {(p.stderr or p.stdout).strip().splitlines()[-1:] or ['']}"
    return p.stdout, None


def tandem_rows(args: argparse.Namespace) -> tuple[dict[int, dict], str | None]:
    cmd = [sys.executable, "-m", "tandem.cli.main", "bench", "-m", args.model, "--concurrency", args.npl,
           "--pp", str(args.pp), "--tg", str(args.tg), "--reps", str(args.reps), "-t", str(args.threads),
           "--device", args.device, "-c", str(args.pp + args.tg), "--json", *args.placement,
           *shlex.split(args.tandem_flags)]  # fmt: skip
    out, err = _run(cmd, args.timeout, "tandem")
    if err:
        return {}, err
    return {r["n_seqs"]: r for r in json.loads(out)}, None


def llama_rows(args: argparse.Namespace) -> tuple[dict[int, dict], str | None]:
    npl = [int(n) for n in args.npl.split(",")]
    cmd = [args.llama_bin, "-m", args.model, "-npp", str(args.pp), "-ntg", str(args.tg), "-npl", args.npl,
           "-c", str(max(npl) * (args.pp + args.tg)), "-ngl", "0" if args.device == "cpu" else "99",
           "-t", str(args.threads), "--output-format", "jsonl", *args.placement]  # fmt: skip
    out, err = _run(cmd, args.timeout, "llamacpp")
    if err:
        return {}, err
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {r["pl"]: r for r in rows}, None if rows else "no JSONL rows in llama-batched-bench's output"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--npl", default="1,4,16", help="sequences at once, comma-separated (default 1,4,16)")
    p.add_argument("--pp", type=int, default=128)
    p.add_argument("--tg", type=int, default=64)
    p.add_argument("--reps", type=int, default=3, help="tandem's repetitions (llama-batched-bench runs each once)")
    p.add_argument("-t", "--threads", type=int, default=16)
    p.add_argument("--device", default="cuda")
    p.add_argument("--cpu-moe", action="store_true")
    p.add_argument("--n-cpu-moe", type=int, default=0)
    p.add_argument("--tandem-flags", default="", help='more options for tandem only, e.g. "--pcie-experts 3"')
    p.add_argument("--llama-bin", required=True, help="the llama-batched-bench binary")
    p.add_argument("--timeout", type=float, default=600, help="seconds per engine (default 600)")
    p.add_argument("--out", default=None, help="folder for batched.json and batched.md")
    args = p.parse_args()
    args.placement = ["--cpu-moe"] if args.cpu_moe else ["--n-cpu-moe", str(args.n_cpu_moe)] if args.n_cpu_moe else []
    tandem, tandem_err = tandem_rows(args)
    llama, llama_err = llama_rows(args)
    placement = " ".join(args.placement) or ("CPU only" if args.device == "cpu" else "all on the GPU")
    vram = {k: "—" if v is None else f"{v / _MIB:,.0f}" for k, v in PEAK_VRAM.items()}
    lines = [f"{Path(args.model).name}, {placement}, pp {args.pp}, tg {args.tg}, {args.threads} threads"
             + (f"; tandem also {args.tandem_flags}" if args.tandem_flags else ""),
             f"peak VRAM MiB (the driver's, the whole run): tandem {vram.get('tandem', '—')}, "
             f"llama.cpp {vram.get('llamacpp', '—')}",
             "", "| sequences | tandem pp / tg tok/s (per stream) | llama.cpp pp / tg tok/s (per stream) | tg ratio |",
             "|---|---|---|---|"]  # fmt: skip
    for n in [int(n) for n in args.npl.split(",")]:
        t, ll = tandem.get(n), llama.get(n)
        ts = f"{t['pp_tok_s']:,.1f} / {t['tg_tok_s']:,.1f} ({t['tg_tok_s_per_stream']:,.1f})" if t else "failed"
        ls = f"{ll['speed_pp']:,.1f} / {ll['speed_tg']:,.1f} ({ll['speed_tg'] / n:,.1f})" if ll else "failed"
        ratio = f"{t['tg_tok_s'] / ll['speed_tg']:.2f}×" if t and ll else "—"
        lines.append(f"| {n} | {ts} | {ls} | {ratio} |")
    for name, err in (("tandem", tandem_err), ("llama.cpp", llama_err)):
        if err:
            lines.append(f"\n{name} failed: {err}")
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "batched.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
        record = {"args": {k: v for k, v in vars(args).items()}, "tandem": tandem, "llamacpp": llama,
                  "peak_vram_bytes": PEAK_VRAM,
                  "errors": {"tandem": tandem_err, "llamacpp": llama_err}}  # fmt: skip
        (out / "batched.json").write_text(json.dumps(record, indent=2), encoding="utf-8")
    return 0 if not (tandem_err or llama_err) else 1


if __name__ == "__main__":
    raise SystemExit(main())
