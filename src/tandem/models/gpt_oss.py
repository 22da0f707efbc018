"""gpt-oss (GGUF arch `gpt-oss`; gpt-oss-20b / 120b), as llama.cpp's `openai-moe.cpp` runs it.

Attention with q/k/v/o biases and a learned sink logit per head; sliding-window (even layers, by the
default period of 2) and full layers alternate; YaRN rope (llama.cpp's reading of it, see
`yarn_rope_scaling`) on every layer. Every layer is MoE: the router adds a bias, keeps the top-k logits
and softmaxes over them; the experts have biases and the clamped SwiGLU (`swiglu_oai`). The norm before
the experts is stored as `post_attention_norm`. Expert weights are typically MXFP4, which ggml's
mul_mat_id handles directly.
"""

from __future__ import annotations

import math

import torch

from tandem.gguf import GGUFFile
from tandem.layers.activations import swiglu_oai
from tandem.layers.attention import Attention
from tandem.layers.linear import BiasedLinear, Linear
from tandem.layers.moe import GLUExperts, MoE, TopKSoftmaxRouter
from tandem.layers.rope import RopeSpec
from tandem.models.blocks import Block, RopeCache, attention_shape
from tandem.models.config import (
    LayerSpec,
    ModelConfig,
    common_hparams,
    moe_spec,
    shape_fields,
    sliding_window_layers,
    yarn_rope_scaling,
)
from tandem.weights.loader import WeightLoader

DEFAULT_SLIDING_WINDOW_PATTERN = 2  # llama.cpp: load_swa_pattern(ml, 2) -> even layers are sliding


def read_config(f: GGUFFile) -> ModelConfig:
    """The ModelConfig of a gpt-oss GGUF file."""
    hp = common_hparams(f)
    n_rot = int(f.arch_get("rope.dimension_count", hp.head_dim))
    window = int(f.arch_require("attention.sliding_window"))
    is_swa = sliding_window_layers(f, hp.n_layers, DEFAULT_SLIDING_WINDOW_PATTERN)
    scale, yarn = yarn_rope_scaling(f)
    # llama.cpp gives the sliding layers the same frequency scale and, unless the file says otherwise, base.
    rope = RopeSpec(base=hp.rope_base, dim=n_rot, scale=scale, yarn=yarn)
    swa_rope = RopeSpec(base=float(f.arch_get("rope.freq_base_swa", hp.rope_base)), dim=n_rot, scale=scale, yarn=yarn)
    layers = tuple(
        LayerSpec(sliding_window=window if swa else None, rope=swa_rope if swa else rope, moe=True) for swa in is_swa
    )
    return ModelConfig(
        **shape_fields(f, hp),
        activation="swiglu_oai",
        qk_norm=False,
        sandwich_norms=False,
        embed_scale=1.0,
        attn_scale=1.0 / math.sqrt(n_rot),
        final_logit_softcap=None,
        attn_logit_softcap=None,
        moe=moe_spec(f, renormalize=False),  # softmax over the selected logits: nothing to renormalise
        layers=layers,
    )


def _linear(loader: WeightLoader, stem: str) -> Linear:
    """`stem.weight`, plus `stem.bias` when the file has one."""
    w = loader.linear(stem + ".weight")
    return BiasedLinear(w, loader.vector(stem + ".bias")) if loader.has(stem + ".bias") else w


def _optional(loader: WeightLoader, name: str) -> torch.Tensor | None:
    return loader.vector(name) if loader.has(name) else None


def build_block(cfg: ModelConfig, i: int, spec: LayerSpec, loader: WeightLoader, ropes: RopeCache) -> Block:
    """Biased attention with sinks, then the biased clamped-SwiGLU experts."""
    p = f"blk.{i}."
    assert cfg.moe is not None
    attention = Attention(
        shape=attention_shape(cfg, spec),
        q=_linear(loader, p + "attn_q"),
        k=_linear(loader, p + "attn_k"),
        v=_linear(loader, p + "attn_v"),
        o=_linear(loader, p + "attn_output"),
        rope=ropes.get_rope(spec.rope),
        sinks=loader.vector(p + "attn_sinks.weight"),
    )
    biases = {n: p + n + ".bias" for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
    present = {n: name for n, name in biases.items() if loader.has(name)}
    # Through routed_experts: with the experts in host RAM their biases are there too, and the whole
    # GLUExperts runs on the host (OffloadedExperts), never indexing a host vector by GPU ids.
    experts = loader.routed_experts(
        i,
        lambda src: GLUExperts(
            gate=src.experts(p + "ffn_gate_exps.weight"),
            up=src.experts(p + "ffn_up_exps.weight"),
            down=src.experts(p + "ffn_down_exps.weight"),
            glu=swiglu_oai,
            gate_bias=src.vector(present["ffn_gate_exps"]) if "ffn_gate_exps" in present else None,
            up_bias=src.vector(present["ffn_up_exps"]) if "ffn_up_exps" in present else None,
            down_bias=src.vector(present["ffn_down_exps"]) if "ffn_down_exps" in present else None,
        ),
    )
    router = TopKSoftmaxRouter(
        proj=loader.linear(p + "ffn_gate_inp.weight"),
        n_active=cfg.moe.n_active,
        bias=_optional(loader, p + "ffn_gate_inp.bias"),
    )
    return Block(
        mixer_norm=loader.vector(p + "attn_norm.weight"),
        mixer=attention,
        post_mixer_norm=None,
        ffn_norm=loader.vector(p + "post_attention_norm.weight"),
        ffn=MoE(router=router, experts=experts),
        post_ffn_norm=None,
        eps=cfg.rms_eps,
    )
