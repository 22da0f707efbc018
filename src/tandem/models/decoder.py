"""The decoder-only transformer every supported architecture is an instance of.

Shapes: T = tokens in this step, D = hidden, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.layers.activations import activation
from tandem.layers.attention import Attention, AttentionShape
from tandem.layers.linear import Linear
from tandem.layers.mlp import GatedMLP
from tandem.layers.moe import GatedExperts, MoE, SoftmaxTopKRouter
from tandem.layers.norm import rms_norm
from tandem.layers.rope import Rope, RopeSpec
from tandem.models.config import LayerSpec, ModelConfig
from tandem.runtime.kv_cache import KVCache, LayerKV
from tandem.runtime.loader import QuantEmbedding, WeightLoader


@dataclass
class Block:
    attn_norm: torch.Tensor
    attn: Attention
    post_attn_norm: torch.Tensor | None
    ffn_norm: torch.Tensor
    ffn: GatedMLP | MoE
    post_ffn_norm: torch.Tensor | None
    eps: float

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv: LayerKV, start: int) -> torch.Tensor:
        h = self.attn(rms_norm(x, self.attn_norm, self.eps), positions, kv, start)
        if self.post_attn_norm is not None:
            h = rms_norm(h, self.post_attn_norm, self.eps)
        x = x + h
        h = self.ffn(rms_norm(x, self.ffn_norm, self.eps))
        if self.post_ffn_norm is not None:
            h = rms_norm(h, self.post_ffn_norm, self.eps)
        return x + h


class DecoderModel:
    """Embedding, blocks, final norm and output head, built from a WeightLoader."""

    def __init__(self, cfg: ModelConfig, loader: WeightLoader) -> None:
        self.cfg = cfg
        self.embed: QuantEmbedding = loader.embedding("token_embd.weight")
        self.output_norm = loader.vector("output_norm.weight")
        # Tied embeddings: the output head reads the embedding table when there is no `output`.
        self.output: Linear = loader.linear("output.weight" if loader.has("output.weight") else "token_embd.weight")
        ropes: dict[RopeSpec, Rope] = {}
        self.blocks = [self._block(i, spec, loader, ropes) for i, spec in enumerate(cfg.layers)]

    def _block(self, i: int, spec: LayerSpec, loader: WeightLoader, ropes: dict[RopeSpec, Rope]) -> Block:
        cfg = self.cfg
        p = f"blk.{i}."
        rope = ropes.setdefault(spec.rope, Rope(spec.rope))
        shape = AttentionShape(
            n_heads=cfg.n_heads,
            n_kv_heads=cfg.n_kv_heads,
            head_dim=cfg.head_dim,
            value_dim=cfg.value_dim,
            scale=cfg.attn_scale,
            sliding_window=spec.sliding_window,
            softcap=cfg.attn_logit_softcap,
        )
        attn = Attention(
            shape=shape,
            q=loader.linear(p + "attn_q.weight"),
            k=loader.linear(p + "attn_k.weight"),
            v=loader.linear(p + "attn_v.weight"),
            o=loader.linear(p + "attn_output.weight"),
            rope=rope,
            q_norm=loader.vector(p + "attn_q_norm.weight") if cfg.qk_norm else None,
            k_norm=loader.vector(p + "attn_k_norm.weight") if cfg.qk_norm else None,
            norm_eps=cfg.rms_eps,
        )
        act = activation(cfg.activation)
        ffn: GatedMLP | MoE
        if spec.moe:
            assert cfg.moe is not None  # guaranteed by ModelConfig.__post_init__
            ffn = MoE(
                router=SoftmaxTopKRouter(
                    proj=loader.linear(p + "ffn_gate_inp.weight"),
                    n_active=cfg.moe.n_active,
                    renormalize=cfg.moe.renormalize,
                ),
                experts=GatedExperts(
                    gate=loader.experts(p + "ffn_gate_exps.weight"),
                    up=loader.experts(p + "ffn_up_exps.weight"),
                    down=loader.experts(p + "ffn_down_exps.weight"),
                    act=act,
                ),
            )
        else:
            ffn = GatedMLP(
                gate=loader.linear(p + "ffn_gate.weight"),
                up=loader.linear(p + "ffn_up.weight"),
                down=loader.linear(p + "ffn_down.weight"),
                act=act,
            )
        sandwich = cfg.sandwich_norms
        return Block(
            attn_norm=loader.vector(p + "attn_norm.weight"),
            attn=attn,
            post_attn_norm=loader.vector(p + "post_attention_norm.weight") if sandwich else None,
            ffn_norm=loader.vector(p + "ffn_norm.weight"),
            ffn=ffn,
            post_ffn_norm=loader.vector(p + "post_ffw_norm.weight") if sandwich else None,
            eps=cfg.rms_eps,
        )

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: KVCache, all_logits: bool = False) -> torch.Tensor:
        """Run tokens `ids` [T] after the cache's current length; logits [T, V] or [1, V] (last only)."""
        t = ids.shape[0]
        cache.check_room(t)
        start = cache.length
        positions = torch.arange(start, start + t)
        x = self.embed(ids) * self.cfg.embed_scale  # [T, D]
        for block, kv in zip(self.blocks, cache.layers, strict=True):
            x = block(x, positions, kv, start)
        cache.length += t
        cache.tokens.extend(ids.tolist())
        if not all_logits:
            x = x[-1:]
        logits = self.output(rms_norm(x, self.output_norm, self.cfg.rms_eps)).float()  # [T, V]
        if self.cfg.final_logit_softcap is not None:
            cap = self.cfg.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def new_cache(self, n_ctx: int, dtype: torch.dtype) -> KVCache:
        cfg = self.cfg
        n = cfg.n_layers
        return KVCache.allocate(n, n_ctx, [cfg.n_kv_heads] * n, [cfg.head_dim] * n, [cfg.value_dim] * n, dtype)
