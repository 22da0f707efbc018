"""MoE routing on the GPU in one kernel: router logits [T, E] to expert ids and mixing weights [T, A].

The torch form (float cast, softmax, topk, sum, divide: ~6 kernels, topk alone ~5 us) becomes one launch of
one program per token, a warp holding the whole row (E up to a few hundred). Two orders of work:
- softmax first (Qwen, Gemma 4): softmax over all E, keep the top A, optionally renormalise over them;
- top first (gpt-oss): logits (+ bias), keep the top A, softmax over those A.
The top A are picked on the logits in both: softmax is monotone, so these are the largest probabilities,
and the pick does not depend on how exp rounds. Order as torch.topk's: value descending, the lower expert
first on ties. No host sync or allocation inside, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route(
    logits_ptr, bias_ptr, ids_ptr, weights_ptr, E, stride_l,
    A: tl.constexpr, EP: tl.constexpr, AP: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTMAX_FIRST: tl.constexpr,
    RENORM: tl.constexpr,
):  # fmt: skip
    """Token program_id(0): ids [A] (int64) and weights [A] (f32) of its logits row (+ bias)."""
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
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=slot < A)
    tl.store(weights_ptr + out, w, mask=slot < A)


def route(
    logits: torch.Tensor,
    n_active: int,
    softmax_first: bool,
    renormalize: bool = False,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids [T, A] int64 and weights [T, A] f32 of router logits [T, E] (any float dtype, on the GPU);
    bias [E] is added to the logits first (gpt-oss). See the module docstring for the two orders of work."""
    t, e = logits.shape
    assert 0 < n_active <= e, (n_active, e)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    ids = torch.empty(t, n_active, dtype=torch.int64, device=logits.device)
    weights = torch.empty(t, n_active, dtype=torch.float32, device=logits.device)
    if t:
        _route[(t,)](
            logits, logits if bias is None else bias, ids, weights, e, logits.stride(0),
            A=n_active, EP=triton.next_power_of_2(e), AP=triton.next_power_of_2(n_active), HAS_BIAS=bias is not None,
            SOFTMAX_FIRST=softmax_first, RENORM=renormalize, num_warps=1,
        )  # fmt: skip
    return ids, weights
