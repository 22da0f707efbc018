"""Routing statistics: how often each routed expert of each layer was picked (`--expert-stats FILE`).

Counted on the GPU from every step's top-k (layers/moe.py `RoutingCounts`), added to what the file held at the
start, and written back when the model closes; the next start places the hottest experts in VRAM from them
(placement/plan.py). The file keeps the texts' counts in two halves too (each text's -- a request, or what slot 0
ran between two resets -- go to the half with fewer picks), so that the placement can tell a router's lasting
preferences, which both halves show, from a text's own hot set, which the next text does not share
(placement/experts.py `estimated_shares`).

A file belongs to one model's routers: its fingerprint hashes the architecture, the expert counts and each
router's name, shape, type and bytes (a sample of them), so the same model in another quantization matches (its
routers are F32 in every llama.cpp mix) and another model does not.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tandem.errors import TandemError, os_reason
from tandem.gguf import GGUFFile

if TYPE_CHECKING:  # tandem.models imports the weight loader, which imports this package
    from tandem.models.config import ModelConfig

FORMAT = "tandem-expert-stats"
VERSION = 1
ROUTER_SUFFIXES = (".ffn_gate_inp.weight", ".ffn_gate_inp.bias")
SAMPLE_BYTES = 1 << 16  # of each router tensor, from its start, middle and end
MAX_BYTES_PER_COUNT = 64  # a picks count in the file's JSON, with room for indentation (bounds what is read)


def routing_fingerprint(f: GGUFFile, cfg: ModelConfig) -> str:
    """A hex digest of what decides the routing: architecture, layers, experts, and the routers themselves."""
    h = hashlib.blake2b(digest_size=16)
    moe = cfg.moe
    h.update(f"{f.arch}|{cfg.n_layers}|{moe.n_experts if moe else 0}|{moe.n_active if moe else 0}".encode())
    for name in sorted(n for n in f.tensors if n.endswith(ROUTER_SUFFIXES)):
        info = f.tensors[name]
        h.update(f"|{name}|{info.qtype.name}|{info.shape}".encode())
        data = info.data
        n = data.nbytes
        for start in {0, max(0, n // 2 - SAMPLE_BYTES // 2), max(0, n - SAMPLE_BYTES)}:
            h.update(memoryview(np.ascontiguousarray(data[start : start + SAMPLE_BYTES])))
    return h.hexdigest()


@dataclass
class ExpertStats:
    """Picks per (layer, expert) int64 (layers without routed experts: zeros), kept in the two halves of the texts
    that added them: `halves` [2, n_layers, n_experts], `counts` their sum."""

    halves: np.ndarray
    fingerprint: str
    model: str  # the model's name, for messages
    path: Path | None = None  # where they are loaded from and saved to

    @property
    def counts(self) -> np.ndarray:
        return self.halves.sum(axis=0)

    @classmethod
    def empty(cls, f: GGUFFile, cfg: ModelConfig, path: str | os.PathLike[str] | None = None) -> ExpertStats:
        if cfg.moe is None:
            raise TandemError(f"--expert-stats: {f.path.name} has no routed experts to count")
        halves = np.zeros((2, cfg.n_layers, cfg.moe.n_experts), dtype=np.int64)
        return cls(halves, routing_fingerprint(f, cfg), _model_name(f), None if path is None else Path(path))

    @classmethod
    def open(cls, path: str | os.PathLike[str], f: GGUFFile, cfg: ModelConfig) -> ExpertStats:
        """The statistics in `path` if it exists (they must be this model's), else empty ones saved there later."""
        stats = cls.empty(f, cfg, path)
        p = Path(path)
        flag = f"--expert-stats {p}"
        text = _read_stats_file(p, flag, limit=MAX_BYTES_PER_COUNT * stats.halves.size * 3 // 2 + (1 << 16))
        if text is None:
            return stats
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError) as e:  # beside malformed JSON: 5,000-digit integers, deep nesting
            raise TandemError(f"{flag}: cannot read it as expert statistics ({type(e).__name__}: {e})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise TandemError(f"{flag}: not a tandem expert-statistics file (no \"format\": \"{FORMAT}\")")
        if doc.get("version") != VERSION:
            raise TandemError(f"{flag}: version {doc.get('version')!r}, this tandem reads version {VERSION}")
        if doc.get("fingerprint") != stats.fingerprint:
            raise TandemError(
                f"{flag}: recorded for another model ({str(doc.get('model'))[:80]!r}, routers "
                f"{str(doc.get('fingerprint'))[:12]}), not {stats.model!r} (routers {stats.fingerprint[:12]}); "
                "give another file, or delete it to count afresh"
            )
        try:
            counts = np.asarray(doc["counts"], dtype=np.int64)
        except (KeyError, TypeError, ValueError, OverflowError):
            raise TandemError(f"{flag}: \"counts\" is not a table of integers") from None
        shape = stats.halves.shape[1:]
        if counts.shape != shape or (counts < 0).any():
            raise TandemError(f"{flag}: counts of shape {counts.shape}, expected {shape}, non-negative")
        stats.halves = np.stack([counts, np.zeros_like(counts)])
        if "halves" in doc:  # files written before the halves have none: all their picks count as one half
            try:
                halves = np.asarray(doc["halves"], dtype=np.int64)
            except (TypeError, ValueError, OverflowError):
                raise TandemError(f"{flag}: \"halves\" is not a table of integers") from None
            if halves.shape != (2, *counts.shape) or (halves < 0).any() or not np.array_equal(halves.sum(0), counts):
                raise TandemError(f"{flag}: \"halves\" must be two non-negative tables that add up to \"counts\"")
            stats.halves = halves
        return stats

    def placement_counts(self) -> dict[str, object]:
        """plan_placement's keyword arguments for these statistics: the halves and a label (none without picks)."""
        if not self.total:
            return {}
        return {"expert_counts": self.halves, "counts_label": f"--expert-stats {self.path} ({self.total:,} picks)"}

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def add(self, counts: np.ndarray) -> None:
        """A text's picks [n_layers, n_experts], into the half that holds fewer."""
        half = int(self.halves[1].sum() < self.halves[0].sum())
        self.halves = self.halves.copy()
        self.halves[half] += np.asarray(counts, dtype=np.int64)

    def save(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Write the statistics (atomically: a temporary file renamed over the old one)."""
        target = Path(path) if path is not None else self.path
        if target is None:
            raise TandemError("--expert-stats: no file to save the statistics to")
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "model": self.model,
            "fingerprint": self.fingerprint,
            "n_layers": int(self.counts.shape[0]),
            "n_experts": int(self.counts.shape[1]),
            "picks": self.total,
            "counts": self.counts.tolist(),
            "halves": self.halves.tolist(),
        }
        # Through a symlink to the file it names: renaming over the link would replace the user's link, and the
        # file it points to would keep the old counts.
        real = Path(os.path.realpath(target))
        tmp = real.with_name(f".{real.name}.tmp-{os.getpid()}")
        try:
            tmp.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
            os.replace(tmp, real)
        except OSError as e:
            with contextlib.suppress(OSError):  # e.g. the folder is gone: the first error is the one to tell
                tmp.unlink(missing_ok=True)
            raise TandemError(f"--expert-stats {target}: cannot write ({os_reason(e)})") from None
        return target


def _read_stats_file(p: Path, flag: str, limit: int) -> str | None:
    """The file's text, or None where it does not exist yet and can be written at the end. Refused before anything
    runs: a FIFO or device (reading would block or never end), a file over `limit` bytes (a model, not statistics:
    it is not read into memory), a folder that cannot hold the file (a long run's counts would be lost at the end)."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        folder = Path(os.path.realpath(p)).parent  # where save() writes (through a symlink, its target's)
        if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
            raise TandemError(f"{flag}: no such file, and the folder {folder} cannot hold one") from None
        return None
    except OSError as e:
        raise TandemError(f"{flag}: cannot read it ({e.strerror or e})") from None
    with open(fd, "rb") as fh:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise TandemError(f"{flag}: not a regular file (a folder, FIFO or device), not expert statistics")
        if info.st_size > limit:
            raise TandemError(f"{flag}: {info.st_size:,} bytes, more than statistics of this model take "
                              f"({limit:,}): not an expert-statistics file")  # fmt: skip
        try:
            return fh.read(limit).decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TandemError(f"{flag}: cannot read it as expert statistics ({type(e).__name__}: {e})") from None


def _model_name(f: GGUFFile) -> str:
    name = f.get("general.name")
    return str(name) if isinstance(name, str) and name else f.path.name
