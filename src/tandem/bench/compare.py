"""`tandem bench --compare llamacpp --report DIR`: tandem and llama.cpp, same placement, side by side.

Schedule: worker processes (worker.py for tandem, llamacpp_worker.py for llama.cpp) one after the other,
by default two per engine x placement in the order tandem, llama.cpp, llama.cpp, tandem at placement A, then
the same at B, ...: the first two run ceil(reps / 2) repetitions, the others the rest (with --reps 1, or one
engine, one process per row). --process-reps K runs K repetitions per process instead, in as many rounds as
that takes, the engines' order mirrored from round to round (tandem, llama.cpp, llama.cpp, tandem, tandem,
...). A machine's slow spell, or a slow process, then falls on both engines rather than on whichever ran in it:
one engine's decode can vary between processes of the same minutes by more than the two engines differ by, so
more rounds make the ratio tell.
Each process loads the model once, warms up once and then runs its repetitions, printing each
repetition's result as soon as it is measured; the orchestrator keeps those, so a crash, a hang or a kill in
repetition k leaves the row with the k - 1 repetitions before it (its status says what went wrong, and the
row's second process does not run), and a missing peer costs its rows, never the report. The report
(report.json, report.md; report.png at the end) is rewritten after every repetition, so even a run killed from
outside leaves one behind.

Time limits:
  --timeout S   a watchdog per repetition: a worker is killed when S seconds pass without a repetition
                finishing; the first repetition's S also covers starting, loading and warming up. So one
                process of N repetitions runs at most N x S seconds, and a hang is caught after S.
  --budget S    all the processes share S seconds. A process that cannot start in time is a "not run" row;
                one still running at the end is killed (its repetitions so far kept: a "partial" row). Each
                process is also told (worker --deadline) not to start a repetition that would eat into the
                time the processes after it need for their first repetition (estimated from the latest
                process of the same engine: start to first repetition), so a tight budget still measures
                every row once before it measures any row three times; rows cut so are "partial" too.
Exit status: 0 when every row ran every repetition, 1 otherwise (the report says which and why).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.bench.protocol import EXIT_PEER_MISSING, parse_rep, parse_result
from tandem.bench.report import Report, Row, write_report
from tandem.bench.spec import BenchSettings, Placement, to_llama
from tandem.errors import TandemError

if TYPE_CHECKING:
    from tandem.gguf import GGUFFile
    from tandem.models.config import ModelConfig
    from tandem.placement import PlacementPlan

ENGINES = ("tandem", "llamacpp")
STDERR_TAIL_LINES = 25
PEER_LIB_ENV = "TANDEM_LLAMACPP_LIB"
MIN_START_S = 1.0  # under --budget, a process is not started with less than this left


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
    """One worker process: its result, or what went wrong; the repetitions it finished either way."""

    status: str  # ok, failed, timeout, peer missing, budget (killed at --budget's end)
    result: dict[str, Any] | None = None
    error: str | None = None
    wall_s: float = 0.0
    reps: list[dict[str, Any]] = field(default_factory=list)
    first_rep_s: float | None = None  # start to the first repetition's line: start-up, load, warm-up, one rep


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


POLL_S = 0.05


class _LineReader:
    """The complete lines a worker has written to its stdout file so far (a line cut short waits)."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self._pos = 0
        self._partial = b""
        self.text: list[str] = []

    def new_lines(self, final: bool = False) -> list[str]:
        self._f.seek(self._pos)
        data = self._f.read()
        self._pos += len(data)
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        if final and self._partial:
            lines.append(self._partial)
            self._partial = b""
        out = [line.decode("utf-8", "replace") for line in lines]
        self.text += out
        return out


