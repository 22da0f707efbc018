"""report.png: grouped bars per placement (tandem beside llama.cpp) for each speed, with the ratio on top,
and the peak memory of each engine. Failed rows show as a labelled gap.

Drawn from report.json in a FRESH interpreter that imports nothing but matplotlib (Agg backend):

    python -P src/tandem/bench/plot.py DIR/report.json DIR/report.png

run by path, not with `-m tandem.bench.plot`, since importing the `tandem` package pulls in torch. In the
orchestrator's own process matplotlib once failed to import (`SystemError: <built-in method __getattr__ of
pybind11_builtins.pybind11_detail_function_record_v1_...> returned NULL`, inside ft2font: two extensions'
pybind11 internals clashing, torch's or ggml's already loaded). render_png() starts that interpreter with a
timeout; when it fails, the chart is drawn without matplotlib: with Pillow if importable (bars, values and
labels), else by a bare PNG writer (zlib + struct: coloured bars on a grid, no text), and render_png returns
a note for report.md saying so.

This file imports only the standard library at module level (matplotlib and Pillow inside the functions
that use them), so that the subprocess stays that lean.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

COLORS = {"tandem": "#2b7bba", "llamacpp": "#e0782f"}
ENGINE_NAMES = {"tandem": "tandem", "llamacpp": "llama.cpp"}
MIB = 2**20
TIMEOUT_S = 90.0  # matplotlib's first import on a fresh machine builds its font cache (seconds to tens)

# For tests and dry runs: "fail" makes the matplotlib subprocess exit with a SystemError like the one seen on
# the GPU image, "hang" makes it sleep past the timeout. The fallbacks then draw the chart.
INJECT_ENV = "TANDEM_BENCH_PLOT_INJECT"


# -- the data, from report.json -------------------------------------------------------------------------------
class Chart:
    """What every drawing needs, read from report.json's dict."""

    def __init__(self, rep: dict[str, Any]) -> None:
        s = rep["settings"]
        self.pp: list[int] = list(s["pp"])
        self.tg: int = s["tg"]
        self.model = Path(s["model"]).name
        self.threads = s["threads"]
        self.gpu: str | None = rep["machine"].get("gpu")
        self.engines: list[str] = list(rep["engines"])
        self.labels: list[str] = [p["label"] for p in rep["placements"]]
        self.rows: dict[tuple[str, int], dict[str, Any]] = {}
        for k, r in enumerate(rep["rows"]):
            index = r.get("placement_index", k // max(1, len(self.engines)))
            self.rows[(r["engine"], index)] = r
        self.metrics = [(f"pp{n}", f"prefill pp{n} (tok/s)") for n in self.pp]
        self.metrics.append((f"tg{self.tg}", f"decode tg{self.tg} (tok/s)"))

    def speed(self, engine: str, i: int, key: str) -> float | None:
        r = self.rows.get((engine, i))
        if r is None:
            return None
        return r["tg_tok_s"] if key.startswith("tg") else r["pp_tok_s"].get(key[2:])

    def status(self, engine: str, i: int) -> str:
        r = self.rows.get((engine, i))
        return r["status"] if r else "not run"

    def ratio(self, i: int, key: str) -> float | None:
        r = self.rows.get(("tandem", i))
        ratios = (r or {}).get("ratio_tandem_over_llamacpp") or {}
        return ratios.get(key)

    def memory(self, engine: str, i: int, field: str) -> float:
        r = self.rows.get((engine, i)) or {}
        return (r.get(field) or 0) / MIB

    @property
    def memory_kinds(self) -> list[tuple[str, str]]:
        return [("peak_rss_bytes", "RSS")] + ([("vram_used_bytes", "VRAM")] if self.gpu else [])

    @property
    def title(self) -> str:
        return (
            f"tandem vs llama.cpp — {self.model}, {self.threads} threads, "
            f"{self.gpu or 'no GPU'} (ratio = tandem / llama.cpp)"
        )


# -- matplotlib (in the subprocess) ----------------------------------------------------------------------------
def draw_matplotlib(chart: Chart, path: Path) -> None:
    """The full chart; call only in a process that has not loaded torch (see the module docstring)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_panels = len(chart.metrics) + 1
    fig, axes = plt.subplots(1, n_panels, figsize=(3.6 * n_panels + 1, 4.2), squeeze=False)
    engines, labels = chart.engines, chart.labels
    width = 0.8 / len(engines)
    for ax, (key, title) in zip(axes[0], chart.metrics, strict=False):
        top = max((chart.speed(e, i, key) or 0 for e in engines for i in range(len(labels))), default=0) or 1
        for k, engine in enumerate(engines):
            for i in range(len(labels)):
                x = i + (k - (len(engines) - 1) / 2) * width
                v = chart.speed(engine, i, key)
                label = ENGINE_NAMES.get(engine, engine) if i == 0 else None
                if v is None:
                    ax.bar(x, 0, width, color=COLORS.get(engine, "grey"), label=label)
                    ax.text(x, top * 0.02, chart.status(engine, i), rotation=90, ha="center", va="bottom", fontsize=7)
                    continue
                ax.bar(x, v, width, color=COLORS.get(engine, "grey"), label=label)
                ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
        for i in range(len(labels)):
            r = chart.ratio(i, key)
            if r is not None:
                ax.text(i, top * 1.12, f"{r:.2f}×", ha="center", va="bottom", fontsize=9, fontweight="bold")
        ax.set_ylim(0, top * 1.3)
        ax.set_title(title, fontsize=10)
        _placement_ticks(ax, labels)
    ax = axes[0][-1]
    kinds = chart.memory_kinds
    n_bars = len(engines) * len(kinds)
    w = 0.8 / n_bars
    j = 0
    for engine in engines:
        for field, name in kinds:
            for i in range(len(labels)):
                x = i + (j - (n_bars - 1) / 2) * w
                ax.bar(
                    x,
                    chart.memory(engine, i, field),
                    w,
                    color=COLORS.get(engine, "grey"),
                    hatch="//" if name == "VRAM" else None,
                    edgecolor="white",
                    label=f"{ENGINE_NAMES.get(engine, engine)} {name}" if i == 0 else None,
                )
            j += 1
    ax.set_title("peak memory (MiB)" + ("" if chart.gpu else ", RSS only: no GPU"), fontsize=10)
    _placement_ticks(ax, labels)
    ax.legend(fontsize=7)
    axes[0][0].legend(fontsize=8, loc="upper left")
    fig.suptitle(chart.title, fontsize=11)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def _placement_ticks(ax: Any, labels: list[str]) -> None:
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels([label.replace(" ", "\n", 1) for label in labels], fontsize=7)


# -- the fallbacks (in the orchestrator's process) -------------------------------------------------------------
def _rgb(color: str) -> tuple[int, int, int]:
    return int(color[1:3], 16), int(color[3:5], 16), int(color[5:7], 16)


Bar = tuple[str, float | None, str]  # engine, value (None: no figure), what to write when there is none


def _panels(chart: Chart) -> list[tuple[str, list[list[Bar]], list[str]]]:
    """Per panel: its title, per placement its bars, and a note per placement (the ratio)."""
    out = []
    for key, title in chart.metrics:
        bars = [
            [(e, chart.speed(e, i, key), chart.status(e, i)) for e in chart.engines] for i in range(len(chart.labels))
        ]
        notes = [f"{r:.2f}x" if (r := chart.ratio(i, key)) is not None else "" for i in range(len(chart.labels))]
        out.append((title, bars, notes))
    bars = []
    for i in range(len(chart.labels)):
        group: list[Bar] = []
        for e in chart.engines:
            group += [(e, chart.memory(e, i, field), "-") for field, _ in chart.memory_kinds]
        bars.append(group)
    out.append(("peak memory (MiB)" + ("" if chart.gpu else ", RSS only"), bars, [""] * len(chart.labels)))
    return out


PANEL_W, PANEL_H, TOP, BOTTOM = 300, 260, 40, 50


def _layout(chart: Chart) -> list[tuple[int, int, int, int, str, float | None, str]]:
    """Every bar as (x0, y0, x1, y1, engine, value, label above it), in a width x height canvas; y grows down."""
    out = []
    for p, (_, groups, _) in enumerate(_panels(chart)):
        top = max((v or 0 for g in groups for _, v, _ in g), default=0) or 1
        left = p * PANEL_W + 20
        group_w = (PANEL_W - 40) / max(1, len(groups))
        for i, group in enumerate(groups):
            bar_w = group_w * 0.8 / max(1, len(group))
            for k, (engine, v, missing) in enumerate(group):
                x0 = int(left + i * group_w + group_w * 0.1 + k * bar_w)
                h = int((PANEL_H - 30) * (v or 0) / top / 1.15)
                y1 = TOP + PANEL_H
                out.append((x0, y1 - max(h, 1), int(x0 + bar_w) - 1, y1, engine, v, missing))
    return out


def draw_pillow(chart: Chart, path: Path) -> None:
    """Bars with values, ratios, placement labels and a title, with Pillow's built-in font."""
    from PIL import Image, ImageDraw

    panels = _panels(chart)
    width, height = PANEL_W * len(panels), TOP + PANEL_H + BOTTOM + 10 * max(1, len(chart.engines))
    img = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(img)
    d.text((8, 6), chart.title.replace("—", "-"), fill="black")
    for x0, y0, x1, y1, engine, v, mark in _layout(chart):
        d.rectangle([x0, y0, x1, y1], fill=_rgb(COLORS.get(engine, "#808080")))
        d.text((x0, y0 - 12), f"{v:.0f}" if v else mark, fill="black")
    for p, (title, groups, notes) in enumerate(panels):
        left = p * PANEL_W + 20
        group_w = (PANEL_W - 40) / max(1, len(groups))
        d.text((left, TOP - 16), title, fill="black")
        d.line([left, TOP + PANEL_H, left + PANEL_W - 40, TOP + PANEL_H], fill="black")
        for i, label in enumerate(chart.labels):
            x = int(left + i * group_w + 2)
            d.text((x, TOP + PANEL_H + 4), label.split(" ", 1)[-1][:22], fill="black")
            if notes[i]:
                d.text((x + int(group_w / 3), TOP + 2), notes[i], fill="black")
    y = TOP + PANEL_H + 22
    for engine in chart.engines:
        d.rectangle([8, y, 18, y + 8], fill=_rgb(COLORS.get(engine, "#808080")))
        d.text((24, y - 2), ENGINE_NAMES.get(engine, engine), fill="black")
        y += 12
    tmp = path.with_name(path.name + ".tmp.png")
    img.save(tmp, format="PNG")
    tmp.replace(path)


def draw_bare(chart: Chart, path: Path) -> None:
    """The last resort: the same bars as draw_pillow on a white canvas, no text, written with zlib + struct."""
    panels = _panels(chart)
    width, height = PANEL_W * len(panels), TOP + PANEL_H + BOTTOM
    white = b"\xff\xff\xff"
    rows = [bytearray(white * width) for _ in range(height)]

    def fill(x0: int, y0: int, x1: int, y1: int, rgb: bytes) -> None:
        x0, x1 = max(0, x0), min(width - 1, x1)
        for y in range(max(0, y0), min(height, y1 + 1)):
            rows[y][3 * x0 : 3 * (x1 + 1)] = rgb * (x1 - x0 + 1)

    for p in range(len(panels)):  # the axis line of each panel, and a grey separator between panels
        left = p * PANEL_W + 20
        fill(left, TOP + PANEL_H, left + PANEL_W - 40, TOP + PANEL_H, b"\x00\x00\x00")
        if p:
            fill(p * PANEL_W, TOP, p * PANEL_W, TOP + PANEL_H, b"\xc0\xc0\xc0")
    for x0, y0, x1, y1, engine, _, _ in _layout(chart):
        fill(x0, y0, x1, y1, bytes(_rgb(COLORS.get(engine, "#808080"))))
    tmp = path.with_name(path.name + ".tmp.png")
    tmp.write_bytes(png_bytes(width, height, rows))
    tmp.replace(path)


def png_bytes(width: int, height: int, rows: list[bytearray]) -> bytes:
    """A minimal RGB PNG (8 bits per channel, no filter)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + bytes(r) for r in rows)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")


# -- what the orchestrator calls -----------------------------------------------------------------------------
def _subprocess_cmd(json_path: Path, png_path: Path) -> list[str]:
    isolated = ["-P"] if sys.version_info >= (3, 11) else []  # not this file's folder first on sys.path
    return [sys.executable, *isolated, str(Path(__file__).resolve()), str(json_path), str(png_path)]


def render_png(json_path: Path, png_path: Path, timeout_s: float = TIMEOUT_S) -> str | None:
    """Draw `png_path` from `json_path`: matplotlib in a fresh interpreter, else a fallback here.

    Returns None when matplotlib drew it, else a note for report.md on what failed and what drew it instead.
    Raises only when every way failed.
    """
    env = {**os.environ, "MPLBACKEND": "Agg"}
    try:
        proc = subprocess.run(
            _subprocess_cmd(json_path, png_path),
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout_s,
            env=env,
            stdin=subprocess.DEVNULL,
        )
        if proc.returncode == 0 and png_path.is_file():
            return None
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        why = f"exit status {proc.returncode}: {lines[-1] if lines else '(no message)'}"
    except subprocess.TimeoutExpired:
        why = f"timed out after {timeout_s:g} s"
    except OSError as e:
        why = f"{type(e).__name__}: {e}"
    chart = Chart(json.loads(json_path.read_text(encoding="utf-8")))
    try:
        draw_pillow(chart, png_path)
        return f"report.png drawn with Pillow: matplotlib's subprocess failed ({why})"
    except Exception as e:  # Pillow missing or broken: the bare writer needs nothing
        pil = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
    draw_bare(chart, png_path)
    return (
        f"report.png drawn as plain bars without text (panels: {', '.join(t for t, _ in chart.metrics)}, "
        f"memory; blue tandem, orange llama.cpp): matplotlib's subprocess failed ({why}), Pillow too ({pil})"
    )


def main(argv: list[str] | None = None) -> int:
    """`plot.py REPORT_JSON OUT_PNG`: the matplotlib chart (what render_png's subprocess runs)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: plot.py REPORT_JSON OUT_PNG", file=sys.stderr)
        return 2
    inject = os.environ.get(INJECT_ENV, "")
    if inject == "fail":
        raise SystemError(f"injected matplotlib failure ({INJECT_ENV}=fail)")
    if inject == "hang":
        import time

        time.sleep(3600)
    chart = Chart(json.loads(Path(args[0]).read_text(encoding="utf-8")))
    draw_matplotlib(chart, Path(args[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
