"""Which models the CPU step graphs compute (`unsupported`: why not, or None), and the ggml ops that stand for the
layer path's own (its activations, its cache types). What a graph does not cover keeps the layer path
(models/decoder.py): attention with a logit softcap or a sliding-window ring, delta-net mixers whose key and value
heads differ in size (ggml's fused rule needs them equal), a float file's GEGLU experts (transformers' tanh formula,
which no ggml op computes), tensor-parallel ranks."""

from __future__ import annotations

import ggml
import torch

from tandem.layers.activations import ACTIVATIONS
from tandem.layers.attention import Attention
from tandem.layers.delta_net import DeltaNetPool, GatedDeltaNet, SplitBetaAlpha
from tandem.layers.ffn import NormedFFN, ParallelFFN, RoutedFFN
from tandem.layers.gated_attention import GatedAttention
from tandem.layers.linear import BiasedLinear, GGMLLinear
from tandem.layers.mlp import GatedMLP
from tandem.layers.moe import MoE, NormedSoftmaxTopKRouter, SoftmaxTopKRouter, TopKSoftmaxRouter
from tandem.layers.shared_expert import MoEWithSharedExpert
from tandem.models.blocks import Block
from tandem.models.decoder import DecoderModel
from tandem.state.kv_cache import KV_PAD, KVPool
from tandem.state.pool import StatePool

__all__ = ["CACHE_TYPES", "GELU_TANH", "GLU_OPS", "routed_branches", "unsupported"]

# ggml's gated units for the MLP's activation (layers/activations.py: the values of the layer path's)
GLU_OPS = {ACTIVATIONS["gelu_tanh_ggml"]: ggml.ggml_geglu_split, ACTIVATIONS["silu"]: ggml.ggml_swiglu_split}
GELU_TANH = ACTIVATIONS["gelu_tanh"]  # the formula (float files): composed from ggml's ops
# The cache types the graphs store into and read, as llama.cpp's nodes do. Not bf16: ggml's product would round
# the queries to bf16, where the layer path keeps float32 products (layers/attention.py).
CACHE_TYPES = {torch.float16: ggml.GGML_TYPE_F16, torch.float32: ggml.GGML_TYPE_F32}


def unsupported(model: DecoderModel, pool: StatePool) -> str | None:
    """Why this model's CPU step cannot run as these graphs (None: it can)."""
    if model.device.type != "cpu":
        return "the model does not compute on the CPU"
    if model.embed.kernels is None or not isinstance(model.output, GGMLLinear):
        return "the embedding table or output head is not read by ggml"
    if getattr(model, "reduce", None) is not None:
        return "tensor parallel ranks"
    for i, (block, layer_pool) in enumerate(zip(model.blocks, pool.layers, strict=True)):
        reason = _block_unsupported(block, layer_pool)
        if reason is not None:
            return f"layer {i}: {reason}"
    return None


def _block_unsupported(block: object, pool: object) -> str | None:
    if type(block) is not Block or (block.ffn_norm is None) != isinstance(block.ffn, ParallelFFN):
        return "not a pre-norm block"
    if block.mixer_reduce is not None or block.ffn_reduce is not None:
        return "tensor parallel ranks"
    m = block.mixer
    reason = _mixer_unsupported(m, pool)
    if reason is not None:
        return reason
    ffn = block.ffn
    if isinstance(ffn, ParallelFFN):  # Gemma 4: a dense branch and a routed one, each with its own norms
        dense = ffn.dense
        if ffn.reduce is not None or not isinstance(dense, NormedFFN) or not isinstance(dense.ffn, GatedMLP):
            return "a parallel feed-forward whose dense branch is not a normed MLP"
        return _mlp_unsupported(dense.ffn) or _routed_unsupported(ffn.sparse.router, ffn.sparse.experts)
    if isinstance(ffn, MoEWithSharedExpert):  # Qwen3.5 / Qwen3-Next: routed experts + a gated shared one
        routed = ffn.routed
        return _mlp_unsupported(ffn.shared.mlp) or _routed_unsupported(routed.router, routed.experts)
    if isinstance(ffn, GatedMLP):
        return _mlp_unsupported(ffn)
    if isinstance(ffn, MoE):
        return _routed_unsupported(ffn.router, ffn.experts)
    return f"feed-forward {type(ffn).__name__}"


