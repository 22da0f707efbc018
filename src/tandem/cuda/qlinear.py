"""Products with GGUF weights kept as blocks in GPU memory.

Decode (a few rows): `_qmv` reads the blocks once per row, straight from VRAM (a weight past L2, the output head,
past a few rows: one tile of `_grouped_qmm`, below). Prefill (many rows): a dense weight is dequantized into a
transient float workspace and multiplied by cuBLAS; selected experts
run `_grouped_qmm`, a grouped GEMM that dequantizes the blocks tile by tile in registers, over slots
grouped by expert on the GPU (`_align_slots`): one launch per product and no host sync for experts in VRAM.
A layer's gate, up and down products share one routing, so they share its grouping (`_aligned_slots`).

Shapes: M = activation rows, N = output features, K = input features, E = experts, T = tokens,
A = active experts per token, R = T * A expert slots.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Protocol

import torch
import triton
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES

from tandem.cuda import qkernels as qk
from tandem.quant.types import GPU_DEQUANT_CHUNK_BYTES, GPU_NATIVE_TYPES

QMV_MAX_ROWS = 16  # up to this many rows, re-reading the blocks per row (from L2) beats dequantizing
# ... but a weight larger than the GPU's L2 (an output head) is re-read from VRAM per row: past this many rows
# (and up to GQMM_MAX_BM) it is one tile of the grouped GEMM, read once (bench/expert_kernels.py --dense).
QMV_MAX_ROWS_PAST_L2 = 4
# Selected experts in VRAM, a decode step's tokens (at most 2 * QMV_MAX_ROWS): `_qmv` reads an expert's blocks
# once per slot, `_grouped_qmm` once per tile of BM slots but decodes them into tensor-core tiles that are
# mostly padding when an expert has one or two slots. Up to this many slots per expert on average the
# re-reads cost less (bench/expert_kernels.py; docs/PERFORMANCE.md).
QMV_SLOTS_PER_EXPERT = 2
DEQUANT_BN = 16
GQMM_MIN_BM, GQMM_MAX_BM = 16, 64  # slots per tile of the grouped expert GEMM (tl.dot needs >= 16)


class BlockStream(Protocol):
    """Brings the blocks of stacked experts kept in host RAM to the GPU, a chunk of experts at a time."""

    def chunks(self, w: GPUQuantWeight, tiles_per_expert: Sequence[int]) -> Iterator[tuple[int, int, GPUQuantWeight]]:
        """(first expert, end expert, their blocks on the GPU) for the chunks holding routed experts."""
        ...


@dataclass(eq=False)
class GPUQuantWeight:
    """A weight kept as its raw GGUF blocks: [N, K] or stacked experts [E, N, K]. The blocks are in VRAM,
    or, with `stream`, in host RAM, and brought to the GPU chunk by chunk when used (prefill only)."""

    data: torch.Tensor  # uint8 on a CUDA device (or CPU under Triton's interpreter, or host RAM with stream)
    qtype: Q
    shape: tuple[int, ...]
    stream: BlockStream | None = None
    host_mapped: bool = False  # data is a device view of page-locked host memory (read over PCIe)

    def expert_chunks(self, tiles_per_expert: Sequence[int]) -> Iterator[tuple[int, int, GPUQuantWeight]]:
        """The stacked experts as (first expert, end expert, blocks on the GPU) chunks."""
        if self.stream is None:
            yield 0, self.shape[0], self
        else:
            yield from self.stream.chunks(self, tiles_per_expert)

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


def dense_kernel(m: int, w: GPUQuantWeight) -> str:
    """Which product `qmatmul` makes of m rows with w (`DENSE_PRODUCTS`): "qmv" reads the blocks once per row (a
    few rows, or a weight the L2 holds for the next row); past QMV_MAX_ROWS_PAST_L2 rows of a weight larger than
    L2 (an output head) "grouped" reads them once, as one expert's tile of `_grouped_qmm`, with no float copy;
    "sliced" dequantizes bounded slices into cuBLAS (prefill)."""
    past_l2 = _past_l2(w)
    if m <= (QMV_MAX_ROWS_PAST_L2 if past_l2 else QMV_MAX_ROWS):
        return "qmv"
    return "grouped" if past_l2 and m <= GQMM_MAX_BM else "sliced"


def qmatmul(x: torch.Tensor, w: GPUQuantWeight, ieee: bool = False) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype."""
    assert x.shape[1] == w.n_in, (x.shape, w.shape)
    return DENSE_PRODUCTS[dense_kernel(x.shape[0], w)](_aligned(x), w, ieee)


