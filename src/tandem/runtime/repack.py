"""CPU-resident expert stacks copied into ggml's repacked (interleaved) layout, when host RAM allows.

ggml's interleaved Q4_K kernels compute a decode token's expert products faster than its one-row kernels on
the file's blocks: Qwen3-30B-A3B `--cpu-moe` decoded 45.8 tok/s with the stacks repacked against 40.4 without
(one H200 host, 16 threads, 8 repetitions each, 2026-11-30 23:05; llama.cpp 39.8 in the same call, experts in
its file mapping). The copy costs host RAM equal to those stacks, on top of the file's pages, which stay
(prefill streams them to the GPU). So `auto`, the default, repacks only when a GPU computes the rest of the
model and the machine has RAM to spare (`fits_in_ram`); `on` always, `off` never. The stacks are repacked by
a pool of threads while the layers load (ggml's repack of one tensor is single-threaded, ~0.7 GB/s).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable
from pathlib import Path

from tandem.errors import TandemError
from tandem.gguf import TensorInfo
from tandem.quant.ggml_weights import GGMLWeight, repack_experts, repackable_experts

REPACK_MODES = ("auto", "on", "off")
# `auto` repacks when at least this share of the machine's RAM is still available after the copy, counting the
# experts' file pages as not yet in RAM (they are page-locked for prefill, so they cannot be reclaimed later).
RAM_KEPT_FREE = 0.10


def repack_mode(value: bool | str | None) -> str:
    """The mode of `--repack-experts` / `repack_experts=`: auto, on or off (True and False: on and off)."""
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return "on" if value else "off"
    if value not in REPACK_MODES:
        raise TandemError(f"repack_experts must be one of {', '.join(REPACK_MODES)}, got '{value}'")
    return value


def meminfo(path: Path = Path("/proc/meminfo")) -> dict[str, int]:
    """/proc/meminfo in bytes ({} where there is none)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            out[key] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return out


def fits_in_ram(copy_bytes: int, file_bytes: int, memory: dict[str, int]) -> tuple[bool, str]:
    """Whether a copy of `copy_bytes` leaves RAM_KEPT_FREE of the RAM available once the `file_bytes` the
    experts take in the file are in RAM too; and why, in words."""
    total, available = memory.get("MemTotal"), memory.get("MemAvailable")
    if not total or available is None:
        return False, "the host's free memory is unknown"
    left = available - copy_bytes - file_bytes
    need = f"{(copy_bytes + file_bytes) / 2**30:.1f} GiB with the experts' file pages"
    have = f"{available / 2**30:.1f} GiB available of {total / 2**30:.1f}"
    return left >= RAM_KEPT_FREE * total, f"{need}, {have}"


class ExpertRepacks:
    """The repacked copies of the expert stacks the plan keeps on the CPU, made by a thread pool as loading goes."""

    def __init__(self, experts: Iterable[TensorInfo], mode: str, on_gpu: bool, threads: int) -> None:
        experts = list(experts)
        stacks = [i for i in experts if len(i.shape) == 3 and repackable_experts(GGMLWeight(i.data, i.qtype, i.shape))]
        self.mode = mode
        self.copy_bytes = sum(i.n_bytes for i in stacks)
        self.notice = ""
        self._pending: dict[str, concurrent.futures.Future[GGMLWeight]] = {}
        if not stacks or mode == "off":
            return
        if mode == "auto":
            if not on_gpu:  # on the CPU alone, opt-in: llama.cpp's -ngl 0 figures are measured without it
                return
            fits, why = fits_in_ram(self.copy_bytes, sum(i.n_bytes for i in experts), meminfo())
            if not fits:
                self.notice = f"--repack-experts auto: the experts stay in the file mapping ({why}; 'on' forces it)"
                return
        self.notice = f"--repack-experts: {self.copy_bytes >> 20} MiB of expert stacks repacked in host RAM ({mode})"
        pool = concurrent.futures.ThreadPoolExecutor(max(1, threads), thread_name_prefix="tandem-repack")
        for info in stacks:  # in layer order, as the loader asks for them
            self._pending[info.name] = pool.submit(repack_experts, GGMLWeight(info.data, info.qtype, info.shape))
        pool.shutdown(wait=False)

    def weight(self, info: TensorInfo) -> GGMLWeight:
        """The stack as ggml computes it: its repacked copy when one is being made, else the file's blocks."""
        future = self._pending.pop(info.name, None)
        if future is None:
            return GGMLWeight(info.data, info.qtype, info.shape)
        try:
            return future.result()
        except MemoryError as e:
            raise TandemError(f"repacking {info.name}: {e} (--repack-experts off keeps the file's blocks)") from None
