"""Gated delta-net linear attention (Qwen3-Next, Qwen3.5): a causal depthwise conv1d over the q/k/v
projections, then the gated delta rule on one recurrent state S [Dk, Dv] per value head:

    S_t = exp(g_t) * S_{t-1}                                   (decay)
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T             (delta rule: write the correction)
    o_t = S_t^T q_t

Two forms compute it: `recurrent_gated_delta_rule` (token by token, for decode) and
`chunked_gated_delta_rule` (chunks of 64 tokens through the UT transform, for prefill), as in
transformers' torch reference and llama.cpp; they agree to float32 rounding. On the CPU, llama.cpp's fused
`gated_delta_net` op (`quant/ggml_ops.py`) computes it instead, prompt and decode alike, on a state the CPU's
pool keeps in ggml's layout (each head's S transposed in memory, the tensor still indexed [Hv, Dk, Dv]).

A decode step of `GatedDeltaNet` on a GPU (one token per sequence, the sequences' states in the pool's slots)
runs between the projections as two Triton kernels (cuda/delta_net.py) instead of the torch ops below, and can
be captured as a CUDA graph: its shapes do not depend on the positions, it reads no tensor value on the host,
and it updates the pool's state tensors in place, so a replay advances the live states. The position count is
host bookkeeping, done after every step (`KVCache.advance`).

Shapes: T = tokens, C = conv channels (2*Hk*Dk + Hv*Dv), K = conv kernel, Hk / Hv = key / value
heads, Dk / Dv = key / value head dims, N = chunks, L = chunk length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.cuda.streams import on_host, side_by_side
from tandem.errors import TandemError
from tandem.layers.linear import Linear
from tandem.layers.norm import rms_norm
from tandem.quant.ggml_ops import ggml_gated_delta_rule
from tandem.state.batch import StepBatch
from tandem.state.kv_cache import StateOrderError

CHUNK_SIZE = 64  # transformers' and llama.cpp's chunk length for the gated delta rule


@dataclass(frozen=True)
class DeltaNetShape:
    n_k_heads: int  # Hk (query/key heads)
    n_v_heads: int  # Hv (value heads; a multiple of Hk)
    head_k_dim: int  # Dk
    head_v_dim: int  # Dv
    conv_kernel: int  # K
    # How the Hv value heads share the Hk key heads: "grouped" (value head j reads key head j // (Hv/Hk):
    # the Hugging Face order, kept by llama.cpp's qwen3next converter) or "tiled" (j % Hk: llama.cpp's
    # qwen35/qwen35moe converter reorders the value heads so that ggml can broadcast).
    head_layout: str = "grouped"

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.head_v_dim

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def __post_init__(self) -> None:
        if self.n_v_heads % self.n_k_heads:
            raise TandemError(f"delta-net: {self.n_v_heads} value heads, not a multiple of {self.n_k_heads} key heads")
        if self.head_layout not in ("grouped", "tiled"):
            raise TandemError(f"delta-net: unknown head layout '{self.head_layout}'")


@dataclass
class DeltaNetState:
    """One delta-net layer's sequence state. Unlike a KV cache it cannot forget single positions:
    it holds exactly the first `length` positions, and rolling back means restoring a snapshot."""

    conv: torch.Tensor  # [K-1, C] float32: the last K-1 conv inputs (zeros before the sequence start)
    ssm: torch.Tensor  # [Hv, Dk, Dv] float32: the recurrent state
    length: int = 0  # counted by KVCache.advance after each step

    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes

    def snapshot(self, device: torch.device | str | None = None) -> DeltaNetState:
        """A copy of the state as it is now, on `device` (None: where the state is), in the state's layout."""
        device = self.conv.device if device is None else device
        return DeltaNetState(self.conv.to(device, copy=True), self.ssm.to(device, copy=True), self.length)

    def restore(self, snapshot: DeltaNetState | None) -> None:
        """Go back to `snapshot` (None: the empty sequence), in place: the tensors stay the ones a
        captured decode step reads and writes."""
        if snapshot is None:
            self.conv.zero_()
            self.ssm.zero_()
            self.length = 0
        else:
            self.conv.copy_(snapshot.conv)
            self.ssm.copy_(snapshot.ssm)
            self.length = snapshot.length