def _qmv_product(x: torch.Tensor, w: GPUQuantWeight, ieee: bool) -> torch.Tensor:
    m, k = x.shape
    y = torch.empty(m, w.n_out, dtype=x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(w.n_out, meta["BN"]), m)  # noqa: E731
    qk._qmv[grid](
        w.data, x, y, x, w.n_out, k, w.row_bytes, 0, 1, x.stride(0), y.stride(0), qmv_rows_tier(m),
        QT=int(w.qtype), HAS_IDS=False,
    )  # fmt: skip
    return y


def _grouped_product(x: torch.Tensor, w: GPUQuantWeight, ieee: bool) -> torch.Tensor:
    m, k = x.shape
    assert m <= GQMM_MAX_BM, m
    y = torch.empty(m, w.n_out, dtype=x.dtype, device=x.device)
    if not ieee and x.dtype == torch.float32:  # bf16 operands anyway: every output tile re-reads x
        x = x.to(torch.bfloat16)
    bm = min(GQMM_MAX_BM, max(GQMM_MIN_BM, triton.next_power_of_2(m)))
    tile_expert, slots = _one_tile(m, bm, x.device)
    grid = lambda meta: (triton.cdiv(w.n_out, meta["BN"]), 1)  # noqa: E731
    qk._grouped_qmm[grid](
        w.data, x, y, tile_expert, slots, 0, 0, w.n_out, k, w.row_bytes, 0, 1, x.stride(0), y.stride(0),
        IEEE=ieee, BM=bm, **_sub(w.qtype),
    )  # fmt: skip
    return y


