"""Qwen3 (dense): SwiGLU MLP, per-head q/k RMSNorm, NEOX rope."""

from __future__ import annotations

from tandem.gguf import GGUFFile
from tandem.layers.rope import RopeSpec
from tandem.models.config import LayerSpec, ModelConfig, common_hparams, default_attn_scale, rope_scale, shape_fields


def read_config(f: GGUFFile) -> ModelConfig:
    hp = common_hparams(f)
    rope = RopeSpec(base=hp.rope_base, dim=hp.head_dim, scale=rope_scale(f))
    return ModelConfig(
        **shape_fields(f, hp),
        activation="silu",
        qk_norm=True,
        sandwich_norms=False,
        embed_scale=1.0,
        attn_scale=default_attn_scale(hp.head_dim),
        final_logit_softcap=None,
        attn_logit_softcap=None,
        moe=None,
        layers=tuple(LayerSpec(sliding_window=None, rope=rope, moe=False) for _ in range(hp.n_layers)),
    )
