"""The one-token step of the gated delta-net (layers/delta_net.py) in two launches where torch takes ~40.

Between the projections (GEMVs, unchanged) the torch step runs a chain of small kernels (the conv state
shift, the conv, silu, split, L2 norms, head expansion, scaling, sigmoid, softplus, exp, the recurrent
update, the gated RMSNorm, casts); each costs a launch even inside a CUDA graph. Here:

- `_conv_step`, grid (2*Hk + Hv, B): one head's channels of one row per program (a q or k head of Dk
  channels, a v head of Dv). Shifts the row's conv state [K-1, C] in place (rows <- the last K-1 rows of
  [state; x]), convolves, applies silu; a q or k head is L2-normalised, q then scaled by Dk^-0.5. Writes q, k,
  v to one f32 buffer [B, C] (the conv channel order: q heads, k heads, v heads).
- `_recurrent_step`, grid (Hv, B): one value head of one row per program, its whole state S [Dk, Dv] in
  registers. It reads its key head's q and k where they lie (no expansion: value head j reads key head
  j // (Hv/Hk), "grouped", or j % Hk, "tiled"), decays S by exp(a * softplus(alpha + dt_bias)), writes the
  delta-rule correction with beta = sigmoid(b) (S updated in place), reads o = S^T q, and applies the gated
  RMSNorm rms_norm(o) * w * silu(z), written in the out projection's dtype.

A batch (B rows, one token of one sequence each) reads and writes a pool of states, conv [N, K-1, C] and ssm
[N, Hv, Dk, Dv]: row b's is slot slots[b], read on the device; a row of slot -1 is padding (it touches no
state, its output row is zeros), so a captured step serves any B or fewer sequences. A program computes what
it computes for one sequence alone, only its addresses move: a batched row equals the row stepped alone bit
for bit.

Two launches, not one: the q/k conv channels of a key head are shared by its value heads, and their state
shift must not race with the programs still reading the old rows. Programs of the same kernel cannot be
ordered without a grid-wide barrier; a second launch orders them.

Capture-safe: fixed grids and shapes, no value (slots included) read on the host, the state updated in place.
The f32 operations of the torch path (layers/delta_net.py) in its order, sums aside (tree reductions), so the
two agree to f32 rounding (tests/test_delta_net_interpret.py, tests/test_gpu_delta_net.py; batched rows:
tests/test_batched_delta_net_kernel.py). The kernels run on whatever device the tensors are on, so Triton's
interpreter (tests without a GPU) runs these wrappers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from tandem.layers.delta_net import DeltaNetShape

# The largest state tile [Dk, Dv] (padded to powers of two) one program holds in registers. 128 x 128 (Qwen3-Next,
# Qwen3.5/3.6) over 16 warps is 32 values a thread: 97 registers on sm_90, no spills (8 warps: 160 registers);
# 128 x 256 spills even over 32 warps, so larger heads take the torch path.
_MAX_TILE = 128 * 128
_VALUES_PER_THREAD = 32


@triton.jit
def _silu(x):
    """x / (1 + exp(-x)), torch's form."""
    return x / (1.0 + tl.exp(-x))


@triton.jit
def _softplus(x):
    """log(1 + exp(x)), x above 20 passed through (torch's threshold); log1p by Kahan's trick (the
    interpreter has no libdevice): exact where 1 + e rounds to 1, else log(u) * e / (u - 1)."""
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    log1p = tl.where(u == 1.0, e, tl.log(u) * e / (u - 1.0))
    return tl.where(x > 20.0, x, log1p)


@triton.jit
def _conv_step(
    x_ptr, conv_ptr, w_ptr, out_ptr, slots_ptr, x_stride_b, x_stride, conv_stride_n, w_stride_c, w_stride_k,
    n_channels, eps, q_scale,
    N_K_HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, K: tl.constexpr, POOL: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One head's channels of one row: conv state shift, conv, silu, and for q / k heads the L2 norm (q scaled).
    POOL: conv_ptr is a pool [N, K-1, C], the row's slot at slots_ptr (padding, -1: nothing to do); else the
    one sequence's state [K-1, C]."""
    head = tl.program_id(0)
    row = tl.program_id(1)
    if POOL:
        slot = tl.load(slots_ptr + row)  # int64: slot offsets past 2^31 elements
        if slot < 0:
            return
        conv_ptr += slot * conv_stride_n
    x_ptr += row * x_stride_b
    out_ptr += row * n_channels
    is_key = head < 2 * N_K_HEADS  # a q or k head (DK channels), else a v head (DV channels)
    first = tl.where(is_key, head * DK, 2 * N_K_HEADS * DK + (head - 2 * N_K_HEADS) * DV)
    d = tl.arange(0, BLOCK)
    c = first + d  # [BLOCK] conv channels
    c_ok = d < tl.where(is_key, DK, DV)
    x = tl.load(x_ptr + c * x_stride, mask=c_ok, other=0.0).to(tl.float32)
    acc = x * tl.load(w_ptr + c * w_stride_c + (K - 1) * w_stride_k, mask=c_ok, other=0.0).to(tl.float32)
    if K > 1:
        r = tl.arange(0, BLOCK_K)[:, None]  # [BLOCK_K, 1] state rows
        ok = (r < K - 1) & c_ok[None, :]
        rows = conv_ptr + r * n_channels + c[None, :]
        window = tl.load(rows, mask=ok, other=0.0)  # [BLOCK_K, BLOCK]: the K-1 inputs before x
        w = tl.load(w_ptr + c[None, :] * w_stride_c + r * w_stride_k, mask=ok, other=0.0).to(tl.float32)
        acc += tl.sum(window * w, axis=0)
        # the new rows: row r + 1 of the old state, x last (read before any program thread writes)
        later = tl.load(rows + n_channels, mask=(r < K - 2) & c_ok[None, :], other=0.0)
        shifted = tl.where(r == K - 2, x[None, :], later)
        tl.debug_barrier()  # every thread's reads of these rows before any write
        tl.store(rows, shifted, mask=ok)
    y = _silu(acc)
    # key heads: y * rsqrt(sum(y^2) + eps) (l2_normalize), q heads then * Dk^-0.5: two roundings, as torch
    inv = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(y * y, axis=0) + eps))
    y = y * tl.where(is_key, inv, 1.0)
    y = y * tl.where(head < N_K_HEADS, q_scale, 1.0)
    tl.store(out_ptr + c, y, mask=c_ok)