def _sliced_product(x: torch.Tensor, w: GPUQuantWeight, ieee: bool) -> torch.Tensor:
    m, k = x.shape
    dtype = torch.float32 if ieee else torch.bfloat16
    rows = max(1, GPU_DEQUANT_CHUNK_BYTES // (k * dtype.itemsize))
    xd = x.to(dtype)
    if rows >= w.n_out:  # one slice (most projections): cuBLAS's product is the result, no copy into one
        return matmul_out(xd, dequantize_rows_gpu(w, 0, w.n_out, dtype).T, x.dtype)
    y = torch.empty(m, w.n_out, dtype=x.dtype, device=x.device)
    for r0 in range(0, w.n_out, rows):
        n = min(rows, w.n_out - r0)
        y[:, r0 : r0 + n] = matmul_out(xd, dequantize_rows_gpu(w, r0, n, dtype).T, x.dtype)
    return y


DENSE_PRODUCTS = {"qmv": _qmv_product, "grouped": _grouped_product, "sliced": _sliced_product}


@functools.cache
def _one_tile(m: int, bm: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`_grouped_qmm`'s tile of a dense product: expert 0, rows 0..m-1 then padding (kept: captured steps read them)."""
    slots = torch.arange(bm, dtype=torch.int32, device=device)
    return torch.zeros(1, dtype=torch.int32, device=device), torch.where(slots < m, slots, -1)


def qmatmul_id(
    x: torch.Tensor, w: GPUQuantWeight, ids: torch.Tensor, ieee: bool = False, skips: bool = False
) -> torch.Tensor:
    """Selected experts: x [T, K] (shared by a token's experts) or [T, A, K]; ids [T, A] -> [T, A, N]. With
    `skips`, ids may be -1: a slot another part of a split computes, whose row of the result is zeros."""
    t, a = ids.shape
    k, n = w.n_in, w.n_out
    x_div = a if x.dim() == 2 else 1
    x2 = _aligned(x.reshape(-1, k))
    flat = ids.reshape(-1).contiguous()  # int32 or int64: the kernels read either
    r = flat.numel()
    # `_qmv` writes every row, zeros for -1. Blocks read over PCIe (`host_mapped`) are read once per slot by it,
    # and a split's filler slots (weight 0) name experts the side reads anyway: many slots group instead.
    per_expert_ok = t <= 2 * QMV_MAX_ROWS and r <= QMV_SLOTS_PER_EXPERT * w.shape[0] and not w.host_mapped
    small = (r <= 2 * QMV_MAX_ROWS or per_expert_ok) and w.stream is None
    y = (torch.zeros if skips and not small else torch.empty)(r, n, dtype=x.dtype, device=x.device)
    if r == 0:
        return y.view(t, a, n)
    if small:
        grid = lambda meta: (triton.cdiv(n, meta["BN"]), r)  # noqa: E731
        qk._qmv[grid](
            w.data, x2, y, flat, n, k, w.row_bytes, w.expert_bytes, x_div, x2.stride(0), y.stride(0),
            qmv_rows_tier(r), QT=int(w.qtype), HAS_IDS=True,
        )  # fmt: skip
        return y.view(t, a, n)
    if not ieee and x2.dtype == torch.float32:  # bf16 operands anyway; every output tile re-reads x: half the bytes
        x2 = x2.to(torch.bfloat16)
    n_experts = w.shape[0]
    bm = _tile_rows(r, n_experts)
    tile_expert, slots, tiles = _aligned_slots(ids, flat, n_experts, bm)

    def launch(blocks: GPUQuantWeight, tile0: int, e0: int, n_tiles: int) -> None:
        grid = lambda meta: (triton.cdiv(n, meta["BN"]), n_tiles)  # noqa: E731
        qk._grouped_qmm[grid](
            blocks.data, x2, y, tile_expert, slots, tile0, e0, n, k, w.row_bytes, w.expert_bytes, x_div,
            x2.stride(0), y.stride(0), IEEE=ieee, BM=bm, **_sub(w.qtype),
        )  # fmt: skip

    if w.stream is None:  # one launch over the tiles' upper bound; unused tiles return at once
        launch(w, 0, 0, tile_expert.numel())
        return y.view(t, a, n)
    per_expert = tiles.tolist()  # host sync: the stream copies only the routed experts
    tile_end = [0, *accumulate(per_expert)]
    for c0, c1, blocks in w.expert_chunks(per_expert):  # experts [c0, c1) on the GPU, their tiles contiguous
        if tile_end[c1] > tile_end[c0]:
            launch(blocks, tile_end[c0], c0, tile_end[c1] - tile_end[c0])
    return y.view(t, a, n)


def matmul_out(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b with operands in their (half) type and the result in `out_dtype`: on CUDA, bf16/f16 operands give
    cuBLAS's f32 accumulators straight as an f32 result, not rounded to the operands' type first (the residual
    stream is f32, as llama.cpp keeps it; only a large product's inputs are rounded)."""
    if a.dtype == out_dtype:
        return a @ b
    if out_dtype == torch.float32 and a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).to(out_dtype)


# The block type ggml's CPU dot product with a weight type takes its input in (the type's `vec_dot_type`).
_GGML_INPUT_Q8_K = frozenset({Q.Q4_K, Q.Q5_K, Q.Q6_K})  # the others of GPU_NATIVE_TYPES take Q8_0


def ggml_rounded_input(x: torch.Tensor, qtype: Q) -> torch.Tensor:
    """x [..., K] rounded as ggml's CPU backend rounds a product's input before its dot product with `qtype`
    blocks: to Q8_0 (blocks of 32, an f16 scale of max|x| / 127; ggml's x86 `quantize_row_q8_0`) or Q8_K
    (blocks of 256, an f32 scale of the largest-magnitude value / -127; `quantize_row_q8_K_ref`), and back to
    floats. The kernels here multiply x as it is: ~1% away from ggml's products on random inputs, where a
    product computed here stands in for ggml's beside ggml's own (--pcie-experts) it must be the same values."""
    k_quant = qtype in _GGML_INPUT_Q8_K
    blocks = x.float().reshape(-1, 256 if k_quant else 32)
    if k_quant:
        big = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))  # the first of largest magnitude
        iscale = -127.0 / big
        rounded = torch.round(blocks * iscale).clamp(max=127) * (1.0 / iscale)
        rounded = torch.where(big == 0, 0.0, rounded)
    else:
        amax = blocks.abs().amax(dim=-1, keepdim=True)
        inv = torch.where(amax == 0, 0.0, 127.0 / amax)
        rounded = torch.round(blocks * inv) * (amax / 127.0).half().float()
    return rounded.view(x.shape).to(x.dtype)


def qmv_rows_tier(rows: int) -> int:
    """`_qmv`'s autotuning tier for a launch of `rows` output rows: one token's experts or a few rows (0), a
    few tokens (1), a batch (2). Each tier is tuned on its first use."""
    return 0 if rows <= 8 else 1 if rows <= 32 else 2


@functools.cache
def _l2_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).L2_cache_size


