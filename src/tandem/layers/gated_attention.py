"""Attention with an output gate (Qwen3-Next, Qwen3.5): the q projection yields, per head, the query
and a gate of the same size; the attention output is multiplied by sigmoid(gate) before `o`.

Shapes: T = new tokens, H = query heads, G = KV heads, D = head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.cuda.streams import side_by_side
from tandem.layers.attention import AttentionShape, attend_step
from tandem.layers.linear import Linear
from tandem.layers.rope import Rope
from tandem.state.batch import StepBatch
from tandem.state.kv_cache import KVPool


@dataclass
class GatedAttention:
    """GQA attention (q/k norms, rope, KV cache as `Attention`) with a per-channel sigmoid output gate."""

    shape: AttentionShape
    q_gate: Linear  # [H * 2D, hidden]: for each head D query rows, then D gate rows
    k: Linear
    v: Linear
    o: Linear
    rope: Rope
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.shape.value_dim != self.shape.head_dim:
            raise ValueError("gated attention needs value_dim == head_dim (the gate has head_dim channels per head)")

    def new_state(
        self, n_slots: int, n_ctx: int, dtype: torch.dtype, device: torch.device | str, n_batch: int
    ) -> KVPool:
        return self.shape.new_kv(n_slots, n_ctx, dtype, device, n_batch)

    def __call__(self, x: torch.Tensor, batch: StepBatch, pool: KVPool) -> torch.Tensor:
        s = self.shape
        t = x.shape[0]
        qg, k, v = side_by_side(x, self.q_gate, self.k, self.v)  # one token on a GPU: at once
        qg = qg.view(t, s.n_heads, 2, s.head_dim)
        q = qg[:, :, 0]  # [T, H, D]
        gate = qg[:, :, 1].reshape(t, s.n_heads * s.head_dim)
        k = k.view(t, s.n_kv_heads, s.head_dim)
        v = v.view(t, s.n_kv_heads, s.value_dim)
        out = attend_step(self, q, k, v, batch, pool).reshape(t, s.n_heads * s.value_dim)
        return self.o(out * torch.sigmoid(gate.float()).to(out.dtype))