@triton.jit
def _recurrent_step(
    qkv_ptr, b_ptr, alpha_ptr, dt_bias_ptr, a_ptr, z_ptr, norm_ptr, ssm_ptr, out_ptr, slots_ptr,
    qkv_stride_b, b_stride_b, b_stride, alpha_stride_b, alpha_stride, dt_bias_stride, a_stride, z_stride_b,
    z_stride, norm_stride, ssm_stride_n, out_stride_b, eps,
    N_K_HEADS: tl.constexpr, GROUP: tl.constexpr, TILED: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    POOL: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """One value head of one row: decay, delta rule on S [Dk, Dv] (in place), o = S^T q, gated RMSNorm of o.
    POOL: ssm_ptr is a pool [N, Hv, Dk, Dv], the row's slot at slots_ptr (padding, -1: a zero output);
    else the one sequence's state [Hv, Dk, Dv]."""
    h = tl.program_id(0)
    row = tl.program_id(1)
    j = tl.arange(0, BLOCK_DV)
    j_ok = j < DV
    out_ptr += row * out_stride_b
    if POOL:
        slot = tl.load(slots_ptr + row)  # int64: slot offsets past 2^31 elements
        if slot < 0:
            tl.store(out_ptr + h * DV + j, tl.zeros([BLOCK_DV], out_ptr.dtype.element_ty), mask=j_ok)
            return
        ssm_ptr += slot * ssm_stride_n
    qkv_ptr += row * qkv_stride_b
    b_ptr += row * b_stride_b
    alpha_ptr += row * alpha_stride_b
    z_ptr += row * z_stride_b
    if TILED:  # the key head this value head reads
        kh = h % N_K_HEADS
    else:
        kh = h // GROUP
    i = tl.arange(0, BLOCK_DK)
    i_ok = i < DK
    q = tl.load(qkv_ptr + kh * DK + i, mask=i_ok, other=0.0)  # [BLOCK_DK], normalised and scaled
    k = tl.load(qkv_ptr + (N_K_HEADS + kh) * DK + i, mask=i_ok, other=0.0)
    v = tl.load(qkv_ptr + 2 * N_K_HEADS * DK + h * DV + j, mask=j_ok, other=0.0)  # [BLOCK_DV]
    beta = tl.sigmoid(tl.load(b_ptr + h * b_stride).to(tl.float32))
    dt = tl.load(alpha_ptr + h * alpha_stride).to(tl.float32)
    dt += tl.load(dt_bias_ptr + h * dt_bias_stride).to(tl.float32)
    g = tl.load(a_ptr + h * a_stride).to(tl.float32) * _softplus(dt)  # log decay, <= 0
    s_ptrs = ssm_ptr + h * DK * DV + i[:, None] * DV + j[None, :]
    s_ok = i_ok[:, None] & j_ok[None, :]
    s = tl.load(s_ptrs, mask=s_ok, other=0.0) * tl.exp(g)  # [BLOCK_DK, BLOCK_DV]
    kv = tl.sum(s * k[:, None], axis=0)  # [BLOCK_DV]: what S predicts for k
    delta = (v - kv) * beta
    s = s + k[:, None] * delta[None, :]
    tl.debug_barrier()  # every thread's reads of S before any write
    tl.store(s_ptrs, s, mask=s_ok)
    o = tl.sum(s * q[:, None], axis=0)  # [BLOCK_DV]
    # rms_norm (as norm_rope's kernel: correctly rounded 1 / sqrt(mean + eps)), times silu(z)
    scale = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(o * o, axis=0) / DV + eps))
    w = tl.load(norm_ptr + j * norm_stride, mask=j_ok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + (h * DV + j) * z_stride, mask=j_ok, other=0.0).to(tl.float32)
    y = (o * scale * w) * _silu(z)
    tl.store(out_ptr + h * DV + j, y.to(out_ptr.dtype.element_ty), mask=j_ok)