def _past_l2(w: GPUQuantWeight) -> bool:
    """Whether w's blocks are larger than the L2 cache of the GPU holding them (never under the interpreter)."""
    return w.data.is_cuda and w.n_out * w.row_bytes > _l2_bytes(w.data.device)


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """x contiguous and 16-byte aligned: `_qmv` reads x in 32- or 64-bit pairs of values."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def _tile_rows(n_slots: int, n_experts: int) -> int:
    """Slots per tile of the grouped expert GEMM: about twice the mean slots per expert (a power of two in
    [GQMM_MIN_BM, GQMM_MAX_BM]), so most experts take one tile: each tile dequantizes its expert's blocks again."""
    mean = -(-n_slots // n_experts)
    return min(GQMM_MAX_BM, max(GQMM_MIN_BM, triton.next_power_of_2(2 * mean)))


def _max_tiles(n_slots: int, n_experts: int, tile: int) -> int:
    """Upper bound of sum over experts of ceil(count / tile) for n_slots slots: each used expert (at most
    min(E, R)) pads less than one tile, and every tile holds a slot."""
    return min(n_slots, (n_slots + min(n_experts, n_slots) * (tile - 1)) // tile)


# The last grouping made, for the products after it with the same routing (a layer's gate, up and down):
# (the ids tensor, weakly, and its version counter, experts, tile rows) -> _align_slots's result.
_LAST_GROUPING: list[tuple[weakref.ref[torch.Tensor], int | None, int, int, tuple[torch.Tensor, ...]]] = []


def _version(t: torch.Tensor) -> int | None:
    """t's version counter (bumped by in-place writes), or None for an inference tensor, which has none."""
    return None if t.is_inference() else t._version


def _aligned_slots(
    ids: torch.Tensor, flat_ids: torch.Tensor, n_experts: int, tile: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_align_slots(flat_ids, ...)`, reused while `ids` is the same live tensor, unchanged, and grouped for the
    same experts and tile rows: one sort and one kernel per layer instead of three. "Unchanged" is checked by
    the version counter where there is one; an inference tensor (the model runs in inference mode) has none,
    so routing ids must not be written in place once their products have begun: routers return a new tensor
    per call. Not inside a CUDA graph capture: replays rewrite a captured buffer without any counter."""
    if ids.is_cuda and torch.cuda.is_current_stream_capturing():
        return _align_slots(flat_ids, n_experts, tile)
    if _LAST_GROUPING:
        ref, version, experts, rows, grouping = _LAST_GROUPING[0]
        if ref() is ids and version == _version(ids) and (experts, rows) == (n_experts, tile):
            return grouping  # type: ignore[return-value]
    grouping = _align_slots(flat_ids, n_experts, tile)
    _LAST_GROUPING[:] = [(weakref.ref(ids), _version(ids), n_experts, tile, grouping)]
    return grouping


def _align_slots(flat_ids: torch.Tensor, n_experts: int, tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group expert slots by expert into tiles of `tile` rows, on the GPU and without a host sync.

    Expert e owns ceil(count_e / tile) consecutive tiles (experts in order), filled with its slots in order,
    the rest of its last tile -1. The arrays have the upper bound `_max_tiles` of tiles; unused tiles have
    expert -1 and slots -1. Returns (expert of each tile [n_max] int32, slot of each tile row [n_max * tile]
    int32, tiles of each expert [E] int32).
    """
    r = flat_ids.numel()
    dev = flat_ids.device
    n_max = _max_tiles(r, n_experts, tile)
    sorted_ids, order = torch.sort(flat_ids, stable=True)
    tile_expert = torch.empty(n_max, dtype=torch.int32, device=dev)
    slots = torch.empty(n_max * tile, dtype=torch.int32, device=dev)
    tiles = torch.empty(n_experts, dtype=torch.int32, device=dev)
    qk._align_slots[(n_max,)](
        sorted_ids, order, tile_expert, slots, tiles, r, n_experts, r.bit_length(),
        BM=tile, EP=triton.next_power_of_2(n_experts),
    )  # fmt: skip
    return tile_expert, slots, tiles
