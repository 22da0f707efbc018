"""The comparison report: rows of engine x placement, written as report.json, report.md and report.png.

A row is one worker process (one engine x placement) and holds the results of its repetitions, one dict
each, as the worker printed them; speeds are tokens / median seconds over them, load and warm-up time the
median, peak memory the maximum. A row that failed keeps its status, the error's last lines and the
repetitions measured before the failure (its speeds are theirs; the reps column says how many).
report.png is drawn from report.json in a separate interpreter (plot.py says why and what the fallbacks are).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.bench.spec import BenchSettings, Placement

ENGINE_NAMES = {"tandem": "tandem", "llamacpp": "llama.cpp"}
MIB = 2**20


@dataclass
class Row:
    """One engine x placement: its runs so far and, when something went wrong, what and why."""

    engine: str
    index: int  # the placement's position in the matrix
    placement: Placement
    llama: dict[str, Any] | str | None = None  # the translated llama.cpp placement (peer rows)
    status: str = "ok"  # ok, failed, timeout, peer missing, partial (cut short), not run
    error: str | None = None
    runs: list[dict[str, Any]] = field(default_factory=list)  # one per repetition
    walls: list[float] = field(default_factory=list)  # seconds each worker process took, start to exit

    @property
    def reps_done(self) -> int:
        return len(self.runs)

    def fail(self, status: str, error: str | None) -> None:
        self.status = status
        self.error = error

    def metrics(self, pp_sizes: tuple[int, ...], tg: int) -> dict[str, Any]:
        """Speeds (tok/s, from the median time over all repetitions), load time, peak memory; None if no run."""
        runs = self.runs
        pp = {}
        for n in pp_sizes:
            samples = [s for r in runs for s in r["pp_s"].get(str(n), [])]
            pp[str(n)] = n / statistics.median(samples) if samples else None
        tg_samples = [s for r in runs for s in r["tg_s"]]
        vram_used = [r["vram"]["used_bytes"] for r in runs if r["vram"]["used_bytes"] is not None]
        torch_peak = [r["torch_peak_bytes"] for r in runs if r.get("torch_peak_bytes") is not None]
        sources = {r["vram"]["source"] for r in runs}
        return {
            "pp_tok_s": pp,
            "tg_tok_s": tg / statistics.median(tg_samples) if tg_samples else None,
            "load_s": statistics.median(r["load_s"] for r in runs) if runs else None,
            "warmup_s": statistics.median(w) if (w := [r["warmup_s"] for r in runs if "warmup_s" in r]) else None,
            "peak_rss_bytes": max((r["peak_rss_bytes"] for r in runs), default=None),
            "vram_used_bytes": max(vram_used, default=None),
            "vram_torch_peak_bytes": max(torch_peak, default=None),
            "vram_source": next(iter(sources)) if len(sources) == 1 else None,
            "gpu_name": next((r["vram"]["gpu_name"] for r in runs if r["vram"].get("gpu_name")), None),
        }


_CPU_FLAGS = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_vnni": "VNNI", "amx_int8": "AMX"}


def _cpu_details() -> dict[str, Any]:
    """What tells one machine from another when the model name is generic (a VM's "Intel Xeon Processor"):
    family/model/stepping (the generation), the L3 size, the NUMA nodes, the vector extensions ggml's kernels
    pick from, and transparent huge pages. The CPU experts' speed moves with these between device calls."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if not key:
                break  # the first processor's block is enough
            info.setdefault(key, value.strip())
    except OSError:
        return {"cpu": platform.processor()}
    flags = set(info.get("flags", "").split())
    thp = ""
    try:
        enabled = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
        thp = enabled[enabled.index("[") + 1 : enabled.index("]")]
    except (OSError, ValueError):
        pass
    return {
        "cpu": info.get("model name", platform.processor()),
        "cpu_id": "/".join(info.get(k, "?") for k in ("cpu family", "model", "stepping")),
        "cpu_cache": info.get("cache size"),
        "cpu_flags": [name for flag, name in _CPU_FLAGS.items() if flag in flags],
        "numa_nodes": len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or None,
        "thp": thp or None,
    }


def _machine() -> dict[str, Any]:
    import psutil

    return {
        **_cpu_details(),
        "logical_cpus": os.cpu_count(),
        "physical_cpus": psutil.cpu_count(logical=False),
        "ram_bytes": psutil.virtual_memory().total,
        "python": platform.python_version(),
        "os": platform.platform(),
        "loadavg_start": list(os.getloadavg()),
    }


@dataclass
class Report:
    """Everything report.json holds; rows are added as the comparison runs."""

    settings: BenchSettings
    placements: list[Placement]
    engines: tuple[str, ...]
    command: str
    peer_lib: str | None
    created: str
    machine: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    finished: bool = False

    @classmethod
    def start(
        cls,
        settings: BenchSettings,
        placements: list[Placement],
        engines: tuple[str, ...],
        command: str,
        peer_lib: Path | None,
    ) -> Report:
        created = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        return cls(settings, placements, engines, command, str(peer_lib) if peer_lib else None, created, _machine())

    def add_row(self, engine: str, index: int, llama: dict[str, Any] | str | None) -> Row:
        """A row for `engine` at placement `index` of the matrix (its llama.cpp translation for peer rows)."""
        row = Row(engine, index, self.placements[index], llama)
        self.rows.append(row)
        return row

    def finish(self) -> None:
        self.machine["loadavg_end"] = list(os.getloadavg())
        self.finished = True

    @property
    def all_ok(self) -> bool:
        """Every row ran every repetition."""
        return all(r.status == "ok" and r.reps_done == self.settings.reps for r in self.rows)

    @property
    def gpu(self) -> str | None:
        """The GPU's name as a worker's driver query saw it, or None: no GPU (or none could be read)."""
        for row in self.rows:
            name = row.metrics(self.settings.pp, self.settings.tg)["gpu_name"] if row.runs else None
            if name:
                return name
        return None

    def ratios(self, index: int) -> dict[str, float | None]:
        """tandem / llama.cpp speed for one placement: > 1 means tandem is faster."""
        by_engine = {r.engine: r.metrics(self.settings.pp, self.settings.tg) for r in self.rows if r.index == index}
        t, lc = by_engine.get("tandem"), by_engine.get("llamacpp")
        out: dict[str, float | None] = {}
        if t is None or lc is None:
            return out
        for n in self.settings.pp:
            a, b = t["pp_tok_s"][str(n)], lc["pp_tok_s"][str(n)]
            out[f"pp{n}"] = a / b if a and b else None
        a, b = t["tg_tok_s"], lc["tg_tok_s"]
        out[f"tg{self.settings.tg}"] = a / b if a and b else None
        return out

    def to_json(self) -> dict[str, Any]:
        s = self.settings
        return {
            "schema": 1,
            "created": self.created,
            "command": self.command,
            "finished": self.finished,
            "all_ok": self.all_ok,
            "exit_code": 0 if self.all_ok else 1,
            "machine": {**self.machine, "gpu": self.gpu, "gpu_note": None if self.gpu else "no GPU"},
            "settings": {
                "model": s.model,
                "model_bytes": Path(s.model).stat().st_size if Path(s.model).exists() else None,
                "threads": s.threads,
                "pp": list(s.pp),
                "tg": s.tg,
                "reps": s.reps,
                "n_ctx": s.n_ctx,
                "n_batch": s.n_batch,
                "cache_type": s.cache_type,
                "timeout_s": s.timeout_s,
                "budget_s": s.budget_s,
            },
            "engines": list(self.engines),
            "peer_lib": self.peer_lib,
            "placements": [{"label": p.label, "flags": p.argv()} for p in self.placements],
            "rows": [
                {
                    "engine": r.engine,
                    "placement_index": r.index,
                    "placement": r.placement.label,
                    "placement_flags": r.placement.argv(),
                    "llama_placement": r.llama,
                    "status": r.status,
                    "error": r.error,
                    "reps_done": r.reps_done,
                    "process_wall_s": r.walls,
                    **r.metrics(s.pp, s.tg),
                    "ratio_tandem_over_llamacpp": self.ratios(r.index) if r.engine == "tandem" else None,
                    "versions": sorted({str(run.get("version")) for run in r.runs}),
                    "weight_bytes": r.runs[0].get("weight_bytes") if r.runs else None,
                    "runs": r.runs,
                }
                for r in self.rows
            ],
        }


def _num(v: float | None, fmt: str = "{:.1f}") -> str:
    return "—" if v is None else fmt.format(v)


def _loadavg(v: list[float] | None) -> str:
    return "—" if not v else "/".join(f"{x:.1f}" for x in v)


def _mib(v: int | None) -> str:
    return "—" if v is None else f"{v / MIB:,.0f}"


def _cpu_line(machine: dict[str, Any]) -> str:
    """The CPU details after the logical CPU count, e.g. "; family/model/stepping 6/143/8; L3 107520 KB; 1 NUMA
    node; AVX2 AVX-512 VNNI AMX; THP madvise"."""
    parts = []
    if machine.get("cpu_id"):
        parts.append(f"family/model/stepping {machine['cpu_id']}")
    if machine.get("cpu_cache"):
        parts.append(f"L3 {machine['cpu_cache']}")
    if nodes := machine.get("numa_nodes"):
        parts.append(f"{nodes} NUMA node{'s' if nodes > 1 else ''}")
    if machine.get("cpu_flags"):
        parts.append(" ".join(machine["cpu_flags"]))
    if machine.get("thp"):
        parts.append(f"THP {machine['thp']}")
    return "".join(f"; {p}" for p in parts)


def _schedule_line(report: Report) -> str:
    """How the worker processes ran (bench/compare.py's schedule)."""
    plan = report.settings.process_plan(len(report.engines))
    if len(plan) == 1:
        return (
            "one worker process per engine x placement (load, one warm-up, then the repetitions), engines alternating"
        )
    engines = [ENGINE_NAMES[e] for e in report.engines]
    rounds = [", ".join(engines if k % 2 == 0 else engines[::-1]) for k in range(min(len(plan), 2))]
    count = "two" if len(plan) == 2 else str(len(plan))
    return (
        f"{count} worker processes per engine x placement, in the order {', '.join(rounds)}"
        + (", and so on" if len(plan) > 2 else "")
        + f" (each: load, one warm-up, then its repetitions: {', '.join(map(str, plan))})"
    )


def _round_ratios(report: Report) -> list[tuple[str, list[float]]]:
    """Per placement with both engines and more than one round of processes: tandem's decode over llama.cpp's in
    each round where both processes ran a repetition (compare.py's schedule)."""
    plan = report.settings.process_plan(len(report.engines))
    if len(plan) < 2 or set(report.engines) != {"tandem", "llamacpp"}:
        return []
    bounds = [sum(plan[:k]) for k in range(len(plan) + 1)]
    out = []
    for i, placement in enumerate(report.placements):
        rows = {r.engine: r for r in report.rows if r.index == i}
        ratios = []
        for k in range(len(plan)):
            tg = {e: [t for run in rows[e].runs[bounds[k] : bounds[k + 1]] for t in run["tg_s"]] for e in rows}
            if tg.get("tandem") and tg.get("llamacpp"):
                ratios.append(statistics.median(tg["llamacpp"]) / statistics.median(tg["tandem"]))
        if len(ratios) > 1:
            out.append((placement.label, ratios))
    return out


def render_markdown(report: Report) -> str:
    """The table (engine x placement: speeds, memory, load time, ratios), then notes and failures."""
    s = report.settings
    gpu = report.gpu
    lines = [
        f"# tandem vs llama.cpp: {Path(s.model).name}",
        "",
        f"- {report.created}; `{report.command}`",
        f"- CPU: {report.machine['cpu']} ({report.machine['logical_cpus']} logical CPUs{_cpu_line(report.machine)}), "
        f"GPU: {gpu or 'no GPU'}; threads {s.threads}, n_ctx {s.n_ctx}, n_batch {s.n_batch}, "
        f"KV cache {s.cache_type}",
        f"- pp {', '.join(map(str, s.pp))} / tg {s.tg}, {s.reps} repetitions each (median of those done: the "
        f"reps column), {_schedule_line(report)}",
        f"- load average at the start {_loadavg(report.machine.get('loadavg_start'))}, "
        f"at the end {_loadavg(report.machine.get('loadavg_end'))} (other work on the CPUs skews the figures)",
        "",
    ]
    head = ["engine", "placement", "status", "reps"] + [f"pp{n} tok/s" for n in s.pp]
    head += [f"tg{s.tg} tok/s", "peak VRAM MiB", "peak RSS MiB", "load / warm-up s", "tandem/llama.cpp"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report.rows:
        m = r.metrics(s.pp, s.tg)
        if m["vram_used_bytes"] is not None:
            vram = _mib(m["vram_used_bytes"])
            if m["vram_torch_peak_bytes"] is not None:
                vram += f" (torch {_mib(m['vram_torch_peak_bytes'])})"
        else:
            vram = "—" if not r.runs else "no GPU"
        ratio = ""
        if r.engine == "tandem" and "llamacpp" in report.engines:
            parts = [f"{k} {v:.2f}×" for k, v in report.ratios(r.index).items() if v is not None]
            ratio = ", ".join(parts) or "—"
        cells = [ENGINE_NAMES.get(r.engine, r.engine), f"`{r.placement.label}`", r.status, f"{r.reps_done}/{s.reps}"]
        cells += [_num(m["pp_tok_s"][str(n)]) for n in s.pp]
        load = f"{_num(m['load_s'], '{:.2f}')} / {_num(m['warmup_s'], '{:.2f}')}"
        cells += [_num(m["tg_tok_s"]), vram, _mib(m["peak_rss_bytes"]), load, ratio]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Speeds are tokens / median seconds over the repetitions done. Ratios are tandem's speed over llama.cpp's "
        "(> 1: tandem faster). "
        "pp: prefill of that many random token ids into an empty KV cache; tg: greedy decode steps right "
        f"after the pp{s.pp[0]} prefill. Peak VRAM: the driver's used memory (NVML or nvidia-smi, sampled "
        "every 50-200 ms) at its peak minus before loading, and for tandem torch's max_memory_allocated; "
        + ("no GPU on this machine, so no VRAM figures. " if gpu is None else "")
        + "Peak RSS: the worker process's ru_maxrss (mmapped weights count as they are touched). "
        "Load: opening the model to ready; warm-up: the one untimed prefill and decode before the repetitions.",
    ]
    repeated = [r for r in report.rows if sum(len(run["tg_s"]) for run in r.runs) > 1]
    if repeated:  # the spread within a row is the machine's noise: what a ratio near 1 must be read against
        lines += ["", f"tg{s.tg} tok/s of each repetition, in the order run:", ""]
        for r in repeated:
            speeds = ", ".join(_num(s.tg / t) for run in r.runs for t in run["tg_s"])
            lines.append(f"- {ENGINE_NAMES.get(r.engine, r.engine)} `{r.placement.label}`: {speeds}")
        rounds = _round_ratios(report)
        if rounds:
            lines += ["", f"tandem/llama.cpp tg{s.tg} by round (each round's tandem process against its llama.cpp one, "
                      "the medians of their repetitions; ratios that all lie on one side of 1 are a lead, not noise):",
                      ""]  # fmt: skip
            lines += [f"- `{label}`: {', '.join(f'{x:.2f}×' for x in ratios)}" for label, ratios in rounds]
    translated = [r for r in report.rows if r.engine == "llamacpp" and isinstance(r.llama, dict)]
    if translated:
        lines += ["", "llama.cpp placements (n_gpu_layers; tensor_buft_overrides, first match wins):", ""]
        for r in translated:
            assert isinstance(r.llama, dict)
            ov = "; ".join(f"`{p}`→{d}" for p, d in r.llama["overrides"][:6])
            more = len(r.llama["overrides"]) - 6
            ov += f"; … {more} more" if more > 0 else ""
            lines.append(f"- `{r.placement.label}`: n_gpu_layers {r.llama['n_gpu_layers']}; {ov or 'no overrides'}")
    loaded = [r for r in report.rows if r.runs and r.runs[0].get("weight_bytes")]
    if loaded:
        lines += ["", "Weights by buffer, as loaded (MiB; llama.cpp's from its log):", ""]
        for r in loaded:
            parts = ", ".join(f"{k} {v / MIB:,.0f}" for k, v in sorted(r.runs[0]["weight_bytes"].items()))
            lines.append(f"- {ENGINE_NAMES.get(r.engine, r.engine)} `{r.placement.label}`: {parts}")
    fa = [r for r in report.rows if r.engine == "llamacpp" and r.runs and r.runs[0].get("flash_attention")]
    if fa:  # its default (auto) turns it on for the CPU too; tandem's CPU attention is llama.cpp's graph without it
        lines += ["", "llama.cpp's flash attention (its default `-fa auto`, as its log resolved it):", ""]
        lines += [f"- `{r.placement.label}`: {r.runs[0]['flash_attention']}" for r in fa]
    noticed = [r for r in report.rows if r.runs and r.runs[0].get("notices")]
    if noticed:  # what tandem's own options and fallbacks did (e.g. TANDEM_AMX, --repack-experts)
        lines += ["", "tandem's notices at load:", ""]
        for r in noticed:
            lines.append(f"- `{r.placement.label}`: " + "; ".join(r.runs[0]["notices"]))
    failed = [r for r in report.rows if r.status != "ok"]
    if failed:
        lines += ["", "## What did not run", ""]
        for r in failed:
            lines += [f"**{ENGINE_NAMES.get(r.engine, r.engine)} `{r.placement.label}`: {r.status}**", ""]
            lines += ["```", (r.error or "(no message)").strip(), "```", ""]
    if not report.finished:
        lines += ["", "_In progress: this report is rewritten after every repetition._"]
    return "\n".join(lines).rstrip() + "\n"


def write_report(report: Report, directory: Path, png: bool = True) -> None:
    """Write report.json and report.md (and report.png) into `directory`, each replaced atomically."""
    directory.mkdir(parents=True, exist_ok=True)
    _atomic_write(directory / "report.json", json.dumps(report.to_json(), indent=1) + "\n")
    _atomic_write(directory / "report.md", render_markdown(report))
    if png:
        try:
            from tandem.bench.plot import render_png

            note = render_png(directory / "report.json", directory / "report.png")
        except Exception as e:  # the chart is a convenience: a broken matplotlib must not cost the report
            first_line = (str(e).strip().splitlines() or [""])[0]
            note = f"report.png was not drawn: {type(e).__name__}: {first_line}"
        if note:
            _atomic_write(directory / "report.md", render_markdown(report) + f"\n_{note}_\n")


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