def _state_tile(shape: DeltaNetShape) -> int:
    return triton.next_power_of_2(shape.head_k_dim) * triton.next_power_of_2(shape.head_v_dim)


def step_fits(shape: DeltaNetShape) -> bool:
    """Whether `gated_delta_step` takes this shape (a value head's state fits one program's registers)."""
    return _state_tile(shape) <= _MAX_TILE


def gated_delta_step(
    qkv: torch.Tensor,
    z: torch.Tensor,
    b: torch.Tensor,
    alpha: torch.Tensor,
    conv: torch.Tensor,
    ssm: torch.Tensor,
    conv_weight: torch.Tensor,
    dt_bias: torch.Tensor,
    a: torch.Tensor,
    norm: torch.Tensor,
    shape: DeltaNetShape,
    eps: float,
    out_dtype: torch.dtype,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """`GatedDeltaNet`'s one-token step between its projections for B rows: qkv [B, C] (the conv input), z
    [B, Hv*Dv] (the output gate), b and alpha [B, Hv] (beta and decay projections), any float dtype, rows may be
    strided. conv_weight [C, K], dt_bias and a [Hv], norm [Dv]. The states (f32, contiguous) are updated in place:
    slots None: one sequence's, conv [K-1, C] and ssm [Hv, Dk, Dv], and B = 1; else pools conv [N, K-1, C] and
    ssm [N, Hv, Dk, Dv], row b stepping slot slots[b] (int64 [B] on the device, never read on the host; slots
    distinct, or -1 for a padding row, which reads and writes no state). Returns the gated-normed o [B, Hv*Dv]
    in out_dtype (what the out projection takes: the layer input's dtype), zeros in padding rows. No host sync,
    fixed shapes: capturable in a CUDA graph."""
    s = shape
    assert step_fits(s), f"delta-net state tile {s.head_k_dim} x {s.head_v_dim} too large (see step_fits)"
    c, k_size = conv_weight.shape
    n_rows = qkv.shape[0]
    assert c == s.conv_channels and k_size == s.conv_kernel and qkv.shape == (n_rows, c), (tuple(qkv.shape), c)
    assert z.shape[0] == b.shape[0] == alpha.shape[0] == n_rows, "one row of each input per sequence"
    assert conv.is_contiguous() and ssm.is_contiguous(), "the kernels address the state densely"
    pool = slots is not None
    state_dims = (s.conv_kernel - 1, c), (s.n_v_heads, s.head_k_dim, s.head_v_dim)
    if pool:
        assert slots.shape == (n_rows,) and slots.dtype == torch.int64, (tuple(slots.shape), slots.dtype)
        n_slots = conv.shape[0]
        assert conv.shape == (n_slots, *state_dims[0]) and ssm.shape == (n_slots, *state_dims[1]), "state pools"
    else:
        assert n_rows == 1 and conv.shape == state_dims[0] and ssm.shape == state_dims[1], "one sequence's state"
    slots_arg = slots if pool else conv  # one sequence: a placeholder the kernels never read (POOL false)
    mixed = torch.empty(n_rows, c, dtype=torch.float32, device=qkv.device)  # q, k, v after conv, silu, L2 norms
    block = triton.next_power_of_2(max(s.head_k_dim, s.head_v_dim))
    _conv_step[(2 * s.n_k_heads + s.n_v_heads, n_rows)](
        qkv, conv, conv_weight, mixed, slots_arg, qkv.stride(0), qkv.stride(-1), conv.stride(0),
        *conv_weight.stride(), c, eps, s.head_k_dim**-0.5,
        N_K_HEADS=s.n_k_heads, DK=s.head_k_dim, DV=s.head_v_dim, K=s.conv_kernel, POOL=pool,
        BLOCK=block, BLOCK_K=triton.next_power_of_2(max(1, s.conv_kernel - 1)),
        num_warps=max(1, min(4, block // 64)),
    )  # fmt: skip
    out = torch.empty(n_rows, s.value_dim, dtype=out_dtype, device=qkv.device)
    tile = _state_tile(s)
    _recurrent_step[(s.n_v_heads, n_rows)](
        mixed, b, alpha, dt_bias, a, z, norm, ssm, out, slots_arg,
        mixed.stride(0), b.stride(0), b.stride(-1), alpha.stride(0), alpha.stride(-1), dt_bias.stride(-1),
        a.stride(-1), z.stride(0), z.stride(-1), 0 if norm.numel() == 1 else norm.stride(-1), ssm.stride(0),
        out.stride(0), eps,
        N_K_HEADS=s.n_k_heads, GROUP=s.n_v_heads // s.n_k_heads, TILED=s.head_layout == "tiled",
        DK=s.head_k_dim, DV=s.head_v_dim, POOL=pool,
        BLOCK_DK=triton.next_power_of_2(s.head_k_dim), BLOCK_DV=triton.next_power_of_2(s.head_v_dim),
        num_warps=max(1, min(16, tile // (32 * _VALUES_PER_THREAD))),
    )  # fmt: skip
    return out
