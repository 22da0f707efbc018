"""Gemma 4 text decoder (GGUF arch `gemma4`; the MoE gemma-4-26B-A4B and the dense 31B), as llama.cpp's
`gemma4.cpp` runs it.

Per layer: sliding-window or global attention, each kind with its own head size, KV heads and rope
(sliding: `rope.freq_base_swa`, all of `rope.dimension_count_swa` rotated; global: `rope.freq_base`
with the `rope_freqs` factors, whose 1e30 entries leave most pairs unrotated, Gemma 4's "proportional"
rope). q/k are RMS-normed with weights, v without; global layers without `attn_v` reuse the key
projection as values; the attention scale is 1. The FFN of an MoE layer is two independent branches on
the residual stream, summed: the dense GEGLU MLP between `ffn_norm` and `post_ffw_norm_1`, and the routed
GEGLU experts between `pre_ffw_norm_2` and `post_ffw_norm_2`, whose router reads rms_norm(x) *
`ffn_gate_inp.scale` / sqrt(D) and whose per-expert output scale is `ffn_down_exps.scale`. Then
`post_ffw_norm`, the residual, and `layer_output_scale`. Embeddings are scaled by sqrt(D), final logits
softcapped. GEGLU as in Gemma 3: ggml's f16-table GELU for quantized files (what llama.cpp computes, and what
the experts' one ggml graph computes on the CPU), the tanh formula for float ones (what transformers computes).

Not supported (absent from the 26B-A4B and 31B): per-layer embeddings and KV sharing (E2B / E4B).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from gguf import GGMLQuantizationType

from tandem.errors import UnsupportedModelError
from tandem.gguf import GGUFFile
from tandem.layers.activations import Gated, activation
from tandem.layers.attention import Attention, AttentionShape
from tandem.layers.ffn import FFN, NormedFFN, ParallelFFN, RoutedFFN
from tandem.layers.mlp import GatedMLP
from tandem.layers.moe import GLUExperts, NormedSoftmaxTopKRouter
from tandem.layers.rope import RopeSpec
from tandem.models.blocks import Block, RopeCache
from tandem.models.config import LayerSpec, ModelConfig, MoESpec, block_count, rope_scale, sliding_window_layers
from tandem.models.gemma3 import geglu_activation
from tandem.weights.loader import WeightLoader

DEFAULT_SLIDING_WINDOW_PATTERN = 6


def _per_layer(f: GGUFFile, key: str, n_layers: int, default: int | None = None) -> list[int]:
    """A key that llama.cpp reads with get_key_or_arr: one value for all layers, or one per layer."""
    value = f.arch_get(key, default) if default is not None else f.arch_require(key)
    if isinstance(value, list):
        if len(value) < n_layers:
            raise UnsupportedModelError(f"{f.path.name}: {f.arch}.{key} has {len(value)} entries for {n_layers} layers")
        return [int(v) for v in value[:n_layers]]
    return [int(value)] * n_layers


def _freq_factors(f: GGUFFile) -> tuple[float, ...] | None:
    info = f.tensors.get("rope_freqs.weight")
    if info is None:
        return None
    if info.qtype != GGMLQuantizationType.F32:
        raise UnsupportedModelError(f"{f.path.name}: rope_freqs.weight must be F32, got {info.qtype.name}")
    return tuple(float(v) for v in np.frombuffer(info.data, dtype=np.float32, count=info.n_elements))


def read_config(f: GGUFFile) -> ModelConfig:
    """The ModelConfig of a Gemma 4 GGUF file."""
    n_layers = block_count(f)
    hidden = int(f.arch_require("embedding_length"))
    if int(f.arch_get("attention.shared_kv_layers", 0)):
        raise UnsupportedModelError(f"{f.path.name}: Gemma 4 with shared KV layers (E2B/E4B) is not supported")
    if int(f.arch_get("embedding_length_per_layer_input", 0)):
        raise UnsupportedModelError(f"{f.path.name}: Gemma 4 with per-layer embeddings (E2B/E4B) is not supported")
    n_heads = _per_layer(f, "attention.head_count", n_layers)
    if len(set(n_heads)) != 1:
        raise UnsupportedModelError(f"{f.path.name}: per-layer query head counts are not supported")
    n_kv = _per_layer(f, "attention.head_count_kv", n_layers, n_heads[0])
    head_full = int(f.arch_get("attention.key_length", hidden // n_heads[0]))
    head_swa = int(f.arch_get("attention.key_length_swa", head_full))
    if (
        int(f.arch_get("attention.value_length", head_full)) != head_full
        or int(f.arch_get("attention.value_length_swa", head_swa)) != head_swa
    ):
        raise UnsupportedModelError(f"{f.path.name}: Gemma 4 needs equal key and value head sizes")
    rot_full = int(f.arch_get("rope.dimension_count", head_full))
    rot_swa = int(f.arch_get("rope.dimension_count_swa", rot_full))
    window = int(f.arch_get("attention.sliding_window", 0))
    is_swa = sliding_window_layers(f, n_layers, DEFAULT_SLIDING_WINDOW_PATTERN) if window else [False] * n_layers
    full_rope = RopeSpec(base=float(f.arch_get("rope.freq_base", 1_000_000.0)), dim=rot_full, scale=rope_scale(f),
                         freq_factors=_freq_factors(f))  # fmt: skip
    swa_rope = RopeSpec(base=float(f.arch_get("rope.freq_base_swa", 10_000.0)), dim=rot_swa)
    moe_layers = [f"blk.{i}.ffn_gate_inp.weight" in f.tensors for i in range(n_layers)]
    moe = None
    if any(moe_layers):
        moe = MoESpec(
            n_experts=int(f.arch_require("expert_count")),
            n_active=int(f.arch_require("expert_used_count")),
            expert_ffn_dim=max(_per_layer(f, "expert_feed_forward_length", n_layers)),
            renormalize=True,
        )
    layers = tuple(
        LayerSpec(
            sliding_window=window if swa else None,
            rope=swa_rope if swa else full_rope,
            moe=is_moe,
            head_dim=head_swa if swa else head_full,
            n_kv_heads=kv,
        )
        for swa, is_moe, kv in zip(is_swa, moe_layers, n_kv, strict=True)
    )
    softcap = f.arch_get("final_logit_softcapping")
    n_vocab = f.arch_get("vocab_size") or len(f.require("tokenizer.ggml.tokens"))
    # Model-wide sizes are the largest per-layer ones (what the placement plan budgets for).
    head_dim = max(layer.head_dim or head_full for layer in layers)
    return ModelConfig(
        arch=f.arch,
        n_vocab=int(n_vocab),
        hidden=hidden,
        n_heads=n_heads[0],
        n_kv_heads=max(n_kv),
        head_dim=head_dim,
        value_dim=head_dim,
        ffn_dim=max(_per_layer(f, "feed_forward_length", n_layers)),
        context_length=int(f.arch_get("context_length", 131072)),
        rms_eps=float(f.arch_require("attention.layer_norm_rms_epsilon")),
        activation=geglu_activation(f),
        qk_norm=True,
        sandwich_norms=True,
        embed_scale=math.sqrt(hidden),
        attn_scale=1.0,  # llama.cpp: Gemma 4 has no query pre-attention scaling
        final_logit_softcap=float(softcap) if softcap else None,
        attn_logit_softcap=None,
        moe=moe,
        layers=layers,
    )


def _attention(cfg: ModelConfig, i: int, spec: LayerSpec, loader: WeightLoader, ropes: RopeCache) -> Attention:
    p = f"blk.{i}."
    head_dim = spec.head_dim or cfg.head_dim
    return Attention(
        shape=AttentionShape(
            n_heads=cfg.n_heads,
            n_kv_heads=spec.n_kv_heads or cfg.n_kv_heads,
            head_dim=head_dim,
            value_dim=head_dim,
            scale=cfg.attn_scale,
            sliding_window=spec.sliding_window,
        ),
        q=loader.linear(p + "attn_q.weight"),
        k=loader.linear(p + "attn_k.weight"),
        v=loader.linear(p + "attn_v.weight") if loader.has(p + "attn_v.weight") else None,  # None: V = K
        o=loader.linear(p + "attn_output.weight"),
        rope=ropes.get_rope(spec.rope),
        q_norm=loader.vector(p + "attn_q_norm.weight"),
        k_norm=loader.vector(p + "attn_k_norm.weight"),
        norm_eps=cfg.rms_eps,
        v_norm=True,
    )


def _routed(cfg: ModelConfig, i: int, loader: WeightLoader) -> RoutedFFN:
    """The MoE branch: router on the residual, experts between their own pre/post norms."""
    p = f"blk.{i}."
    assert cfg.moe is not None
    glu = Gated(activation(cfg.activation))
    fused = loader.has(p + "ffn_gate_up_exps.weight")
    scaled = loader.has(p + "ffn_down_exps.scale")
    # Through routed_experts: with the experts in host RAM their scale is there too, and the whole
    # GLUExperts runs on the host (OffloadedExperts), never indexing a host vector by GPU ids.
    experts = loader.routed_experts(
        i,
        lambda src: GLUExperts(
            down=src.experts(p + "ffn_down_exps.weight"),
            glu=glu,
            gate_up=src.experts(p + "ffn_gate_up_exps.weight") if fused else None,
            gate=None if fused else src.experts(p + "ffn_gate_exps.weight"),
            up=None if fused else src.experts(p + "ffn_up_exps.weight"),
            down_scale=src.vector(p + "ffn_down_exps.scale") if scaled else None,
        ),
    )
    router = NormedSoftmaxTopKRouter(
        proj=loader.linear(p + "ffn_gate_inp.weight"),
        input_scale=loader.vector(p + "ffn_gate_inp.scale") / math.sqrt(cfg.hidden),
        n_active=cfg.moe.n_active,
        eps=cfg.rms_eps,
    )
    return RoutedFFN(
        router=router,
        experts=experts,
        expert_norm=loader.vector(p + "pre_ffw_norm_2.weight"),
        post_norm=loader.vector(p + "post_ffw_norm_2.weight"),
        eps=cfg.rms_eps,
    )


def build_block(cfg: ModelConfig, i: int, spec: LayerSpec, loader: WeightLoader, ropes: RopeCache) -> Block:
    """Attention with sandwich norms; a dense GEGLU MLP, beside routed experts in MoE layers."""
    p = f"blk.{i}."
    dense = GatedMLP(
        gate=loader.linear(p + "ffn_gate.weight"),
        up=loader.linear(p + "ffn_up.weight"),
        down=loader.linear(p + "ffn_down.weight"),
        act=activation(cfg.activation),
    )
    ffn_norm: torch.Tensor | None = loader.vector(p + "ffn_norm.weight")
    ffn: FFN = dense
    if spec.moe:
        # Both branches read the residual stream and norm it themselves: FFN(x) = dense(x) + moe(x).
        ffn = ParallelFFN(
            dense=NormedFFN(
                dense, pre_norm=ffn_norm, post_norm=loader.vector(p + "post_ffw_norm_1.weight"), eps=cfg.rms_eps
            ),  # fmt: skip
            sparse=_routed(cfg, i, loader),
        )
        ffn_norm = None
    scale_name = p + "layer_output_scale.weight"
    return Block(
        mixer_norm=loader.vector(p + "attn_norm.weight"),
        mixer=_attention(cfg, i, spec, loader, ropes),
        post_mixer_norm=loader.vector(p + "post_attention_norm.weight"),
        ffn_norm=ffn_norm,
        ffn=ffn,
        post_ffn_norm=loader.vector(p + "post_ffw_norm.weight"),
        eps=cfg.rms_eps,
        out_scale=loader.vector(scale_name) if loader.has(scale_name) else None,
    )
