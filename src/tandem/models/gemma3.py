"""Gemma 3: GEGLU MLP, sandwich norms, q/k norms, scaled embeddings, local (sliding) and global layers.

As in llama.cpp: by default every sixth layer is global; local layers use `rope.freq_base_swa`
(10000) without scaling, global layers the file's base with its linear scaling.

GEGLU: for quantized files (made for llama.cpp) the GELU is ggml's f16 lookup table, as llama.cpp
computes it (up to ~1e-3 from the formula, enough to change greedy tokens); files with float weights
keep the tanh formula, which is what `transformers` computes.
"""

from __future__ import annotations

import math

from gguf import GGMLQuantizationType

from tandem.gguf import GGUFFile
from tandem.layers.rope import RopeSpec
from tandem.models.config import LayerSpec, ModelConfig, common_hparams, rope_scale, shape_fields, sliding_window_layers

DEFAULT_SLIDING_WINDOW_PATTERN = 6
_FLOAT_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}


def geglu_activation(f: GGUFFile) -> str:
    """ggml's table GELU when the MLP weights are quantized, the formula otherwise."""
    gate = f.tensors.get("blk.0.ffn_gate.weight")
    return "gelu_tanh_ggml" if gate is not None and gate.qtype not in _FLOAT_TYPES else "gelu_tanh"


def read_config(f: GGUFFile) -> ModelConfig:
    hp = common_hparams(f)
    window = int(f.arch_get("attention.sliding_window", 0))
    if window > 0:
        is_local = sliding_window_layers(f, hp.n_layers, DEFAULT_SLIDING_WINDOW_PATTERN)
    else:
        is_local = [False] * hp.n_layers
    global_rope = RopeSpec(base=hp.rope_base, dim=hp.head_dim, scale=rope_scale(f))
    local_rope = RopeSpec(base=float(f.arch_get("rope.freq_base_swa", 10000.0)), dim=hp.head_dim)
    layers = tuple(
        LayerSpec(sliding_window=window if local else None, rope=local_rope if local else global_rope, moe=False)
        for local in is_local
    )
    softcap = f.arch_get("final_logit_softcapping")
    # Gemma 3 27B scales queries by 1/sqrt(hidden / heads); the others by 1/sqrt(head_dim).
    query_scale = hp.hidden // hp.n_heads if hp.n_layers == 62 else hp.head_dim
    return ModelConfig(
        **shape_fields(f, hp),
        activation=geglu_activation(f),
        qk_norm=True,
        sandwich_norms=True,
        embed_scale=math.sqrt(hp.hidden),
        attn_scale=1.0 / math.sqrt(query_scale),
        scale_queries=True,  # llama.cpp's gemma3 graph scales Q (ggml_scale) and passes kq_scale 1
        final_logit_softcap=float(softcap) if softcap else None,
        attn_logit_softcap=None,
        moe=None,
        layers=layers,
    )
