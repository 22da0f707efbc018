"""MoE routing on the GPU: router logits in one kernel (`router_logits`), logits [T, E] to expert ids and
mixing weights [T, A] in one kernel (`route`), and a step's routing split between the experts cached in VRAM and
the rest in one kernel (`split_route`, layers/moe.py `split_routing`), and the selected experts' outputs mixed by
the routing weights in one kernel (`mix_experts`).

The routing's torch form (float cast, softmax, topk, sum, divide: ~6 kernels, topk alone ~5 us) becomes one launch of
one program per token, a warp holding the whole row (E up to a few hundred). Two orders of work:
- softmax first (Qwen, Gemma 4): softmax over all E, keep the top A, optionally renormalise over them;
- top first (gpt-oss): logits (+ bias), keep the top A, softmax over those A.
The top A are picked on the logits in both: softmax is monotone, so these are the largest probabilities,
and the pick does not depend on how exp rounds. Order as torch.topk's: value descending, the lower expert
first on ties. The ids are int32: what the expert kernels and the host's ggml read, with no cast kernel.
No host sync inside either, so both can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Programs `router_logits` aims for: about one per SM of a large GPU (H200: 132), as a decode GEMV is bound by
# how many weight loads are in flight, not by arithmetic.
GEMV_PROGRAMS = 128
GEMV_TILE = 4096  # weight elements a program holds per step (BN rows x BK columns): 32 f32 per thread at 4 warps
GEMV_MAX_BN = 16


@triton.jit
def _router_gemv(
    w_ptr, x_ptr, y_ptr, N, K, stride_w, stride_x, stride_y, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """y[m, n] = sum_k x[m, k] w[n, k] in f32 for the BN rows n of program_id(0), row m = program_id(1);
    x and w in any float type, converted as loaded."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.program_id(1).to(tl.int64)
    k = tl.arange(0, BK)
    n_ok = n < N
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + k
        k_ok = kk < K
        xv = tl.load(x_ptr + m * stride_x + kk, mask=k_ok, other=0.0).to(tl.float32)
        wv = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += wv * xv[None, :]
    tl.store(y_ptr + m * stride_y + n, tl.sum(acc, axis=1), mask=n_ok)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T in f32 -> [M, N] f32, for a few rows (decode): one kernel reading x in its own
    float type (no cast kernel), f32 products and sums, in place of cast + cuBLAS dot + reduce."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k, (tuple(weight.shape), k)
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    bn = 1  # more rows per program only while there are programs enough to keep the GPU's loads in flight
    while bn < GEMV_MAX_BN and triton.cdiv(n, 2 * bn) * m >= GEMV_PROGRAMS:
        bn *= 2
    bk = min(triton.next_power_of_2(k), GEMV_TILE // bn)
    if m:
        _router_gemv[(triton.cdiv(n, bn), m)](
            weight, x, y, n, k, weight.stride(0), x.stride(0), y.stride(0), BN=bn, BK=bk, num_warps=4
        )  # fmt: skip
    return y


@triton.jit
def _route(
    logits_ptr, bias_ptr, ids_ptr, weights_ptr, E, stride_l,
    A: tl.constexpr, EP: tl.constexpr, AP: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTMAX_FIRST: tl.constexpr,
    RENORM: tl.constexpr,
):  # fmt: skip
    """Token program_id(0): ids [A] (int32) and weights [A] (f32) of its logits row (+ bias)."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, EP)
    ok = e < E
    v = tl.load(logits_ptr + t * stride_l + e, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        v += tl.load(bias_ptr + e, mask=ok, other=0.0).to(tl.float32)
    v = tl.where(ok, v, -float("inf"))
    slot = tl.arange(0, AP)
    ids = tl.zeros([AP], dtype=tl.int32)
    top = tl.full([AP], -float("inf"), dtype=tl.float32)
    free = ok
    for a in tl.static_range(A):
        m = tl.max(tl.where(free, v, -float("inf")), axis=0)
        # the lowest free expert holding the maximum; kept below E should a row of NaN match none
        i = tl.minimum(tl.min(tl.where(free & (v == m), e, EP), axis=0), E - 1)
        ids = tl.where(slot == a, i, ids)
        top = tl.where(slot == a, m, top)
        free = free & (e != i)
    if SOFTMAX_FIRST:
        v_max = tl.max(v, axis=0)
        w = tl.exp(top - v_max) / tl.sum(tl.exp(v - v_max), axis=0)  # exp(-inf) = 0: lanes past E, A
        if RENORM:
            w = w / tl.sum(w, axis=0)
    else:
        w = tl.exp(top - tl.max(top, axis=0))
        w = w / tl.sum(w, axis=0)
    out = t * A + slot
    tl.store(ids_ptr + out, ids, mask=slot < A)
    tl.store(weights_ptr + out, w, mask=slot < A)


def route(
    logits: torch.Tensor,
    n_active: int,
    softmax_first: bool,
    renormalize: bool = False,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids [T, A] int32 and weights [T, A] f32 of router logits [T, E] (any float dtype, on the GPU);
    bias [E] is added to the logits first (gpt-oss). See the module docstring for the two orders of work."""
    t, e = logits.shape
    assert 0 < n_active <= e, (n_active, e)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    ids = torch.empty(t, n_active, dtype=torch.int32, device=logits.device)
    weights = torch.empty(t, n_active, dtype=torch.float32, device=logits.device)
    if t:
        _route[(t,)](
            logits, logits if bias is None else bias, ids, weights, e, logits.stride(0),
            A=n_active, EP=triton.next_power_of_2(e), AP=triton.next_power_of_2(n_active), HAS_BIAS=bias is not None,
            SOFTMAX_FIRST=softmax_first, RENORM=renormalize, num_warps=1,
        )  # fmt: skip
    return ids, weights


@triton.jit
def _split(
    ids_ptr, w_ptr, map_ptr, res_ids_ptr, res_w_ptr, cpu_ids_ptr, cpu_w_ptr, cpu_n_ptr, pcie_ids_ptr, pcie_w_ptr,
    A: tl.constexpr, AP: tl.constexpr, PCIE: tl.constexpr,
):  # fmt: skip
    """Token program_id(0): its A experts split as layers/moe.py `split_routing` does (one program per token, the
    row in registers; ranks among the row's non-resident experts from an [AP, AP] comparison, no scan)."""
    t = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, AP)
    ok = s < A
    row = t * A + s
    ids = tl.load(ids_ptr + row, mask=ok, other=0).to(tl.int32)
    w = tl.load(w_ptr + row, mask=ok, other=0.0).to(tl.float32)
    local = tl.load(map_ptr + ids, mask=ok, other=-1)
    res = ok & (local >= 0)
    tl.store(res_ids_ptr + row, tl.where(res, local, -1), mask=ok)
    tl.store(res_w_ptr + row, tl.where(res, w, 0.0), mask=ok)
    other = ok & ~res
    other_i = other.to(tl.int32)
    before = s[None, :] < s[:, None]  # [i, j]: j comes before i
    rank = tl.sum(tl.where(before, other_i[None, :], 0), axis=1)
    n_other = tl.sum(other_i, axis=0)
    n_pcie = (PCIE * n_other) // A
    n_cpu = n_other - n_pcie
    to_cpu = other & (rank < n_cpu)
    if PCIE > 0:
        to_pcie = other & (rank >= n_cpu)
        tl.store(pcie_ids_ptr + row, tl.where(to_pcie, ids, -1), mask=ok)
        tl.store(pcie_w_ptr + row, tl.where(to_pcie, w, 0.0), mask=ok)
    # packed: position q holds the CPU expert of rank q
    pick = (rank[None, :] == s[:, None]) & to_cpu[None, :]  # [q, j]
    packed_ids = tl.sum(tl.where(pick, ids[None, :], 0), axis=1)
    packed_w = tl.sum(tl.where(pick, w[None, :], 0.0), axis=1)
    first = tl.sum(tl.where(s == 0, packed_ids, 0), axis=0)
    id0 = tl.sum(tl.where(s == 0, ids, 0), axis=0)
    pad = tl.where(n_cpu > 0, first, id0)
    have = s < n_cpu
    tl.store(cpu_ids_ptr + row, tl.where(have, packed_ids, pad), mask=ok)
    tl.store(cpu_w_ptr + row, tl.where(have, packed_w, 0.0), mask=ok)
    tl.store(cpu_n_ptr + t, n_cpu)


