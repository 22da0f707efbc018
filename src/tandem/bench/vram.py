"""GPU memory as the driver sees it, sampled in a thread while a worker runs.

NVML (the `nvidia-ml-py` package, imported as `pynvml`) when importable, else `nvidia-smi`; on a machine
with neither, or no GPU, every figure is None and the report says "no GPU". The figure is the used memory
summed over the visible GPUs, so llama.cpp spreading layers over several GPUs is counted whole.

Standard library only (pynvml is plain ctypes): the llama.cpp worker loads this file by path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from dataclasses import dataclass
from typing import Any


@dataclass
class VramReading:
    """Driver figures in bytes: before the model was loaded, and the peak while the worker ran."""

    source: str | None  # "nvml", "nvidia-smi" or None (no GPU)
    baseline_bytes: int | None = None
    peak_bytes: int | None = None
    gpu_name: str | None = None

    @property
    def used_bytes(self) -> int | None:
        """Peak minus baseline: what this process added (other users of the GPU would blur it)."""
        if self.peak_bytes is None or self.baseline_bytes is None:
            return None
        return max(0, self.peak_bytes - self.baseline_bytes)

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "baseline_bytes": self.baseline_bytes,
            "peak_bytes": self.peak_bytes,
            "used_bytes": self.used_bytes,
            "gpu_name": self.gpu_name,
        }


def _visible_indices(count: int) -> list[int]:
    """Driver indices of the GPUs this process may use (CUDA_VISIBLE_DEVICES, when it lists numbers)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return list(range(count))
    out = []
    for part in env.split(","):
        part = part.strip()
        if part.isdigit() and int(part) < count:
            out.append(int(part))
    return out


class _Nvml:
    name = "nvml"

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        count = pynvml.nvmlDeviceGetCount()
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in _visible_indices(count)]
        if not self._handles:
            raise RuntimeError("NVML sees no visible GPU")
        raw = pynvml.nvmlDeviceGetName(self._handles[0])
        self.gpu_name = raw.decode() if isinstance(raw, bytes) else str(raw)

    def used(self) -> int:
        return sum(int(self._nvml.nvmlDeviceGetMemoryInfo(h).used) for h in self._handles)

    def close(self) -> None:
        self._nvml.nvmlShutdown()


class _Smi:
    name = "nvidia-smi"

    def __init__(self) -> None:
        exe = shutil.which("nvidia-smi")
        if exe is None:
            raise RuntimeError("no nvidia-smi")
        self._exe = exe
        rows = self._query("name,memory.used")
        self._indices = _visible_indices(len(rows))
        if not self._indices:
            raise RuntimeError("nvidia-smi lists no visible GPU")
        self.gpu_name = rows[self._indices[0]].split(",")[0].strip()

    def _query(self, fields: str) -> list[str]:
        out = subprocess.run(
            [self._exe, f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
        return [line for line in out.splitlines() if line.strip()]

    def used(self) -> int:
        rows = self._query("memory.used")
        return sum(int(float(rows[i])) * 2**20 for i in self._indices)  # MiB

    def close(self) -> None:
        pass


def _open_source() -> _Nvml | _Smi | None:
    for make in (_Nvml, _Smi):
        try:
            return make()
        except Exception:  # any failure means "this source is not there"
            continue
    return None


class VramSampler:
    """Samples the driver's used memory every `interval_s` from start() to stop(); a context manager."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self._interval = interval_s
        self._source = _open_source()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reading = VramReading(source=self._source.name if self._source else None)
        if self._source is not None:
            self.reading.gpu_name = self._source.gpu_name
            # nvidia-smi is a process per sample: slower, so sample it less often.
            if self._source.name == "nvidia-smi":
                self._interval = max(self._interval, 0.2)

    def _sample(self) -> None:
        assert self._source is not None
        try:
            used = self._source.used()
        except Exception:  # a failed sample is skipped, not fatal to the benchmark
            return
        if self.reading.baseline_bytes is None:
            self.reading.baseline_bytes = used
        self.reading.peak_bytes = max(self.reading.peak_bytes or 0, used)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self._sample()

    def start(self) -> VramSampler:
        """Take the baseline now (call before the model is loaded), then keep sampling in a thread."""
        if self._source is not None:
            self._sample()
            self._thread = threading.Thread(target=self._loop, name="vram-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> VramReading:
        """Take a last sample, stop the thread and return the reading."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._sample()
            assert self._source is not None
            self._source.close()
        return self.reading

    def __enter__(self) -> VramSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