def _mixer_unsupported(m: object, pool: object) -> str | None:
    if type(m) is GatedDeltaNet and isinstance(pool, DeltaNetPool):
        return _delta_net_unsupported(m, pool)
    if type(m) not in (Attention, GatedAttention) or not isinstance(pool, KVPool):
        return f"mixer {type(m).__name__}"
    s = m.shape
    if s.softcap is not None:
        return "attention with softcap"
    if isinstance(m, GatedAttention):
        projections = (m.q_gate, m.k, m.v, m.o)
    else:
        projections = (m.q, m.k, m.o, m.k if m.v is None else m.v)
    if not all(_by_ggml(p) for p in projections):
        return "attention projections not read by ggml"
    if pool.k.dtype not in CACHE_TYPES or pool.window is not None:
        return f"a {pool.k.dtype} cache"
    if pool.k.shape[0] * (pool.k.shape[1] + KV_PAD) >= 2**31:
        return "more cache rows than int32 row numbers reach"
    return None


def _delta_net_unsupported(m: GatedDeltaNet, pool: DeltaNetPool) -> str | None:
    s = m.shape
    if s.head_k_dim != s.head_v_dim:
        return f"delta-net key/value head sizes {s.head_k_dim}/{s.head_v_dim} (ggml's rule needs them equal)"
    ba = m.beta_alpha
    ba_projections = (ba.beta, ba.alpha) if isinstance(ba, SplitBetaAlpha) else (ba.proj,)
    if not all(_by_ggml(p) for p in (m.qkv, m.gate, m.out, *ba_projections)):
        return "delta-net projections not read by ggml"
    if pool.conv.device.type != "cpu" or not pool.ssm.transpose(2, 3).is_contiguous():
        return "a delta-net state not in ggml's layout"
    return None


def _mlp_unsupported(mlp: GatedMLP) -> str | None:
    known = mlp.act in GLU_OPS or mlp.act is GELU_TANH
    if not known or not all(isinstance(p, GGMLLinear) for p in (mlp.gate, mlp.up, mlp.down)):
        return "an MLP ggml does not compute as the layer path does"
    return None


def _routed_unsupported(router: object, experts: object) -> str | None:
    if type(router) not in _ROUTERS or not isinstance(getattr(router, "proj", None), GGMLLinear):
        return f"router {type(router).__name__}"
    if getattr(experts, "_graph", None) is None:
        return "routed experts not computed by one ggml graph"
    return None


_ROUTERS = (SoftmaxTopKRouter, TopKSoftmaxRouter, NormedSoftmaxTopKRouter)


def routed_branches(model: DecoderModel) -> list[MoE | RoutedFFN]:
    """The model's routed-expert branches (a MoE layer's FFN, the routed half of a ParallelFFN, or the routed
    experts beside a shared one)."""
    out: list[MoE | RoutedFFN] = []
    for block in model.blocks:
        ffn = block.ffn  # type: ignore[attr-defined]
        if isinstance(ffn, MoE):
            out.append(ffn)
        elif isinstance(ffn, ParallelFFN):
            out.append(ffn.sparse)
        elif isinstance(ffn, MoEWithSharedExpert):
            out.append(ffn.routed)
    return out


def _by_ggml(linear: object) -> bool:
    """A projection ggml multiplies (with a bias vector added after it, as llama.cpp adds it)."""
    return isinstance(linear.inner if isinstance(linear, BiasedLinear) else linear, GGMLLinear)
