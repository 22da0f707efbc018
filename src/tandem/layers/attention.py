"""Grouped-query attention with a KV cache, optional q/k/v norms, sliding windows, softcapping and
attention sinks.

Shapes: T = new tokens, S = cached positions (including the new ones), H = query heads,
G = KV heads, D = head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.layers.linear import Linear
from tandem.layers.norm import rms_norm
from tandem.layers.rope import Rope
from tandem.runtime.kv_cache import LayerKV


@dataclass
class AttentionShape:
    n_heads: int
    n_kv_heads: int
    head_dim: int  # of queries and keys
    value_dim: int
    scale: float  # multiplies q.k
    sliding_window: int | None  # None: full causal attention
    softcap: float | None = None

    def new_kv(self, n_ctx: int, dtype: torch.dtype, device: torch.device | str) -> LayerKV:
        """The KV buffers of a layer with this geometry."""
        return LayerKV.allocate(n_ctx, self.n_kv_heads, self.head_dim, self.value_dim, dtype, device)


@dataclass
class Attention:
    shape: AttentionShape
    q: Linear
    k: Linear
    v: Linear | None  # None: values are the key projection (before its norm and rope; Gemma 4 global layers)
    o: Linear
    rope: Rope
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    norm_eps: float = 1e-6
    v_norm: bool = False  # RMS-normalise values per head, without a weight (Gemma 4)
    sinks: torch.Tensor | None = None  # [H] learned logit of an extra "sink" key per head (gpt-oss)

    def new_state(self, n_ctx: int, dtype: torch.dtype, device: torch.device | str) -> LayerKV:
        return self.shape.new_kv(n_ctx, dtype, device)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, cache: LayerKV, start: int) -> torch.Tensor:
        s = self.shape
        t = x.shape[0]
        q = self.q(x).view(t, s.n_heads, s.head_dim)
        k = self.k(x).view(t, s.n_kv_heads, s.head_dim)
        v = k if self.v is None else self.v(x).view(t, s.n_kv_heads, s.value_dim)
        if self.v_norm:
            v = rms_norm(v, torch.ones((), dtype=torch.float32, device=v.device), self.norm_eps)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, self.norm_eps)
        if self.k_norm is not None:
            k = rms_norm(k, self.k_norm, self.norm_eps)
        q = self.rope.apply(q, positions)
        k = self.rope.apply(k, positions)
        keys, values = cache.store(start, k, v, positions)  # [S, G, D]
        out = attend(q, keys, values, positions, s, self.sinks)  # [T, H, Dv]
        return self.o(out.reshape(t, s.n_heads * s.value_dim))


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    s: AttentionShape,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal (optionally windowed) softmax attention of q [T, H, D] over keys/values [S, G, D].

    `sinks` [H]: one extra logit per head in the softmax denominator, attending to nothing."""
    group = s.n_heads // s.n_kv_heads
    n_keys = keys.shape[0]
    key_pos = torch.arange(n_keys, device=q.device)
    distance = positions.unsqueeze(1) - key_pos.unsqueeze(0)  # [T, S]
    allowed = distance >= 0
    if s.sliding_window is not None:
        allowed &= distance < s.sliding_window
    if q.is_cuda and s.softcap is None and sinks is None:  # one fused kernel instead of a dozen
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.to(q.dtype).transpose(0, 1).unsqueeze(0),
            values.to(q.dtype).transpose(0, 1).unsqueeze(0),
            attn_mask=allowed.view(1, 1, *allowed.shape),
            scale=s.scale,
            enable_gqa=group > 1,
        )  # [1, H, T, Dv]
        return out[0].transpose(0, 1)
    qh = q.float().transpose(0, 1)  # [H, T, D]
    kh = keys.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [H, S, D]
    vh = values.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [H, S, Dv]
    scores = torch.matmul(qh, kh.transpose(1, 2)) * s.scale  # [H, T, S]
    if s.softcap is not None:
        scores = torch.tanh(scores / s.softcap) * s.softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)  # [H, T, 1]
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, vh).transpose(0, 1).to(q.dtype)  # [T, H, Dv]
