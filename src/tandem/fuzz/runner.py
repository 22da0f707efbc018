"""Run cases in forked children, each under RLIMIT_AS and a timeout, and sort the outcomes.

The parent imports the CLI once and never computes anything (no OpenMP pool exists to be broken by fork); each child
sets its memory cap, sends stderr to a file (stdout, the generated text, is dropped), runs `tandem.cli.main.main(argv)`
and exits with its code.
"""

from __future__ import annotations

import os
import random
import resource
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from tandem.fuzz.gguf_edit import GGUFParts
from tandem.fuzz.mutate import Case, flags_case, gguf_case, template_case

EXIT_UNCAUGHT = 70  # the child's code when an exception escaped the CLI


@dataclass
class Finding:
    case: Case
    reason: str  # traceback, exit code, signal, timeout, MemoryError
    output: str  # the tail of the child's stderr


@dataclass
class Report:
    cases: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    exits: dict[str, int] = field(default_factory=dict)  # "ok", "error", "usage"
    findings: list[Finding] = field(default_factory=list)
    seconds: float = 0.0


def _child(case: Case, log: int, memory_bytes: int) -> None:
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the generated text: judged by stderr alone
    os.dup2(log, 2)
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    from tandem.cli.main import main

    try:
        code = main(case.argv)
    except SystemExit as e:  # argparse's usage errors
        code = e.code if isinstance(e.code, int) else 2
    except BaseException:
        traceback.print_exc()
        code = EXIT_UNCAUGHT
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def classify(status: int | None, output: str) -> tuple[str, str | None]:
    """("ok" | "error" | "usage", None) for a clean outcome, else ("finding", why). `status` None: timed out."""
    if status is None:
        return "finding", "hang (timeout)"
    if os.WIFSIGNALED(status):
        return "finding", f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    code = os.WEXITSTATUS(status)
    lines = [line for line in output.splitlines() if line.strip()]
    # Lines, not substrings: a one-line message may quote a hostile name that says "Traceback" (escaped).
    if any(line == "Traceback (most recent call last):" or line.startswith("MemoryError") for line in lines):
        return "finding", "traceback" if code == EXIT_UNCAUGHT else f"traceback printed, exit {code}"
    errors = [line for line in lines if line.startswith("error: ")]
    if code == 0:
        return "ok", None
    if code == 2 and any(line.startswith("usage: ") for line in lines):
        return "usage", None
    if code == 2 and len(errors) == 1 and lines[-1] == errors[0]:
        return "error", None
    return "finding", f"exit {code}" + ("" if code != 2 else f" with {len(errors)} error lines")


def run_cases(cases: list[Case], workers: int, timeout: float, memory_bytes: int, report: Report) -> None:
    """Run `cases`, `workers` children at a time, adding their outcomes to `report`; each case's files exist while
    it runs."""
    pending = list(reversed(cases))
    running: dict[int, tuple[Case, float, Path]] = {}
    with tempfile.TemporaryDirectory(prefix="tandem-fuzz-") as tmp:
        while pending or running:
            while pending and len(running) < workers:
                case = pending.pop()
                for path, data in case.files.items():
                    path.write_bytes(data)
                slot = Path(tmp) / f"{len(pending)}.log"
                log = os.open(slot, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                pid = os.fork()
                if pid == 0:
                    _child(case, log, memory_bytes)
                os.close(log)
                running[pid] = (case, time.monotonic(), slot)
            if not _reap(running, timeout, report):
                time.sleep(0.002)


def _reap(running: dict[int, tuple[Case, float, Path]], timeout: float, report: Report) -> int:
    """Collect the children that ended or ran past `timeout` (killed); returns how many."""
    reaped = 0
    for pid, (case, start, slot) in list(running.items()):
        done, status = os.waitpid(pid, os.WNOHANG)
        timed_out = not done and time.monotonic() - start > timeout
        if timed_out:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        if not (done or timed_out):
            continue
        del running[pid]
        reaped += 1
        output = slot.read_text(errors="replace")[-4000:]
        slot.unlink()
        for path in case.files:
            path.unlink(missing_ok=True)
        kind, why = classify(None if timed_out else status, output)
        report.cases += 1
        report.by_kind[case.kind] = report.by_kind.get(case.kind, 0) + 1
        if why is None:
            report.exits[kind] = report.exits.get(kind, 0) + 1
        else:
            report.findings.append(Finding(case, why, output))
    return reaped


def campaign(
    seeds: list[Path], mutants: int, seed: int, workers: int = 2, timeout: float = 20.0, memory_gib: float = 4.0,
    budget: float | None = None, findings_dir: Path | None = None,
) -> Report:  # fmt: skip
    """`mutants` cases from `seeds` (GGUF files) under random seed `seed`: 80 % GGUF mutants, 10 % templates, 10 %
    flags; stops early after `budget` seconds. Findings are saved under `findings_dir` (the file and its command)."""
    # Imported once here, not in every child: faster, and every child runs the same code (a child importing a
    # module that is being edited in the working tree would test a half-written file).
    import tandem.cli.commands
    import tandem.cli.main  # noqa: F401

    rng = random.Random(seed)
    parsed = [(path, GGUFParts.read(path)) for path in seeds]
    report = Report()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tandem-fuzz-work-") as tmp:
        work = Path(tmp)
        batch = 32
        for first in range(0, mutants, batch):
            if budget is not None and time.monotonic() - start > budget:
                break
            cases = []
            for i in range(first, min(first + batch, mutants)):
                path, parts = rng.choice(parsed)
                roll = rng.random()
                if roll < 0.8:
                    cases.append(gguf_case(rng, path, parts, work / f"{i}.gguf"))
                elif roll < 0.9:
                    cases.append(template_case(rng, path, work / f"{i}.jinja"))
                else:
                    cases.append(flags_case(rng, path))
            before = len(report.findings)
            run_cases(cases, workers, timeout, int(memory_gib * 2**30), report)
            if findings_dir is not None:
                for i, finding in enumerate(report.findings[before:], start=before):
                    _save(findings_dir / f"finding-{i:04d}", finding)
    report.seconds = time.monotonic() - start
    return report


def _save(where: Path, finding: Finding) -> None:
    where.mkdir(parents=True, exist_ok=True)
    for path, data in finding.case.files.items():
        (where / path.name).write_bytes(data)
    (where / "case.txt").write_text(
        f"{finding.reason}\n{finding.case.what}\n{' '.join(finding.case.argv)}\n\n{finding.output}\n"
    )
