"""Transformer blocks: a token mixer (attention, or linear attention) and a feed-forward part, each
behind a pre-norm and an optional post-norm. An architecture with unusual layers supplies its own
`BlockBuilder`; the standard one covers llama-like attention with a dense MLP or routed experts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tandem.layers.activations import Gated, activation
from tandem.layers.attention import Attention, AttentionShape
from tandem.layers.ffn import ParallelFFN
from tandem.layers.mlp import GatedMLP
from tandem.layers.moe import GLUExperts, MoE, SoftmaxTopKRouter
from tandem.layers.norm import add_normed, add_rms_norm, rms_norm
from tandem.layers.parallel import Reduce
from tandem.layers.rope import Rope, RopeSpec
from tandem.models.config import LayerSpec, ModelConfig
from tandem.state.batch import StepBatch
from tandem.weights.loader import WeightLoader


class Mixer(Protocol):
    """Mixes information across positions; owns the per-layer sequence state it needs."""

    def new_state(
        self, n_slots: int, n_ctx: int, dtype: torch.dtype, device: torch.device | str, n_batch: int
    ) -> Any:
        """The layer's state of every slot (a pool with the slot axis first, whose `slot(i)` is one sequence's)."""
        ...

    def __call__(self, x: torch.Tensor, batch: StepBatch, pool: Any) -> torch.Tensor: ...


@dataclass
class Block:
    mixer_norm: torch.Tensor
    mixer: Mixer
    post_mixer_norm: torch.Tensor | None
    ffn_norm: torch.Tensor | None  # None: the FFN gets the residual stream itself (and norms it inside)
    ffn: Callable[[torch.Tensor], torch.Tensor]
    post_ffn_norm: torch.Tensor | None
    eps: float
    out_scale: torch.Tensor | None = None  # multiplies the block's output (Gemma 4's layer scalar)
    # Tensor parallel (--tp): the mixer's and the FFN's outputs are this rank's partial sums, which these add up over
    # the ranks (None: one rank, or an FFN that reduces itself); see `reduce_with`.
    mixer_reduce: Reduce | None = None
    ffn_reduce: Reduce | None = None

    def reduce_with(self, reduce: Reduce) -> None:
        """Sum the mixer's and the FFN's partial outputs over the ranks with `reduce`, before any post-norm: one
        all-reduce each. An FFN of two branches normed after their sums (Gemma 4's ParallelFFN) reduces both in one
        call itself."""
        self.mixer_reduce = reduce
        if isinstance(self.ffn, ParallelFFN):
            self.ffn.reduce = reduce
        else:
            self.ffn_reduce = reduce

    def __call__(self, x: torch.Tensor, batch: StepBatch, pool: Any) -> torch.Tensor:
        h = self.mixer(rms_norm(x, self.mixer_norm, self.eps), batch, pool)
        if self.mixer_reduce is not None:
            h = self.mixer_reduce(h)
        post_mixer = None if self.post_mixer_norm is None else (self.post_mixer_norm, self.eps)
        if self.ffn_norm is None:  # the FFN norms the residual stream itself
            x = add_normed(x, [(h, post_mixer)])
            branches = self.ffn.branches(x) if isinstance(self.ffn, ParallelFFN) else [(self.ffn(x), None)]
        else:  # one kernel on CUDA for the residual add and the norm
            if post_mixer is not None:
                h = rms_norm(h, *post_mixer)
            x, normed = add_rms_norm(x, h, self.ffn_norm, self.eps)
            branches = [(self.ffn(normed), None)]
        if self.ffn_reduce is not None:
            branches = [(self.ffn_reduce(add_normed(None, branches)), None)]
        post_ffn = None if self.post_ffn_norm is None else (self.post_ffn_norm, self.eps)
        # the branches' norms, their sum, the post-norm, the residual add and the scale: one kernel on CUDA
        return add_normed(x, branches, post_ffn, self.out_scale)


class BlockBuilder(Protocol):
    def __call__(self, cfg: ModelConfig, i: int, spec: LayerSpec, loader: WeightLoader, ropes: RopeCache) -> Block: ...


class RopeCache(dict[RopeSpec, Rope]):
    """One Rope table per distinct RopeSpec, shared by the layers that use it."""

    def get_rope(self, spec: RopeSpec) -> Rope:
        if spec not in self:
            self[spec] = Rope(spec)
        return self[spec]


def attention_shape(cfg: ModelConfig, spec: LayerSpec) -> AttentionShape:
    """The attention geometry of a layer: the model's heads and dims, the layer's window."""
    return AttentionShape(
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        value_dim=cfg.value_dim,
        scale=cfg.attn_scale,
        sliding_window=spec.sliding_window,
        softcap=cfg.attn_logit_softcap,
        scale_queries=cfg.scale_queries,
    )


def standard_attention(cfg: ModelConfig, i: int, spec: LayerSpec, loader: WeightLoader, ropes: RopeCache) -> Attention:
    """Llama-like GQA attention of layer i, with the optional q/k norms of the config."""
    p = f"blk.{i}."
    return Attention(
        shape=attention_shape(cfg, spec),
        q=loader.linear(p + "attn_q.weight"),
        k=loader.linear(p + "attn_k.weight"),
        v=loader.linear(p + "attn_v.weight"),
        o=loader.linear(p + "attn_output.weight"),
        rope=ropes.get_rope(spec.rope),
        q_norm=loader.vector(p + "attn_q_norm.weight") if cfg.qk_norm else None,
        k_norm=loader.vector(p + "attn_k_norm.weight") if cfg.qk_norm else None,
        norm_eps=cfg.rms_eps,
    )


def standard_ffn(cfg: ModelConfig, i: int, spec: LayerSpec, loader: WeightLoader) -> GatedMLP | MoE:
    """A dense gated MLP, or softmax-top-k routed gated experts when the layer is MoE."""
    p = f"blk.{i}."
    act = activation(cfg.activation)
    if not spec.moe:
        return GatedMLP(
            gate=loader.linear(p + "ffn_gate.weight"),
            up=loader.linear(p + "ffn_up.weight"),
            down=loader.linear(p + "ffn_down.weight"),
            act=act,
        )
    assert cfg.moe is not None  # guaranteed by ModelConfig.__post_init__
    return MoE(
        router=SoftmaxTopKRouter(
            proj=loader.linear(p + "ffn_gate_inp.weight"), n_active=cfg.moe.n_active, renormalize=cfg.moe.renormalize
        ),
        experts=loader.routed_experts(
            i,
            lambda src: GLUExperts(
                gate=src.experts(p + "ffn_gate_exps.weight"),
                up=src.experts(p + "ffn_up_exps.weight"),
                down=src.experts(p + "ffn_down_exps.weight"),
                glu=Gated(act),
            ),
        ),
    )


def standard_block(cfg: ModelConfig, i: int, spec: LayerSpec, loader: WeightLoader, ropes: RopeCache) -> Block:
    """Pre-norm attention + FFN; Gemma-style post-norms when the config asks for sandwich norms."""
    p = f"blk.{i}."
    sandwich = cfg.sandwich_norms
    return Block(
        mixer_norm=loader.vector(p + "attn_norm.weight"),
        mixer=standard_attention(cfg, i, spec, loader, ropes),
        post_mixer_norm=loader.vector(p + "post_attention_norm.weight") if sandwich else None,
        ffn_norm=loader.vector(p + "ffn_norm.weight"),
        ffn=standard_ffn(cfg, i, spec, loader),
        post_ffn_norm=loader.vector(p + "post_ffw_norm.weight") if sandwich else None,
        eps=cfg.rms_eps,
    )