@dataclass
class DeltaNetPool:
    """One delta-net layer's state of every slot: conv [N, K-1, C] and ssm [N, Hv, Dk, Dv], and each slot's
    `DeltaNetState` (views)."""

    conv: torch.Tensor
    ssm: torch.Tensor
    slots: list[DeltaNetState]

    @classmethod
    def allocate(cls, n_slots: int, shape: DeltaNetShape, device: torch.device | str) -> DeltaNetPool:
        # float32 whatever the KV cache type: the state is small and accumulates over the whole sequence
        conv = torch.zeros(n_slots, shape.conv_kernel - 1, shape.conv_channels, device=device)
        if torch.device(device).type == "cpu":  # ggml's layout (its rows S[:, j]), which the CPU rule reads in place
            ssm = torch.zeros(n_slots, shape.n_v_heads, shape.head_v_dim, shape.head_k_dim).transpose(2, 3)
        else:
            ssm = torch.zeros(n_slots, shape.n_v_heads, shape.head_k_dim, shape.head_v_dim, device=device)
        return cls(conv, ssm, [DeltaNetState(conv[i], ssm[i]) for i in range(n_slots)])

    def slot(self, i: int) -> DeltaNetState:
        return self.slots[i]

    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes


def causal_conv1d(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv of x [T, C] continuing after `state` [K-1, C] (updated in place) with
    `weight` [C, K]; returns [T, C] (no activation)."""
    t, c = x.shape
    window = torch.cat([state, x.float()])  # [K-1+T, C]
    state.copy_(window[t:])  # shift in place: the tensor stays the one a captured step writes
    if t == 1:  # decode: one dot product per channel (elementwise, no convolution kernel to pick)
        return (window * weight.T).sum(0, keepdim=True)
    out = F.conv1d(window.T.unsqueeze(0), weight.unsqueeze(1), groups=c)  # [1, C, T]
    return out[0].T


def l2_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (the FLA / transformers form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """Token-by-token gated delta rule. q, k [T, H, Dk] (q already scaled), v [T, H, Dv], g (log decay)
    and beta [T, H], state [H, Dk, Dv] (updated in place). Returns o [T, H, Dv]."""
    out = torch.empty_like(v)
    s = state
    for i in range(q.shape[0]):
        s = s * g[i].exp()[:, None, None]  # [H, Dk, Dv]
        kv_mem = torch.matmul(k[i].unsqueeze(1), s).squeeze(1)  # [H, Dv]: what S predicts for k
        delta = (v[i] - kv_mem) * beta[i].unsqueeze(-1)  # [H, Dv]
        s = s + k[i].unsqueeze(-1) * delta.unsqueeze(1)
        out[i] = torch.matmul(q[i].unsqueeze(1), s).squeeze(1)
    state.copy_(s)
    return out


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> torch.Tensor:
    """The same as `recurrent_gated_delta_rule`, a chunk of L tokens at a time: within a chunk the L
    delta-rule updates are condensed by solving one unit lower-triangular system (the UT transform),
    between chunks the state is carried. Same arguments and result."""
    t, h, dk = q.shape
    dv = v.shape[-1]
    pad = (chunk_size - t % chunk_size) % chunk_size
    n = (t + pad) // chunk_size
    # padded positions have k = v = beta = 0 and g = 0: they leave the state unchanged
    qh, kh, vh = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))  # [H, T', D]
    bh, gh = (F.pad(x.T, (0, pad)) for x in (beta, g))  # [H, T']
    v_beta = (vh * bh.unsqueeze(-1)).view(h, n, chunk_size, dv)
    k_beta = (kh * bh.unsqueeze(-1)).view(h, n, chunk_size, dk)
    qh = qh.view(h, n, chunk_size, dk)
    kh = kh.view(h, n, chunk_size, dk)
    cum = gh.view(h, n, chunk_size).cumsum(-1)  # [H, N, L] log decay from the chunk start
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    # decay[i, j] = exp(cum_i - cum_j) for j <= i, 0 above the diagonal (masked before exp: no overflow)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # [H, N, L, L]
    ut = torch.matmul(k_beta, kh.transpose(-1, -2)) * decay  # strictly lower part used; unit diagonal
    intra = torch.matmul(qh, kh.transpose(-1, -2)) * decay  # causal q.k within the chunk
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)  # [H, N, L, Dv]
    k_cumdecay = torch.linalg.solve_triangular(
        ut, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True
    )  # [H, N, L, Dk]
    q_decayed = qh * cum.exp().unsqueeze(-1)  # reads the state as it was at the chunk start
    k_decayed = kh * (cum[..., -1:] - cum).exp().unsqueeze(-1)  # writes decayed to the chunk end
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [H, N, 1, 1]
    outs = []
    s = state
    for i in range(n):  # fused multiply-adds: on a GPU each chunk is five launches, not nine
        v_new = torch.baddbmm(new_values[:, i], k_cumdecay[:, i], s, alpha=-1)  # [H, L, Dv]
        outs.append(torch.baddbmm(torch.bmm(intra[:, i], v_new), q_decayed[:, i], s))
        s = torch.baddbmm(s * chunk_decay[:, i], k_decayed[:, i].transpose(-1, -2), v_new)
    state.copy_(s)
    return torch.cat(outs, dim=1)[:, :t].transpose(0, 1)  # [T, H, Dv]


@dataclass
class SplitBetaAlpha:
    """Qwen3.5: separate beta and alpha projections (`ssm_beta`, `ssm_alpha`), [Hv, D] each."""

    beta: Linear
    alpha: Linear

    @property
    def on_host(self) -> bool:
        return on_host(self.beta) or on_host(self.alpha)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.beta(x), self.alpha(x)


@dataclass
class FusedBetaAlpha:
    """Qwen3-Next: one `ssm_ba` projection [2*Hv, D], per key head Hv/Hk betas then Hv/Hk alphas."""

    proj: Linear
    n_k_heads: int

    @property
    def on_host(self) -> bool:
        return on_host(self.proj)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        ba = self.proj(x).view(t, self.n_k_heads, 2, -1)  # [T, Hk, 2, Hv/Hk]
        return ba[:, :, 0].reshape(t, -1), ba[:, :, 1].reshape(t, -1)


@dataclass
class GatedDeltaNet:
    """The linear-attention token mixer: projections, conv, gated delta rule, gated RMSNorm, output."""

    shape: DeltaNetShape
    qkv: Linear  # [C, D]: q, k, v (the conv channels)
    gate: Linear  # z [Hv*Dv, D]: the output gate
    beta_alpha: SplitBetaAlpha | FusedBetaAlpha
    conv_weight: torch.Tensor  # [C, K]
    dt_bias: torch.Tensor  # [Hv]
    a: torch.Tensor  # [Hv] = -exp(A_log), as the GGUF stores it
    norm: torch.Tensor  # [Dv] gated RMSNorm weight
    out: Linear  # [D, Hv*Dv]
    eps: float = 1e-6  # of the gated RMSNorm and the q/k L2 norms
    chunk_size: int = CHUNK_SIZE

    def new_state(
        self, n_slots: int, n_ctx: int, dtype: torch.dtype, device: torch.device | str, n_batch: int
    ) -> DeltaNetPool:
        return DeltaNetPool.allocate(n_slots, self.shape, device)

    def _expand_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[T, Hk, Dk] -> [T, Hv, Dk]: each value head gets its key head."""
        t, hk, d = x.shape
        r = self.shape.n_v_heads // hk
        if r == 1:
            return x
        if self.shape.head_layout == "tiled":  # value head j reads key head j % Hk
            return x.unsqueeze(1).expand(t, r, hk, d).reshape(t, r * hk, d)
        return x.unsqueeze(2).expand(t, hk, r, d).reshape(t, hk * r, d)  # grouped: j // r

    def _fused_step(self, x: torch.Tensor, pool: DeltaNetPool, slots: torch.Tensor | None) -> torch.Tensor:
        """A decode step of every row's sequence (its state in slot slots[row] of the pool) between the
        projections in two Triton kernels (cuda/delta_net.py) instead of ~40 small torch ops; the same arithmetic
        to f32 rounding. Returns the out projection's input [B, Hv*Dv]."""
        from tandem.cuda.delta_net import gated_delta_step

        # the large qkv projection here, the gate and beta/alpha beside it on a second stream
        qkv, z, (b, a) = side_by_side(x, self.qkv, self.gate, self.beta_alpha)
        return gated_delta_step(
            qkv, z, b, a, pool.conv, pool.ssm, self.conv_weight, self.dt_bias, self.a, self.norm, self.shape,
            self.eps, x.dtype, slots=slots,
        )  # fmt: skip

    def __call__(self, x: torch.Tensor, batch: StepBatch, pool: DeltaNetPool) -> torch.Tensor:
        """x [T, D]: each sequence's rows continue the state in its slot. The layer checks that each sequence
        continues where its state is and leaves the position count to the caller (KVCache.advance)."""
        s = self.shape
        t = x.shape[0]
        if batch.pooled and batch.decode:  # on a GPU
            from tandem.cuda.delta_net import step_fits

            if step_fits(s):
                return self.out(self._fused_step(x, pool, batch.slots))
        qkv = self.qkv(x)
        b, a = self.beta_alpha(x)  # [T, Hv] each
        if batch.pooled and not batch.decode:
            o = self._pooled_chunk(qkv, b, a, pool, batch)
        else:
            outs = []
            for span in batch.spans:
                state, rows = pool.slot(span.slot), span.rows
                if span.start != state.length:
                    raise StateOrderError(f"delta-net state holds {state.length} positions, not {span.start}")
                outs.append(self._rule(qkv[rows], b[rows], a[rows], state, span.n))
            o = outs[0] if len(outs) == 1 else torch.cat(outs)
        z = self.gate(x).view(t, s.n_v_heads, s.head_v_dim)
        o = rms_norm(o, self.norm, self.eps) * F.silu(z.float())  # [T, Hv, Dv]
        return self.out(o.reshape(t, s.value_dim).to(x.dtype))

    def _pooled_chunk(
        self, qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, pool: DeltaNetPool, batch: StepBatch
    ) -> torch.Tensor:
        """A pooled chunk of one sequence (capturable): its slot's state read and written back by the device slot
        index, not by a Python one. The runner has checked that the state holds the chunk's start."""
        assert batch.slots is not None
        slot = batch.slots[:1]
        state = DeltaNetState(pool.conv.index_select(0, slot)[0], pool.ssm.index_select(0, slot)[0])
        o = self._rule(qkv, b, a, state, qkv.shape[0])
        pool.conv.index_copy_(0, slot, state.conv.unsqueeze(0))
        pool.ssm.index_copy_(0, slot, state.ssm.unsqueeze(0))
        return o

    def _rule(self, qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, state: DeltaNetState, t: int) -> torch.Tensor:
        """One sequence's conv and gated delta rule over its T rows, continuing `state` -> o [T, Hv, Dv]."""
        s = self.shape
        mixed = F.silu(causal_conv1d(qkv, state.conv, self.conv_weight))  # [T, C]
        q, k, v = mixed.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        q = self._expand_heads(l2_normalize(q.reshape(t, s.n_k_heads, s.head_k_dim), self.eps))  # [T, Hv, Dk]
        k = self._expand_heads(l2_normalize(k.reshape(t, s.n_k_heads, s.head_k_dim), self.eps))
        v = v.reshape(t, s.n_v_heads, s.head_v_dim)  # [T, Hv, Dv]
        beta = torch.sigmoid(b.float())
        g = self.a * F.softplus(a.float() + self.dt_bias)  # log decay, <= 0
        ggml_layout = state.ssm.transpose(1, 2)
        if not q.is_cuda and s.head_k_dim == s.head_v_dim and ggml_layout.is_contiguous():
            # llama.cpp's fused CPU op: token by token in C, for a prompt too (torch's chunked form is slower on the
            # CPU, its batched triangular solves most of all); it scales the outputs, not the queries
            arrays = (x.detach().float().contiguous().numpy() for x in (q, k, v, g, beta))
            o = ggml_gated_delta_rule(*arrays, ggml_layout.numpy(), torch.get_num_threads())
            return torch.from_numpy(o)
        q = q * s.head_k_dim**-0.5
        if t == 1:
            return recurrent_gated_delta_rule(q, k, v, g, beta, state.ssm)
        return chunked_gated_delta_rule(q, k, v, g, beta, state.ssm, self.chunk_size)
