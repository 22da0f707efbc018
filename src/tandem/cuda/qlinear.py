"""Products with GGUF weights on the GPU: native Triton kernels for the common block formats,
dequantized-at-load dense weights for the rest.

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

NATIVE_TYPES: frozenset[Q] = frozenset({Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K})
QMV_MAX_ROWS = 8  # up to this many rows the GEMV kernel (weights re-read from L2 per row) wins
QMV_BN, QMV_BK = 16, 256
QMM_BM, QMM_BN, QMM_BK = 64, 64, 64


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


def qmatmul(x: torch.Tensor, w: GPUQuantWeight, ieee: bool = False) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype."""
    m, k = x.shape
    assert k == w.n_in and w.qtype in NATIVE_TYPES, (x.shape, w.shape, w.qtype)
    x = x.contiguous()
    y = torch.empty(m, w.n_out, dtype=x.dtype, device=x.device)
    if m <= QMV_MAX_ROWS:
        grid = (triton.cdiv(w.n_out, QMV_BN), m)
        qk._qmv[grid](
            w.data, x, y, x, w.n_out, k, w.row_bytes, 0, 1, x.stride(0), y.stride(0),
            QT=int(w.qtype), HAS_IDS=False, BN=QMV_BN, BK=QMV_BK,
        )  # fmt: skip
    else:
        grid = (triton.cdiv(w.n_out, QMM_BN), triton.cdiv(m, QMM_BM))
        qk._qmm[grid](
            w.data, x, y, x, x, m, w.n_out, k, w.row_bytes, 0, 1, x.stride(0), y.stride(0),
            QT=int(w.qtype), HAS_IDS=False, IEEE=ieee, BM=QMM_BM, BN=QMM_BN, BK=QMM_BK,
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
    if r <= QMV_MAX_ROWS * 4:
        grid = (triton.cdiv(w.n_out, QMV_BN), r)
        qk._qmv[grid](
            w.data, x2, y, flat, w.n_out, k, w.row_bytes, w.expert_bytes, x_div, x2.stride(0), y.stride(0),
            QT=int(w.qtype), HAS_IDS=True, BN=QMV_BN, BK=QMV_BK,
        )  # fmt: skip
    else:
        tile_expert, slots = _align_slots(flat, w.shape[0], QMM_BM)
        grid = (triton.cdiv(w.n_out, QMM_BN), tile_expert.numel())
        qk._qmm[grid](
            w.data, x2, y, tile_expert, slots, r, w.n_out, k, w.row_bytes, w.expert_bytes, x_div,
            x2.stride(0), y.stride(0),
            QT=int(w.qtype), HAS_IDS=True, IEEE=ieee, BM=QMM_BM, BN=QMM_BN, BK=QMM_BK,
        )  # fmt: skip
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
