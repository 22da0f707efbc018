"""`tandem bench --compare llamacpp --report DIR`: tandem and llama.cpp, same placement, side by side.

Every engine x placement x repetition runs in its own worker process (worker.py for tandem,
llamacpp_worker.py for llama.cpp) under a timeout, in alternating order (tandem, llama.cpp, tandem, ...;
repetition r of every placement before repetition r + 1), so that drift in the machine's speed hits both
engines alike and a crash, a hang or a missing peer costs one row, never the report. The report
(report.json, report.md, report.png) is rewritten after every run, so even a run killed from outside leaves
one behind. Exit status: 0 when every run succeeded, 1 when any failed (the report says which and why).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.bench.protocol import EXIT_PEER_MISSING, parse_result
from tandem.bench.report import Report, Row, write_report
from tandem.bench.spec import BenchSettings, Placement, to_llama
from tandem.errors import TandemError

ENGINES = ("tandem", "llamacpp")
STDERR_TAIL_LINES = 25
PEER_LIB_ENV = "TANDEM_LLAMACPP_LIB"


def llamacpp_worker_path() -> Path:
    """The llama.cpp worker is started by path (see its docstring for why not with -m)."""
    return Path(__file__).with_name("llamacpp_worker.py")


def default_peer_lib(device: str) -> Path:
    """$TANDEM_LLAMACPP_LIB, else scripts/build_llamacpp.sh's target for this device (CUDA or CPU build)."""
    if os.environ.get(PEER_LIB_ENV):
        return Path(os.environ[PEER_LIB_ENV])
    base = Path.home() / ".cache" / "tandem" / "peers"
    cuda = base / "llama_cpp_cuda"
    return cuda if device != "cpu" and cuda.is_dir() else base / "llama_cpp_cpu"


@dataclass
class RunOutcome:
    """One worker process: its result, or what went wrong."""

    status: str  # ok, failed, timeout, peer missing, not run
    result: dict[str, Any] | None = None
    error: str | None = None
    wall_s: float = 0.0


