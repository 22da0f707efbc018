"""What the GPU memory outside torch's allocator is made of, one piece at a time: the driver's used memory after a
bare CUDA context, cuBLAS's first products (bf16, and bf16 operands with an f32 result as tandem's prefill asks),
and page-locking a file's whole mapping as tandem does for the experts it keeps in host RAM (cuMemHostRegister:
the GPU maps those pages, and its page tables are in VRAM).

    python bench/vram_context.py MODEL.gguf

First, whether torch's allocator took the expandable segments tandem asks for (runtime/devices.py). For
`bench/vram_breakdown.py`'s "driver - reserved" column: the context alone against the same after loading.
"""

from __future__ import annotations

import argparse
import mmap
import os

import numpy as np
import torch

from tandem.bench.vram import _open_source
from tandem.cuda.host_memory import register_host
from tandem.runtime.devices import prefer_expandable_segments

MIB = 2**20


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a file whose whole mapping is page-locked (the GGUF tandem would load)")
    args = p.parse_args()
    driver = _open_source()
    if driver is None:
        print("vram_context: no driver figures (no NVML, no nvidia-smi)")
        return 1
    before = driver.used()
    last = before
    print("| piece | driver MiB over before | its own MiB | torch reserved MiB |")
    print("|---|---|---|---|")

    def stage(name: str) -> None:
        nonlocal last
        torch.cuda.synchronize()
        used = driver.used()
        print(f"| {name} | {(used - before) / MIB:,.0f} | {(used - last) / MIB:,.0f} | "
              f"{torch.cuda.memory_reserved() / MIB:,.0f} |", flush=True)  # fmt: skip
        last = used

    prefer_expandable_segments()  # as tandem.LLM does: is it in effect when set after `import torch`?
    torch.empty(1, device="cuda")
    stage("CUDA context")
    probe = [torch.empty(30 * MIB, dtype=torch.uint8, device="cuda") for _ in range(3)]
    segments = sum(1 for seg in torch.cuda.memory_snapshot() if seg["total_size"] >= 30 * MIB)
    print(f"allocator: three 30 MiB tensors in {segments} segment(s) ({'expandable' if segments == 1 else 'fixed'} "
          f"segments; PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r})")  # fmt: skip
    del probe
    torch.cuda.empty_cache()
    a = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    _ = a @ b
    stage("cuBLAS bf16 product")
    _ = torch.mm(a, b, out_dtype=torch.float32)
    stage("cuBLAS bf16 -> f32 product")
    with open(args.model, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = np.frombuffer(mapping, dtype=np.uint8)
    reg = register_host(view.ctypes.data, view.nbytes, read_only=True, owner=view, device=torch.device("cuda"))
    if isinstance(reg, str):
        print(f"registration refused: {reg}")
        return 1
    stage(f"{view.nbytes / 2**30:.1f} GiB of file mapping page-locked")
    reg.close()
    stage("unregistered")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
