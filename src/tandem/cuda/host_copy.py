"""A host op's hand-off as kernels that read and write its page-locked host buffers directly (zero-copy).

Page-locked host memory is mapped into the GPU's address space (unified addressing), so a kernel can store
into it and load from it over PCIe. A host op's inputs -- the routed hidden states, cast to f32, the expert
ids and the mixing weights -- then leave in ONE kernel (`to_host`) instead of a cast kernel and a copy-engine
copy per input, and the result comes back cast in one kernel (`from_host`) instead of a copy and a cast. In a
Qwen3-30B-A3B `--cpu-moe` decode step that is six graph nodes fewer per layer (of ~20, each 1-3 µs plus the
gap before the next), all on the critical path between two ggml computes (48 per token).

Ordering: what a kernel stores in host memory is visible to the host once the stream passes a later
`cuStreamWriteValue32` (the driver fences before it: cuda/host_memory.py HostFlag) or an event the host
waits for; the host's stores are visible to a kernel launched after the stream saw the host's flag or after
the host's synchronous work. Loads bypass the caches (`.cv`), so a replay never reads a stale line.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

BLOCK = 512  # elements per program: an 8 KiB decode row in four programs, whose PCIe transfers overlap
MAX_INPUTS = 3  # inputs one `to_host` launch carries (a routed-experts op has three)


@triton.jit
def _cast_store(src_ptr, dst_ptr, n, offs):
    ok = offs < n
    v = tl.load(src_ptr + offs, mask=ok)
    tl.store(dst_ptr + offs, v.to(dst_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _to_host(s0, d0, n0, s1, d1, n1, s2, d2, n2, BLOCK: tl.constexpr):
    """dst_k[i] = src_k[i] cast to dst_k's type, i < n_k, for the three pairs (n_k = 0: an unused pair)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    _cast_store(s0, d0, n0, offs)
    _cast_store(s1, d1, n1, offs)
    _cast_store(s2, d2, n2, offs)


@triton.jit
def _from_host(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    v = tl.load(src_ptr + offs, mask=ok, cache_modifier=".cv")  # host memory: never a cached copy
    tl.store(dst_ptr + offs, v.to(dst_ptr.dtype.element_ty), mask=ok)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)


def to_host(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor]) -> None:
    """dsts[k] (page-locked, contiguous) = srcs[k] (GPU) cast to dsts[k]'s dtype, queued on the current stream:
    one kernel for up to MAX_INPUTS pairs where the GPU can address the buffers, else a copy per pair."""
    assert len(srcs) == len(dsts)
    if not _kernels_reach(srcs[0].device, dsts) or len(srcs) > MAX_INPUTS:
        for src, dst in zip(srcs, dsts, strict=True):
            dst.copy_(src, non_blocking=True)
        return
    pairs = [(_flat(s), d.view(-1)) for s, d in zip(srcs, dsts, strict=True)]
    assert all(s.numel() == d.numel() for s, d in pairs), [(s.shape, d.shape) for s, d in pairs]
    n = max(s.numel() for s, _ in pairs)
    if n == 0:
        return
    args = []
    for k in range(MAX_INPUTS):  # unused pairs repeat the first with nothing to copy
        s, d = pairs[k] if k < len(pairs) else pairs[0]
        args += [s, d, s.numel() if k < len(pairs) else 0]
    _to_host[(triton.cdiv(n, BLOCK),)](*args, BLOCK=BLOCK, num_warps=4)


def from_host(src: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A new tensor on `device` of `dtype`, src's shape: src (page-locked, contiguous) cast, read by one kernel
    where the GPU can address it, else a copy and a cast. Queued on the current stream."""
    if not _kernels_reach(device, [src]):
        return src.to(device, non_blocking=True).to(dtype)
    out = torch.empty(src.shape, dtype=dtype, device=device)
    n = src.numel()
    if n:
        _from_host[(triton.cdiv(n, BLOCK),)](src.view(-1), out.view(-1), n, BLOCK=BLOCK, num_warps=4)
    return out


def _kernels_reach(device: torch.device, host: Sequence[torch.Tensor]) -> bool:
    """Whether these kernels can address the host buffers from `device`: a GPU, page-locked buffers (checked
    once per device: the launcher refuses memory the GPU cannot map), or Triton's interpreter (all CPU)."""
    if device.type != "cuda":
        return device.type == "cpu" and _interpreting()
    if not all(t.is_pinned() and t.is_contiguous() for t in host):
        return False
    return _maps_host_memory(device.index if device.index is not None else torch.cuda.current_device())


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _maps_host_memory(device_index: int) -> bool:
    """One round trip through page-locked memory by the two kernels, outside any capture."""
    from tandem.cuda.host_memory import pinned_empty

    try:
        with torch.cuda.device(device_index):
            host = pinned_empty((4,), torch.float32)
            src = torch.arange(4, dtype=torch.float32, device=f"cuda:{device_index}")
            _to_host[(1,)](src, host, 4, src, host, 0, src, host, 0, BLOCK=BLOCK, num_warps=4)
            back = torch.empty(4, dtype=torch.float32, device=src.device)
            _from_host[(1,)](host, back, 4, BLOCK=BLOCK, num_warps=4)
            torch.cuda.synchronize(device_index)
            return torch.equal(back, src)
    except (ValueError, RuntimeError):  # "cannot be accessed from Triton": the copy engine does it instead
        return False
