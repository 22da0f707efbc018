"""Products with GGUF weights kept as blocks in GPU memory.

Decode (a few rows): `_qmv` reads the blocks once per row, straight from VRAM. Prefill (many rows):
the blocks are dequantized into a transient float workspace and multiplied by a dense GEMM (cuBLAS,
or a grouped Triton GEMM for experts), so the arithmetic runs on tensor cores.

Shapes: M = activation rows, N = output features, K = input features, E = experts, T = tokens,
A = active experts per token, R = T * A expert slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES

from tandem.cuda import qkernels as qk
from tandem.quant.types import GPU_DEQUANT_CHUNK_BYTES, GPU_NATIVE_TYPES

QMV_MAX_ROWS = 16  # up to this many rows, re-reading the blocks per row (from L2) beats dequantizing
DEQUANT_BN = 16
GMM_BM, GMM_BN, GMM_BK = 64, 64, 64


@dataclass(eq=False)
class GPUQuantWeight:
    """A weight kept as its raw GGUF blocks in VRAM: [N, K] or stacked experts [E, N, K]."""

    data: torch.Tensor  # uint8 on a CUDA device (or CPU under Triton's interpreter)
    qtype: Q
    shape: tuple[int, ...]

    @property
    def n_out(self) -> int:
        return self.shape[-2]

    @property
    def n_in(self) -> int:
        return self.shape[-1]

    @property
    def row_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return self.n_in // block * size

    @property
    def expert_bytes(self) -> int:
        return self.row_bytes * self.n_out


def _sub(qtype: Q) -> dict[str, int]:
    assert qtype in GPU_NATIVE_TYPES, qtype
    return (
        {"QT": int(qtype), "NSUB": 16, "SUBLEN": 16} if qtype == Q.Q6_K else {"QT": int(qtype), "NSUB": 8, "SUBLEN": 32}
    )


def dequantize_rows_gpu(w: GPUQuantWeight, first_row: int, n_rows: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows [first_row, first_row + n_rows) of the (expert-stacked) weight as a float [n_rows, K] tensor."""
    k = w.n_in
    out = torch.empty(n_rows, k, dtype=dtype, device=w.data.device)
    data = w.data[first_row * w.row_bytes : (first_row + n_rows) * w.row_bytes]
    grid = (triton.cdiv(n_rows, DEQUANT_BN), triton.cdiv(k, 256))
    qk._dequant[grid](data, out, n_rows, k, w.row_bytes, BN=DEQUANT_BN, **_sub(w.qtype))
    return out


def qmatmul(x: torch.Tensor, w: GPUQuantWeight, ieee: bool = False) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype."""
    m, k = x.shape
    assert k == w.n_in, (x.shape, w.shape)
    x = x.contiguous()
    y = torch.empty(m, w.n_out, dtype=x.dtype, device=x.device)
    if m > QMV_MAX_ROWS:  # dequantize a bounded slice of rows at a time, multiply with cuBLAS
        dtype = torch.float32 if ieee else torch.bfloat16
        rows = max(1, GPU_DEQUANT_CHUNK_BYTES // (k * dtype.itemsize))
        xd = x.to(dtype)
        for r0 in range(0, w.n_out, rows):
            n = min(rows, w.n_out - r0)
            y[:, r0 : r0 + n] = (xd @ dequantize_rows_gpu(w, r0, n, dtype).T).to(x.dtype)
        return y
    grid = lambda meta: (triton.cdiv(w.n_out, meta["BN"]), m)  # noqa: E731
    qk._qmv[grid](
        w.data, x, y, x, w.n_out, k, w.row_bytes, 0, 1, x.stride(0), y.stride(0), HAS_IDS=False, **_sub(w.qtype)
    )  # fmt: skip
    return y


def qmatmul_id(x: torch.Tensor, w: GPUQuantWeight, ids: torch.Tensor, ieee: bool = False) -> torch.Tensor:
    """Selected experts: x [T, K] (shared by a token's experts) or [T, A, K]; ids [T, A] -> [T, A, N]."""
    t, a = ids.shape
    k = w.n_in
    x_div = a if x.dim() == 2 else 1
    x2 = x.reshape(-1, k).contiguous()
    flat = ids.reshape(-1).to(torch.int32).contiguous()
    r = flat.numel()
    y = torch.empty(r, w.n_out, dtype=x.dtype, device=x.device)
    if r <= 2 * QMV_MAX_ROWS:
        grid = lambda meta: (triton.cdiv(w.n_out, meta["BN"]), r)  # noqa: E731
        qk._qmv[grid](
            w.data, x2, y, flat, w.n_out, k, w.row_bytes, w.expert_bytes, x_div, x2.stride(0), y.stride(0),
            HAS_IDS=True, **_sub(w.qtype),
        )  # fmt: skip
        return y.view(t, a, w.n_out)
    n_experts, n = w.shape[0], w.n_out
    tile_expert, slots = _align_slots(flat, n_experts, GMM_BM)
    tiles_per_expert = torch.bincount(tile_expert.long(), minlength=n_experts).tolist()  # host sync (prefill)
    dtype = torch.float32 if ieee else torch.bfloat16
    per_chunk = max(1, GPU_DEQUANT_CHUNK_BYTES // (n * k * dtype.itemsize))
    tile0 = 0
    for e0 in range(0, n_experts, per_chunk):
        n_tiles = sum(tiles_per_expert[e0 : e0 + per_chunk])
        if n_tiles == 0:
            continue
        e1 = min(e0 + per_chunk, n_experts)
        dense = dequantize_rows_gpu(w, e0 * n, (e1 - e0) * n, dtype)  # [(e1 - e0) * N, K]
        grid = (triton.cdiv(n, GMM_BN), n_tiles)
        qk._grouped_mm[grid](
            dense, x2, y, tile_expert - e0, slots, tile0, r, n, k, x_div, x2.stride(0), y.stride(0),
            IEEE=ieee, BM=GMM_BM, BN=GMM_BN, BK=GMM_BK,
        )  # fmt: skip
        tile0 += n_tiles
    return y.view(t, a, w.n_out)


def _align_slots(flat_ids: torch.Tensor, n_experts: int, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group expert slots by expert into tiles of `tile` rows (the last tile of each padded with -1).

    Returns (expert of each tile [n_tiles], slot index of each tile row [n_tiles * tile]).
    """
    r = flat_ids.numel()
    ids = flat_ids.long()
    order = torch.argsort(ids, stable=True)  # slots grouped by expert
    counts = torch.bincount(ids, minlength=n_experts)
    tiles = (counts + tile - 1) // tile
    padded_start = torch.cumsum(tiles * tile, 0) - tiles * tile
    start = torch.cumsum(counts, 0) - counts
    sorted_e = ids[order]
    dest = padded_start[sorted_e] + torch.arange(r, device=ids.device) - start[sorted_e]
    n_tiles = int(tiles.sum().item())  # one host sync per call; prefill only
    slots = torch.full((n_tiles * tile,), -1, dtype=torch.int32, device=ids.device)
    slots[dest] = order.to(torch.int32)
    tile_expert = torch.repeat_interleave(torch.arange(n_experts, device=ids.device), tiles).to(torch.int32)
    return tile_expert, slots