class _Interrupted(Exception):
    """SIGTERM or Ctrl-C: stop starting runs, write the report, exit 1."""


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    def handler(signum: int, frame: object) -> None:
        raise _Interrupted(f"interrupted by signal {signum}")

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _tail(text: str, n: int = STDERR_TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


def run_worker(
    cmd: Sequence[str], timeout_s: float, env: dict[str, str] | None = None, peer: bool = False
) -> RunOutcome:
    """Run one worker; its stdout carries the result line, its stderr's tail explains a failure.

    `peer`: the llama.cpp worker, whose exit status EXIT_PEER_MISSING means llama_cpp is not importable.
    """
    start = time.perf_counter()
    with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as err:
        # Its own session, so that a timeout can kill the worker with anything it started.
        proc = subprocess.Popen(
            list(cmd), stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True
        )
        try:
            stdout, _ = proc.communicate(timeout=timeout_s)
        except BaseException as e:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            if not isinstance(e, subprocess.TimeoutExpired):
                raise
            err.seek(0)
            return RunOutcome(
                "timeout",
                error=f"timed out after {timeout_s:g} s\n{_tail(err.read())}".rstrip(),
                wall_s=time.perf_counter() - start,
            )
        err.seek(0)
        stderr = err.read()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        status = "peer missing" if peer and proc.returncode == EXIT_PEER_MISSING else "failed"
        how = f"exit status {proc.returncode}"
        if proc.returncode < 0:
            how = f"killed by signal {signal.Signals(-proc.returncode).name}"
        return RunOutcome(status, error=f"{how}\n{_tail(stderr)}".rstrip(), wall_s=wall)
    try:
        result = parse_result(stdout)
    except json.JSONDecodeError as e:
        return RunOutcome("failed", error=f"unreadable result line: {e}\n{_tail(stderr)}", wall_s=wall)
    if result is None:
        return RunOutcome("failed", error=f"exit status 0 but no result line\n{_tail(stdout + stderr)}", wall_s=wall)
    return RunOutcome("ok", result=result, wall_s=wall)


@dataclass
class Comparison:
    """The matrix to run and where the report goes."""

    settings: BenchSettings
    placements: list[Placement]
    engines: tuple[str, ...] = ENGINES
    peer_lib: Path | None = None
    report_dir: Path | None = None
    command: str = ""
    llama: dict[int, dict[str, Any] | str] = field(default_factory=dict)  # placement -> params or why not
    _start: float = 0.0

    def _cmd(self, engine: str, i: int, rep: int) -> list[str] | None:
        s = self.settings
        common = ["-t", str(s.threads), "-c", str(s.n_ctx), "-b", str(s.n_batch), "--cache-type", s.cache_type]
        common += ["--pp", ",".join(map(str, s.pp)), "--tg", str(s.tg), "--reps", "1", "--seed", str(rep)]
        if engine == "tandem":
            dtype = ["--dtype", s.dtype] if s.dtype else []  # tandem's GPU compute type; llama.cpp has its own
            worker = [sys.executable, "-m", "tandem.bench.worker"]
            return [*worker, "-m", s.model, *self.placements[i].argv(), *dtype, *common]
        params = self.llama[i]
        if isinstance(params, str):
            return None
        lib = str(self.peer_lib or default_peer_lib(self.placements[i].device))
        worker = [sys.executable, str(llamacpp_worker_path()), "--lib", lib]
        return [*worker, "-m", s.model, "--placement", json.dumps(params), *common]

    def run(self, log: Any = sys.stderr) -> Report:
        """Run the matrix; return the report (already written to report_dir, when one is set)."""
        s = self.settings
        report = Report.start(s, self.placements, self.engines, self.command, self.peer_lib)
        rows: dict[tuple[str, int], Row] = {}
        for i in range(len(self.placements)):
            for engine in self.engines:
                params = self.llama.get(i) if engine == "llamacpp" else None
                rows[(engine, i)] = report.add_row(engine, i, params)
                if isinstance(params, str):
                    rows[(engine, i)].fail("failed", f"no llama.cpp translation: {params}")
        order = [(rep, i, e) for rep in range(s.reps) for i in range(len(self.placements)) for e in self.engines]
        self._start = time.monotonic()
        interrupted: str | None = None
        with _sigterm_raises():
            try:
                for n, (rep, i, engine) in enumerate(order, 1):
                    row = rows[(engine, i)]
                    if row.status != "ok":
                        continue  # failed before: the remaining repetitions would fail the same way
                    print(f"[{n}/{len(order)}] {engine} {row.placement.label} rep {rep + 1}/{s.reps} ...", file=log)
                    status = self._run_one(row, rep)
                    print(f"    {status}", file=log, flush=True)
                    if row.status == "peer missing":  # then it is missing for every placement
                        for j in range(len(self.placements)):
                            if rows[("llamacpp", j)].status == "ok" and not rows[("llamacpp", j)].runs:
                                rows[("llamacpp", j)].fail("peer missing", row.error)
                    if self.report_dir is not None:
                        write_report(report, self.report_dir, png=False)
            except (_Interrupted, KeyboardInterrupt) as e:
                interrupted = str(e) or "interrupted"
        for row in rows.values():
            if row.status == "ok" and row.reps_done < s.reps:
                _stop(row, s.reps, interrupted or "not run")
        report.finish()
        if self.report_dir is not None:
            write_report(report, self.report_dir, png=True)
        return report

    def _run_one(self, row: Row, rep: int) -> str:
        """One worker run for `row`, within --timeout and what is left of --budget; returns a progress note."""
        s = self.settings
        timeout = s.timeout_s
        if s.budget_s is not None:
            left = s.budget_s - (time.monotonic() - self._start)
            # Do not start a run that cannot finish: one that took longer before would only be cut.
            if left <= max(1.0, min(row.walls, default=0.0)):
                _stop(row, s.reps, f"the time budget (--budget {s.budget_s:g} s) was spent")
                return f"skipped: {left:.0f} s of the budget left"
            timeout = min(timeout, left)
        cmd = self._cmd(row.engine, row.index, rep)
        assert cmd is not None
        # ggml answers a failed assertion with a gdb backtrace that would fill the error's tail: keep the message.
        env = {**os.environ, "GGML_NO_BACKTRACE": "1"}
        outcome = run_worker(cmd, timeout, env=env, peer=row.engine == "llamacpp")
        if outcome.status == "timeout" and timeout < s.timeout_s:
            _stop(row, s.reps, f"the time budget (--budget {s.budget_s:g} s) ran out during a run")
        else:
            row.add(outcome.status, outcome.result, outcome.error)
            row.walls.append(outcome.wall_s)
        return f"{outcome.status} ({outcome.wall_s:.1f} s)"


def _stop(row: Row, reps: int, why: str) -> None:
    """Mark a row whose remaining repetitions will not run: 'partial' if some did, else 'not run'."""
    if row.runs:
        row.fail("partial", f"{why} after {row.reps_done} of {reps} repetitions")
    else:
        row.fail("not run", why)


def settings_from_args(args: Any) -> BenchSettings:
    """BenchSettings from `tandem bench`'s parsed flags."""
    from tandem.api import default_model_path, default_threads

    model = str(Path(args.model) if args.model else default_model_path())
    if not Path(model).is_file():
        raise TandemError(f"-m/--model: no such file: {model}")
    pp = tuple(args.pp if isinstance(args.pp, list) else [args.pp])
    settings = BenchSettings(
        model=model,
        threads=args.threads or default_threads(),
        pp=pp,
        tg=args.tg,
        reps=args.reps,
        n_ctx=args.ctx_size,
        n_batch=args.batch_size,
        cache_type=args.cache_type,
        timeout_s=args.timeout,
        budget_s=args.budget,
        dtype=getattr(args, "dtype", None),
    )
    settings.validate()
    return settings


def run_from_args(args: Any, argv: Sequence[str] | None = None) -> int:
    """`tandem bench` with --compare and/or --report. Usage errors raise TandemError (exit status 2)."""
    from tandem.bench.spec import parse_matrix
    from tandem.gguf import open_gguf
    from tandem.models import read_config
    from tandem.placement import RuntimeShape, plan_placement
    from tandem.runtime.kv_cache import CACHE_DTYPES

    settings = settings_from_args(args)
    from tandem.runtime.devices import default_device

    base = Placement(
        device=args.device or default_device(),  # resolved here, so both engines get the same one
        cpu_moe=args.cpu_moe,
        n_cpu_moe=args.n_cpu_moe,
        override_tensor=tuple(args.override_tensor),
        gpu_memory=args.gpu_memory,
        tp=args.tp,
    )
    f = open_gguf(settings.model)
    cfg = read_config(f)
    placements = parse_matrix(args.matrix, base, cfg.n_layers) if args.matrix else [base]
    engines = ("tandem", "llamacpp") if args.compare else ("tandem",)
    shape = RuntimeShape(settings.n_ctx, settings.n_batch, CACHE_DTYPES[settings.cache_type].itemsize)
    llama: dict[int, dict[str, Any] | str] = {}
    for i, p in enumerate(placements):
        plan = plan_placement(f, cfg, p.request(), shape)  # bad flags are usage errors, before any run
        try:
            llama[i] = to_llama(p.request(), plan).as_dict()
        except TandemError as e:
            llama[i] = str(e)
    comparison = Comparison(
        settings=settings,
        placements=placements,
        engines=engines,
        peer_lib=Path(args.peer_lib) if args.peer_lib else (default_peer_lib(base.device) if args.compare else None),
        report_dir=Path(args.report) if args.report else None,
        command=" ".join(["tandem", *(argv if argv is not None else sys.argv[1:])]),
        llama=llama,
    )
    report = comparison.run()
    from tandem.bench.report import render_markdown

    print(json.dumps(report.to_json(), indent=1) if getattr(args, "json", False) else render_markdown(report))
    if comparison.report_dir is not None:
        print(f"report: {comparison.report_dir}/report.{{md,json,png}}", file=sys.stderr)
    return 0 if report.all_ok else 1