def run_worker(
    cmd: Sequence[str],
    timeout_s: float,
    env: dict[str, str] | None = None,
    peer: bool = False,
    *,
    deadline: float | None = None,
    on_rep: Callable[[dict[str, Any]], None] | None = None,
    reps: int | None = None,
) -> RunOutcome:
    """Run one worker: its stdout carries a line per repetition and the result line, its stderr's tail
    explains a failure.

    timeout_s: the per-repetition watchdog (see the module docstring): killed when timeout_s pass without a
    repetition line, the first counted from the start. deadline: a time.monotonic() at which it is killed
    whatever (--budget's end; status "budget"). on_rep: called with each repetition's result as it arrives.
    reps: how many the worker was asked for (for the messages). `peer`: the llama.cpp worker, whose exit
    status EXIT_PEER_MISSING means llama_cpp is not importable.
    """
    start = time.perf_counter()
    got: list[dict[str, Any]] = []
    first: float | None = None
    killed: str | None = None
    of = f" of {reps}" if reps else ""

    def where() -> str:  # which repetition was running
        return "after its last repetition" if reps and len(got) >= reps else f"in repetition {len(got) + 1}{of}"

    with (
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as err,
    ):
        # Its own session, so that a timeout can kill the worker with anything it started.
        proc = subprocess.Popen(
            list(cmd), stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
        reader = _LineReader(out)
        last = start
        try:
            while True:
                try:
                    proc.wait(timeout=POLL_S)
                    done = True
                except subprocess.TimeoutExpired:
                    done = False
                for line in reader.new_lines(final=done):
                    rep = parse_rep(line)
                    if rep is None:
                        continue
                    last = time.perf_counter()
                    first = last - start if first is None else first
                    got.append(rep)
                    if on_rep is not None:
                        on_rep(rep)
                if done:
                    break
                if time.perf_counter() - last > timeout_s:
                    what = where()
                    if not got:
                        what += " (its time counts the start, the load and the warm-up)"
                    killed = f"timed out after {timeout_s:g} s {what}"
                elif deadline is not None and time.monotonic() >= deadline:
                    killed = "budget"
                if killed:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    for line in reader.new_lines(final=True):  # what it printed before the kill
                        if (rep := parse_rep(line)) is not None:
                            got.append(rep)
                            if on_rep is not None:
                                on_rep(rep)
                    break
        except BaseException:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            raise
        err.seek(0)
        stderr = err.read()
    wall = time.perf_counter() - start
    done_note = f", after {len(got)}{of} repetitions" if got else ""
    if killed == "budget":
        return RunOutcome("budget", error=f"killed at the budget's end{done_note}", wall_s=wall, reps=got)
    if killed:
        error = f"{killed}{done_note}\n{_tail(stderr)}".rstrip()
        return RunOutcome("timeout", error=error, wall_s=wall, reps=got, first_rep_s=first)
    stdout = "\n".join(reader.text)
    if proc.returncode != 0:
        status = "peer missing" if peer and proc.returncode == EXIT_PEER_MISSING else "failed"
        how = f"exit status {proc.returncode}"
        if proc.returncode < 0:
            how = f"killed by signal {signal.Signals(-proc.returncode).name}"
        if got:
            how += f" {where()}{done_note}"
        return RunOutcome(status, error=f"{how}\n{_tail(stderr)}".rstrip(), wall_s=wall, reps=got, first_rep_s=first)
    try:
        result = parse_result(stdout)
    except json.JSONDecodeError as e:
        error = f"unreadable result line: {e}\n{_tail(stderr)}"
        return RunOutcome("failed", error=error, wall_s=wall, reps=got, first_rep_s=first)
    if result is None:
        error = f"exit status 0 but no result line\n{_tail(stdout + chr(10) + stderr)}".rstrip()
        return RunOutcome("failed", error=error, wall_s=wall, reps=got, first_rep_s=first)
    return RunOutcome("ok", result=result, wall_s=wall, reps=got, first_rep_s=first)


def split_result(result: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole-run result (pp_s and tg_s lists over the repetitions) as one result per repetition."""
    n = len(result.get("tg_s", []))
    out = []
    for k in range(n):
        one = {**result, "pp_s": {pp: [v[k]] for pp, v in result["pp_s"].items()}, "tg_s": [result["tg_s"][k]]}
        out.append(one)
    return out


# Process-wide figures of the result line: they cover the whole process, the repetitions' only their part.
_PEAKS = ("vram", "peak_rss_bytes", "torch_peak_bytes")


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
    pcie_rows: frozenset[int] = frozenset()  # placements whose tandem worker gets --pcie-experts (see pcie_rows)
    _start: float = 0.0
    _first_rep_s: dict[str, float] = field(default_factory=dict)  # engine -> start to first repetition, last seen

    def _cmd(self, engine: str, i: int, reps: int, deadline: float | None = None) -> list[str] | None:
        s = self.settings
        common = ["-t", str(s.threads), "-c", str(s.n_ctx), "-b", str(s.n_batch), "--cache-type", s.cache_type]
        common += ["--pp", ",".join(map(str, s.pp)), "--tg", str(s.tg), "--reps", str(reps), "--seed", str(s.seed)]
        if deadline is not None:
            common += ["--deadline", f"{deadline:.3f}"]
        if engine == "tandem":
            dtype = ["--dtype", s.dtype] if s.dtype else []  # tandem's GPU compute type; llama.cpp has its own
            own = [] if s.repack_experts is None else [f"--{'' if s.repack_experts else 'no-'}repack-experts"]
            if i in self.pcie_rows:
                own += ["--pcie-experts", str(s.pcie_experts)]
            if s.expert_stats is not None:
                own += ["--expert-stats", s.expert_stats]
            worker = [sys.executable, "-m", "tandem.bench.worker"]
            return [*worker, "-m", s.model, *self.placements[i].argv(), *dtype, *own, *common]
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
        order = self._schedule()
        self._start = time.monotonic()
        interrupted: str | None = None
        with _sigterm_raises():
            try:
                for n, (i, engine, reps) in enumerate(order, 1):
                    row = rows[(engine, i)]
                    if row.status != "ok":
                        continue  # failed before it could start (no translation, peer missing), or in its first process
                    print(f"[{n}/{len(order)}] {engine} {row.placement.label}, {reps} reps ...", file=log, flush=True)
                    later = [rows[(e, j)] for j, e, _ in order[n:]]
                    status = self._run_row(report, row, reps, later, log)
                    print(f"    {status}", file=log, flush=True)
                    if row.status == "peer missing":  # then it is missing for every placement
                        for j in range(len(self.placements)):
                            if rows[("llamacpp", j)].status == "ok" and not rows[("llamacpp", j)].runs:
                                rows[("llamacpp", j)].fail("peer missing", row.error)
                    self._write(report, png=False)
            except (_Interrupted, KeyboardInterrupt) as e:
                interrupted = str(e) or "interrupted"
        for row in rows.values():
            if row.status == "ok" and row.reps_done < s.reps:
                _stop(row, s.reps, interrupted or "not run")
        report.finish()
        self._write(report, png=True)
        return report

    def _schedule(self) -> list[tuple[int, str, int]]:
        """(placement, engine, repetitions) of each worker process, in order (the module docstring): the engines in
        turn, their order mirrored from one round of processes to the next (A B, B A, A B, ...)."""
        plan = self.settings.process_plan(len(self.engines))
        order = []
        for i in range(len(self.placements)):
            for k, reps in enumerate(plan):
                order += [(i, e, reps) for e in (self.engines if k % 2 == 0 else reversed(self.engines))]
        return order

    def _write(self, report: Report, png: bool) -> None:
        if self.report_dir is not None:
            write_report(report, self.report_dir, png=png)

    def _run_row(self, report: Report, row: Row, reps: int, later: list[Row], log: Any) -> str:
        """A worker process of `reps` repetitions for `row`, within --timeout and what is left of --budget; returns
        a progress note."""
        s = self.settings
        expected = row.reps_done + reps  # the row's repetitions once this process has run
        hard: float | None = None
        soft: float | None = None
        if s.budget_s is not None:
            left = s.budget_s - (time.monotonic() - self._start)
            if left <= MIN_START_S:
                _stop(row, s.reps, f"the time budget (--budget {s.budget_s:g} s) was spent")
                return f"skipped: {left:.0f} s of the budget left"
            hard = self._start + s.budget_s
            # Leave the rows after this one the time of their first repetition, as far as it is known.
            reserve = sum(self._first_rep_s.get(r.engine, 0.0) for r in later if r.status == "ok")
            soft = time.time() + max(0.0, left - reserve)
        cmd = self._cmd(row.engine, row.index, reps, deadline=soft)
        assert cmd is not None
        # ggml answers a failed assertion with a gdb backtrace that would fill the error's tail: keep the message.
        # Triton's autotuning results go to its disk cache, so only the first process of a machine pays them.
        env = {"TRITON_CACHE_AUTOTUNING": "1", **os.environ, "GGML_NO_BACKTRACE": "1"}
        t0 = time.perf_counter()

        def on_rep(rep: dict[str, Any]) -> None:
            row.runs.append(rep)
            try:  # the progress line is a courtesy: a malformed figure must not stop the run
                speeds = [f"pp{k} {int(k) / v[0]:.1f}" for k, v in rep["pp_s"].items()]
                speeds.append(f"tg{s.tg} {s.tg / rep['tg_s'][0]:.1f} tok/s")
                note = ", ".join(speeds)
            except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError) as e:
                note = f"(no speeds: {type(e).__name__})"
            t = time.perf_counter() - t0
            print(f"    rep {row.reps_done}/{s.reps}: {note} ({t:.1f} s in)", file=log, flush=True)
            self._write(report, png=False)

        peer = row.engine == "llamacpp"
        outcome = run_worker(cmd, s.timeout_s, env=env, peer=peer, deadline=hard, on_rep=on_rep, reps=reps)
        row.walls.append(outcome.wall_s)
        if outcome.first_rep_s is not None:  # the latest: the first process of a machine also compiles kernels
            self._first_rep_s[row.engine] = outcome.first_rep_s
        budget = f"the time budget (--budget {s.budget_s:g} s)" if s.budget_s is not None else "the worker's deadline"
        if outcome.status == "ok":
            assert outcome.result is not None
            if not row.runs:  # a worker that printed only the result line
                row.runs.extend(split_result(outcome.result))
            elif all(k in outcome.result for k in _PEAKS):
                row.runs[-1].update({k: outcome.result[k] for k in _PEAKS})
            if row.reps_done < expected:
                _stop(row, s.reps, f"{budget} left no time for more")
        elif outcome.status == "budget":
            _stop(row, s.reps, f"{budget} ran out during a run")
        else:
            row.fail(outcome.status, outcome.error)
        load = row.runs[0].get("load_s") if row.runs else None
        warm = row.runs[0].get("warmup_s") if row.runs else None
        parts = [f"{outcome.wall_s:.1f} s"]
        if load is not None:
            parts.append(f"load {load:.1f} s")
        if warm is not None:
            parts.append(f"warm-up {warm:.1f} s")
        return f"{outcome.status} ({', '.join(parts)}; {row.reps_done}/{s.reps} reps of the row)"


def _stop(row: Row, reps: int, why: str) -> None:
    """Mark a row whose remaining repetitions will not run: 'partial' if some did, else 'not run'."""
    if row.runs:
        row.fail("partial", f"{why} after {row.reps_done} of {reps} repetitions")
    else:
        row.fail("not run", why)


def pcie_rows(f: GGUFFile, cfg: ModelConfig, plans: Sequence[PlacementPlan], k: int) -> frozenset[int]:
    """The rows `--pcie-experts K` applies to: those whose plan computes on a GPU with routed experts in host RAM,
    each checked as loading would check it. K > 0 with no such row is a usage error, not a flag left unused."""
    from tandem.placement import cpu_experts_by_layer
    from tandem.runtime.devices import check_pcie_experts

    if k == 0:
        return frozenset()
    rows = frozenset(
        i for i, plan in enumerate(plans) if plan.compute_device != "cpu" and cpu_experts_by_layer(f, plan.devices)
    )
    if not rows:
        raise TandemError(
            f"--pcie-experts {k}: no row keeps routed experts in host RAM under a GPU; add --cpu-moe, or "
            "cpu-moe / n-cpu-moe rows to --matrix"
        )
    for i in sorted(rows):
        check_pcie_experts(plans[i], f, cfg, k)
    return rows


def settings_from_args(args: Any) -> BenchSettings:
    """BenchSettings from `tandem bench`'s parsed flags."""
    from tandem.api import default_model_path, resolve_threads

    model = str(Path(args.model) if args.model else default_model_path())
    if not Path(model).is_file():
        raise TandemError(f"-m/--model: no such file: {model}")
    pp = tuple(args.pp if isinstance(args.pp, list) else [args.pp])
    settings = BenchSettings(
        model=model,
        threads=resolve_threads(args.threads),
        pp=pp,
        tg=args.tg,
        reps=args.reps,
        n_ctx=args.ctx_size,
        n_batch=args.batch_size,
        cache_type=args.cache_type,
        timeout_s=args.timeout,
        budget_s=args.budget,
        dtype=getattr(args, "dtype", None),
        repack_experts=getattr(args, "repack_experts", None),
        pcie_experts=getattr(args, "pcie_experts", 0),
        expert_stats=getattr(args, "expert_stats", None),
        process_reps=getattr(args, "process_reps", None),
        seed=getattr(args, "seed", 0),
    )
    settings.validate()
    return settings


def run_from_args(args: Any, argv: Sequence[str] | None = None) -> int:
    """`tandem bench` with --compare and/or --report. Usage errors raise TandemError (exit status 2)."""
    from tandem.bench.spec import parse_matrix
    from tandem.gguf import open_gguf
    from tandem.models import read_config
    from tandem.placement import ExpertStats, RuntimeShape, plan_placement
    from tandem.state.kv_cache import CACHE_DTYPES

    settings = settings_from_args(args)
    if args.report and Path(args.report).exists() and not Path(args.report).is_dir():
        raise TandemError(f"--report {args.report}: that is a file; the report needs a folder (made if missing)")
    from tandem.runtime.devices import resolve_device

    base = Placement(
        device=resolve_device(args.device, args.n_gpu_layers),  # resolved here, so both engines get the same one
        cpu_moe=args.cpu_moe,
        n_cpu_moe=args.n_cpu_moe,
        override_tensor=tuple(args.override_tensor),
        gpu_memory=args.gpu_memory,
        tp=args.tp,
        n_gpu_layers=args.n_gpu_layers,
        moe_cache=getattr(args, "moe_cache", None),
        moe_cache_refresh=getattr(args, "moe_cache_refresh", 0),
    )
    f = open_gguf(settings.model)
    cfg = read_config(f)
    placements = parse_matrix(args.matrix, base, cfg.n_layers) if args.matrix else [base]
    engines = ("tandem", "llamacpp") if args.compare else ("tandem",)
    shape = RuntimeShape(settings.n_ctx, settings.n_batch, CACHE_DTYPES[settings.cache_type].itemsize)
    llama: dict[int, dict[str, Any] | str] = {}
    plans = [plan_placement(f, cfg, p.request(), shape) for p in placements]  # bad flags: usage errors, before any run
    if settings.expert_stats is not None:  # the workers read it: another model's file or a model is refused here
        ExpertStats.open(settings.expert_stats, f, cfg)
    for i, (p, plan) in enumerate(zip(placements, plans, strict=True)):
        try:
            llama[i] = to_llama(p.request(), plan).as_dict()
        except TandemError as e:
            llama[i] = str(e)
    with_pcie = pcie_rows(f, cfg, plans, settings.pcie_experts)
    comparison = Comparison(
        settings=settings,
        placements=placements,
        engines=engines,
        peer_lib=Path(args.peer_lib) if args.peer_lib else (default_peer_lib(base.device) if args.compare else None),
        report_dir=Path(args.report) if args.report else None,
        command=" ".join(["tandem", *(argv if argv is not None else sys.argv[1:])]),
        llama=llama,
        pcie_rows=with_pcie,
    )
    report = comparison.run()
    from tandem.bench.report import render_markdown

    print(json.dumps(report.to_json(), indent=1) if getattr(args, "json", False) else render_markdown(report))
    if comparison.report_dir is not None:
        print(f"report: {comparison.report_dir}/report.{{md,json,png}}", file=sys.stderr)
    return 0 if report.all_ok else 1
