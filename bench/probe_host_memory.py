"""Host-to-GPU copy paths for expert blocks in a memory-mapped GGUF file (run on the device).

    python bench/probe_host_memory.py MODEL.gguf [--mib 256]

Prints, for a span of the file's expert tensors: whether the driver page-locks the mapping in place
(read-only and plain flags), whether copies from it then work, and the copy rate of each way to move
those bytes to the GPU: pageable (the driver's bounce buffers), registered in place, and through a
page-locked bounce buffer filled by a CPU copy.
"""

from __future__ import annotations

import argparse
import time

import torch

from tandem.cuda.host_memory import pinned_empty, register_host
from tandem.gguf import open_gguf
from tandem.placement import expert_layer


def _rate(n_bytes: int, fn) -> str:  # type: ignore[no-untyped-def]
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    reps = 3
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return f"{n_bytes * reps / (time.perf_counter() - start) / 1e9:.1f} GB/s"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--mib", type=int, default=256)
    a = p.parse_args()
    f = open_gguf(a.model)
    experts = [i for n, i in f.tensors.items() if expert_layer(n) is not None and len(i.shape) == 3]
    first = experts[0]
    n = min(a.mib << 20, first.n_bytes)
    src = torch.from_numpy(first.data[:n])
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    print(f"span: {first.name}, {n >> 20} MiB")
    print("pageable:", _rate(n, lambda: dst.copy_(src, non_blocking=True)))
    bounce = pinned_empty((n,), torch.uint8)
    print(
        "bounce (CPU copy into page-locked, then DMA):",
        _rate(n, lambda: dst.copy_(bounce.copy_(src), non_blocking=True)),
    )
    print("page-locked DMA alone:", _rate(n, lambda: dst.copy_(bounce, non_blocking=True)))
    print("CPU copy alone:", _rate(n, lambda: bounce.copy_(src)))
    ptr = first.data.__array_interface__["data"][0]
    start = time.perf_counter()
    reg = register_host(ptr, n, read_only=True, owner=first.data, device=torch.device("cuda"))
    print(f"register in place: {reg if isinstance(reg, str) else 'ok'} ({time.perf_counter() - start:.2f} s)")
    if not isinstance(reg, str):
        try:
            print("registered DMA:", _rate(n, lambda: dst.copy_(src, non_blocking=True)))
            small = torch.from_numpy(first.data[:4096])
            print("small blocking copy from the registered range:", small.to("cuda").sum().item() >= 0)
        except Exception as e:  # noqa: BLE001 - a probe reports whatever happens
            print("copy from the registered range failed:", str(e).splitlines()[0])
        reg.close()


if __name__ == "__main__":
    main()