Pair = tuple[torch.Tensor, torch.Tensor]


def split_route(
    ids: torch.Tensor, weights: torch.Tensor, slot_map: torch.Tensor, pcie_slots: int = 0
) -> tuple[Pair, Pair, torch.Tensor, Pair | None]:
    """layers/moe.py `split_routing` in one kernel: ((resident ids, weights), (cpu ids, weights), cpu counts,
    (pcie ids, weights) or None), ids int32, weights f32, each [T, A]; counts [T] int32."""
    t, a = ids.shape
    ids = ids.contiguous()
    weights = weights.float().contiguous()
    dev = ids.device
    res_ids = torch.empty(t, a, dtype=torch.int32, device=dev)
    res_w = torch.empty(t, a, dtype=torch.float32, device=dev)
    cpu_ids = torch.empty_like(res_ids)
    cpu_w = torch.empty_like(res_w)
    cpu_n = torch.empty(t, dtype=torch.int32, device=dev)
    pcie_ids = torch.empty_like(res_ids) if pcie_slots else res_ids
    pcie_w = torch.empty_like(res_w) if pcie_slots else res_w
    if t:
        _split[(t,)](
            ids, weights, slot_map, res_ids, res_w, cpu_ids, cpu_w, cpu_n, pcie_ids, pcie_w,
            A=a, AP=triton.next_power_of_2(a), PCIE=pcie_slots, num_warps=1,
        )  # fmt: skip
    return (res_ids, res_w), (cpu_ids, cpu_w), cpu_n, ((pcie_ids, pcie_w) if pcie_slots else None)


