"""`python -m tandem.fuzz --seeds DIR_OR_FILES... --mutants N [--seed S] [--workers W] [--timeout S]`: the fuzzer."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tandem.fuzz.runner import campaign


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.fuzz", description=__doc__)
    p.add_argument("--seeds", nargs="+", required=True, type=Path, help="GGUF files, or directories of them")
    p.add_argument("--mutants", type=int, default=1000, help="cases to run (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0): the same seed, the same cases")
    p.add_argument("--workers", type=int, default=2, help="cases at a time (default 2)")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds per case before it counts as a hang")
    p.add_argument("--memory-gib", type=float, default=4.0, help="RLIMIT_AS of each case (default 4 GiB)")
    p.add_argument("--budget", type=float, default=None, help="stop starting cases after this many seconds")
    p.add_argument("--findings", type=Path, default=None, help="save each finding's files and output here")
    args = p.parse_args(argv)
    seeds = sorted(f for s in args.seeds for f in ([s] if s.is_file() else s.glob("*.gguf")))
    if not seeds:
        p.error("no GGUF seed files found")
    report = campaign(seeds, args.mutants, args.seed, args.workers, args.timeout, args.memory_gib, args.budget,
                      args.findings)  # fmt: skip
    summary = {"cases": report.cases, "seconds": round(report.seconds, 1), "by_kind": report.by_kind,
               "exits": report.exits, "findings": len(report.findings), "seeds": [s.name for s in seeds]}  # fmt: skip
    print(json.dumps(summary))
    for finding in report.findings:
        last = finding.output.strip().splitlines()[-1:] or [""]
        print(f"FINDING {finding.reason}: {finding.case.what} :: {' '.join(finding.case.argv)} :: {last[0][:300]}")
    return 1 if report.findings else 0


if __name__ == "__main__":
    sys.exit(main())
