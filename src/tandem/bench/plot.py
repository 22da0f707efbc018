"""report.png: grouped bars per placement (tandem beside llama.cpp) for each speed, with the ratio on top,
and the peak memory of each engine. Failed rows show as a labelled gap."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.bench.report import Report

COLORS = {"tandem": "#2b7bba", "llamacpp": "#e0782f"}
MIB = 2**20


def render_png(report: Report, path: Path) -> None:
    """Draw the report's speeds and memory into `path` (headless: the Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tandem.bench.report import ENGINE_NAMES

    s = report.settings
    metrics = [(f"pp{n}", f"prefill pp{n} (tok/s)") for n in s.pp] + [(f"tg{s.tg}", f"decode tg{s.tg} (tok/s)")]
    n_panels = len(metrics) + 1
    fig, axes = plt.subplots(1, n_panels, figsize=(3.6 * n_panels + 1, 4.2), squeeze=False)
    labels = [p.label for p in report.placements]
    engines = list(report.engines)
    width = 0.8 / len(engines)
    rows = {(r.engine, r.index): r for r in report.rows}
    values = {key: r.metrics(s.pp, s.tg) for key, r in rows.items()}

    def speed(engine: str, i: int, key: str) -> float | None:
        m = values[(engine, i)]
        return m["tg_tok_s"] if key.startswith("tg") else m["pp_tok_s"][key[2:]]

    for ax, (key, title) in zip(axes[0], metrics, strict=False):
        top = max((speed(e, i, key) or 0 for e in engines for i in range(len(labels))), default=0) or 1
        for k, engine in enumerate(engines):
            for i in range(len(labels)):
                x = i + (k - (len(engines) - 1) / 2) * width
                v = speed(engine, i, key)
                label = ENGINE_NAMES.get(engine, engine) if i == 0 else None
                if v is None:
                    ax.bar(x, 0, width, color=COLORS.get(engine, "grey"), label=label)
                    ax.text(x, top * 0.02, rows[(engine, i)].status, rotation=90, ha="center", va="bottom", fontsize=7)
                    continue
                ax.bar(x, v, width, color=COLORS.get(engine, "grey"), label=label)
                ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
        for i in range(len(labels)):
            r = report.ratios(i).get(key)
            if r is not None:
                ax.text(i, top * 1.12, f"{r:.2f}×", ha="center", va="bottom", fontsize=9, fontweight="bold")
        ax.set_ylim(0, top * 1.3)
        ax.set_title(title, fontsize=10)
        _placement_ticks(ax, labels)
    ax = axes[0][-1]
    gpu = report.gpu is not None
    kinds = [("peak_rss_bytes", "RSS")] + ([("vram_used_bytes", "VRAM")] if gpu else [])
    n_bars = len(engines) * len(kinds)
    w = 0.8 / n_bars
    j = 0
    for engine in engines:
        for field, name in kinds:
            for i in range(len(labels)):
                v = values[(engine, i)][field]
                x = i + (j - (n_bars - 1) / 2) * w
                ax.bar(
                    x,
                    (v or 0) / MIB,
                    w,
                    color=COLORS.get(engine, "grey"),
                    hatch="//" if name == "VRAM" else None,
                    edgecolor="white",
                    label=f"{ENGINE_NAMES.get(engine, engine)} {name}" if i == 0 else None,
                )
            j += 1
    ax.set_title("peak memory (MiB)" + ("" if gpu else ", RSS only: no GPU"), fontsize=10)
    _placement_ticks(ax, labels)
    ax.legend(fontsize=7)
    axes[0][0].legend(fontsize=8, loc="upper left")
    fig.suptitle(
        f"tandem vs llama.cpp — {Path(s.model).name}, {s.threads} threads, "
        f"{report.gpu or 'no GPU'} (ratio = tandem / llama.cpp)",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path.with_name(path.name + ".tmp.png"), dpi=110)
    plt.close(fig)
    path.with_name(path.name + ".tmp.png").replace(path)


def _placement_ticks(ax: object, labels: list[str]) -> None:
    ax.set_xticks(range(len(labels)))  # type: ignore[attr-defined]
    ax.set_xticklabels([label.replace(" ", "\n", 1) for label in labels], fontsize=7)  # type: ignore[attr-defined]
