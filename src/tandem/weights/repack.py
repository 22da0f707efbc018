"""CPU-resident expert stacks copied into ggml's repacked (interleaved) layout (`--repack-experts`).

ggml's interleaved Q4_K kernels multiply a stack from a copy in its CPU_REPACK buffer. The copy costs host RAM
equal to those stacks. Where the whole model computes on the CPU it is the default, as llama.cpp's CPU backend
holds them (faster prefill: docs/PERFORMANCE.md); beside a GPU the file's pages stay too (prefill streams them to
the GPU) and no decode gain could be seen on the GPU machine (docs/FLAGS.md, `--repack-experts`), so there it is
opt-in. ggml repacks one
tensor on one thread, far slower than loading, so the stacks are repacked by a pool of threads, in layer order,
while the layers load.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable

from tandem.errors import TandemError
from tandem.gguf import TensorInfo
from tandem.quant.ggml_weights import GGMLWeight, repack_experts, repackable_experts


class ExpertRepacks:
    """The repacked copies of the expert stacks the plan keeps on the CPU (none when `enabled` is false), made by
    a thread pool as loading goes."""

    def __init__(self, experts: Iterable[TensorInfo], enabled: bool, threads: int, cpu_only: bool = False) -> None:
        self.copy_bytes = 0
        self._pending: dict[str, concurrent.futures.Future[GGMLWeight]] = {}
        if not enabled:
            return
        pool = concurrent.futures.ThreadPoolExecutor(max(1, threads), thread_name_prefix="tandem-repack")
        for info in experts:  # in layer order, as the loader asks for them
            w = GGMLWeight(info.data, info.qtype, info.shape) if len(info.shape) == 3 else None
            if w is not None and repackable_experts(w, cpu_only):
                self.copy_bytes += info.n_bytes
                self._pending[info.name] = pool.submit(repack_experts, w, cpu_only)
        pool.shutdown(wait=False)

    @property
    def notice(self) -> str:
        if not self.copy_bytes:  # off, or nothing this CPU's ggml repacks
            return ""
        return f"{self.copy_bytes >> 20} MiB of expert stacks repacked in host RAM for ggml's interleaved kernels"

    def weight(self, info: TensorInfo) -> GGMLWeight:
        """The stack as ggml computes it: its repacked copy when one is being made, else the file's blocks."""
        future = self._pending.pop(info.name, None)
        if future is None:
            return GGMLWeight(info.data, info.qtype, info.shape)
        try:
            return future.result()
        except MemoryError as e:
            raise TandemError(f"--repack-experts: {info.name}: {e}") from None