@triton.jit
def _mix(
    out_ptr, ids_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, E, D, A: tl.constexpr, SCALE: tl.constexpr,
    BIAS: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """y[t, d] = sum over a of (out[t, a, d] * scale[e] + bias[e, d]) * w[t, a], e = ids[t, a] (a negative id
    indexes from the end, as torch's indexing does); f32, one token and BD columns per program."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    ok = d < D
    acc = tl.zeros([BD], dtype=tl.float32)
    for a in tl.static_range(A):
        v = tl.load(out_ptr + (t * A + a) * D + d, mask=ok, other=0.0)
        if SCALE or BIAS:
            e = tl.load(ids_ptr + t * A + a).to(tl.int64)
            e = tl.where(e < 0, e + E, e)
            if SCALE:
                v = v * tl.load(scale_ptr + e)
            if BIAS:
                v = v + tl.load(bias_ptr + e * D + d, mask=ok, other=0.0)
        acc += v * tl.load(w_ptr + t * A + a)
    tl.store(y_ptr + t * D + d, acc, mask=ok)


def mix_experts(
    out: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """[T, D] f32: each token's expert rows out [T, A, D] (f32), each times its expert's scale [E] and plus its
    bias [E, D] (both optional, f32), mixed by weights [T, A] (f32); ids [T, A] (any integer type). One launch for
    torch's index, multiply, add, cast, multiply and sum."""
    t, a, d = out.shape
    vectors = [v for v in (scale, bias) if v is not None]
    assert out.dtype == weights.dtype == torch.float32 and all(v.dtype == torch.float32 for v in vectors)
    out, ids, weights = out.contiguous(), ids.contiguous(), weights.contiguous()
    scale = scale.contiguous() if scale is not None else None
    bias = bias.contiguous() if bias is not None else None
    n_experts = (scale if scale is not None else bias).shape[0] if vectors else 1
    y = torch.empty(t, d, dtype=torch.float32, device=out.device)
    if t:
        bd = min(1024, triton.next_power_of_2(d))
        _mix[(t, triton.cdiv(d, bd))](
            out, ids, weights, out if scale is None else scale, out if bias is None else bias, y, n_experts, d, A=a,
            SCALE=scale is not None, BIAS=bias is not None, BD=bd, num_warps=max(1, min(4, bd // 256)),
        )  # fmt: skip
    return y
