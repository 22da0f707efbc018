"""Qwen3.5 / Qwen3.6 MoE (`qwen35moe`: 35B-A3B, 122B-A10B, ...) and Qwen3-Next (`qwen3next`).

Hybrid layers: most are gated delta-net linear attention (`layers/delta_net.py`), every
`full_attention_interval`-th one (or as `attention.recurrent_layers` lists them) is gated full
attention with q/k RMSNorm and partial rotary embeddings. Every layer's FFN is top-k softmax-routed
experts (always renormalised, as llama.cpp does) plus a sigmoid-gated shared expert.

The two GGUF flavours differ only in details, all read from the file:
* qwen35moe: separate `ssm_beta` / `ssm_alpha`; llama.cpp's converter reorders the value heads to the
  "tiled" layout. Its rope is IMROPE with `rope.dimension_sections`; for text every section gets the
  same position, which makes it plain NEOX rope over `rope.dimension_count` dimensions.
* qwen3next: one fused `ssm_ba`; value heads in the Hugging Face ("grouped") layout; NEOX rope.
Norm weights are stored as llama.cpp's converter writes them: with Qwen's (1 + w) folded in, except the
delta-net's gated norm (`ssm_norm`), which multiplies by w. MTP (next-token prediction) blocks at the
end (`nextn_predict_layers`) are not run.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.errors import GGUFFormatError, UnsupportedModelError
from tandem.gguf import GGUFFile
from tandem.layers.activations import activation
from tandem.layers.delta_net import DeltaNetShape, FusedBetaAlpha, GatedDeltaNet, SplitBetaAlpha
from tandem.layers.gated_attention import GatedAttention
from tandem.layers.mlp import GatedMLP
from tandem.layers.rope import RopeSpec
from tandem.layers.shared_expert import MoEWithSharedExpert, SharedExpert
from tandem.models.blocks import Block, RopeCache, attention_shape, standard_ffn
from tandem.models.config import (
    MAX_LAYERS,
    MAX_WIDTH,
    LayerSpec,
    ModelConfig,
    check_range,
    common_hparams,
    default_attn_scale,
    moe_spec,
    rope_scale,
    shape_fields,
)
from tandem.weights.loader import WeightLoader

DEFAULT_FULL_ATTENTION_INTERVAL = 4  # llama.cpp's default when the file has no layer list
# Upper bounds of the `ssm.*` sizes (real models: 16 key heads, 32 value heads, 128-wide heads, a kernel of 4); the
# tensors' shapes then tie them to the file. The recurrent state of a layer is value heads x state x head sizes.
SSM_LIMITS = {"group_count": 1 << 10, "time_step_rank": 1 << 10, "state_size": 1 << 12, "inner_size": 1 << 20,
              "conv_kernel": 1 << 6}  # fmt: skip


@dataclass(frozen=True)
class HybridConfig(ModelConfig):
    """ModelConfig plus what the hybrid layers need."""

    delta_net: DeltaNetShape
    recurrent: tuple[bool, ...]  # per layer: gated delta-net (True) or gated full attention
    shared_expert_ffn_dim: int


def recurrent_layers(f: GGUFFile, n_layers: int) -> list[bool]:
    """Which layers are linear attention: `attention.recurrent_layers`, else every layer but each
    `full_attention_interval`-th (as llama.cpp decides it)."""
    listed = f.arch_get("attention.recurrent_layers")
    if listed is not None:
        if len(listed) < n_layers:
            raise UnsupportedModelError(f"{f.path.name}: recurrent_layers has {len(listed)} entries for {n_layers}")
        return [bool(r) for r in listed[:n_layers]]
    interval = int(f.arch_get("full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL))
    check_range(f.path.name, "full_attention_interval", interval, 1, MAX_LAYERS)
    return [(i + 1) % interval != 0 for i in range(n_layers)]


def read_config(f: GGUFFile) -> HybridConfig:
    hp = common_hparams(f)
    n_nextn = int(f.arch_get("nextn_predict_layers", 0))
    check_range(f.path.name, "nextn_predict_layers", n_nextn, 0, hp.n_layers - 1)
    n_layers = hp.n_layers - n_nextn  # MTP blocks come last
    rope = RopeSpec(base=hp.rope_base, dim=int(f.arch_get("rope.dimension_count", hp.head_dim)), scale=rope_scale(f))
    ssm = {key: int(f.arch_require(f"ssm.{key}")) for key in SSM_LIMITS}
    for key, hi in SSM_LIMITS.items():
        check_range(f.path.name, f"ssm.{key}", ssm[key], 1, hi)
    n_k_heads, n_v_heads, inner = ssm["group_count"], ssm["time_step_rank"], ssm["inner_size"]
    if n_v_heads % n_k_heads or inner % n_v_heads:
        raise GGUFFormatError(
            f"{f.path.name}: ssm.time_step_rank {n_v_heads} value heads must be a multiple of ssm.group_count "
            f"{n_k_heads} and divide ssm.inner_size {inner}"
        )
    delta_net = DeltaNetShape(
        n_k_heads=n_k_heads,
        n_v_heads=n_v_heads,
        head_k_dim=ssm["state_size"],
        head_v_dim=inner // n_v_heads,
        conv_kernel=ssm["conv_kernel"],
        head_layout="grouped" if f.arch == "qwen3next" else "tiled",
    )
    moe = moe_spec(f, renormalize=True)
    shared_ffn = int(f.arch_get("expert_shared_feed_forward_length", hp.ffn_dim))
    check_range(f.path.name, "expert_shared_feed_forward_length", shared_ffn, 0, MAX_WIDTH)
    return HybridConfig(
        **shape_fields(f, hp),
        activation="silu",
        qk_norm=True,
        sandwich_norms=False,
        embed_scale=1.0,
        attn_scale=float(f.arch_get("attention.scale", 0.0)) or default_attn_scale(hp.head_dim),
        final_logit_softcap=None,
        attn_logit_softcap=None,
        moe=moe,
        layers=tuple(LayerSpec(sliding_window=None, rope=rope, moe=True) for _ in range(n_layers)),
        delta_net=delta_net,
        recurrent=tuple(recurrent_layers(f, n_layers)),
        shared_expert_ffn_dim=shared_ffn,
    )


def _delta_net(cfg: HybridConfig, i: int, loader: WeightLoader) -> GatedDeltaNet:
    p = f"blk.{i}."
    if loader.has(p + "ssm_beta.weight"):
        beta_alpha: SplitBetaAlpha | FusedBetaAlpha = SplitBetaAlpha(
            beta=loader.linear(p + "ssm_beta.weight"), alpha=loader.linear(p + "ssm_alpha.weight")
        )
    else:
        beta_alpha = FusedBetaAlpha(proj=loader.linear(p + "ssm_ba.weight"), n_k_heads=cfg.delta_net.n_k_heads)
    if not loader.has(p + "attn_qkv.weight") and loader.has(p + "ssm_in.weight"):
        raise UnsupportedModelError(
            f"{loader.file.path.name}: layer {i} has the legacy fused 'ssm_in' (qkvz) tensor; reconvert the model"
        )
    return GatedDeltaNet(
        shape=cfg.delta_net,
        qkv=loader.linear(p + "attn_qkv.weight"),
        gate=loader.linear(p + "attn_gate.weight"),
        beta_alpha=beta_alpha,
        conv_weight=loader.vector(p + "ssm_conv1d.weight"),
        dt_bias=loader.vector(p + "ssm_dt.bias"),
        a=loader.vector(p + "ssm_a"),
        norm=loader.vector(p + "ssm_norm.weight"),
        out=loader.linear(p + "ssm_out.weight"),
        eps=cfg.rms_eps,
    )


def _gated_attention(
    cfg: HybridConfig, i: int, spec: LayerSpec, loader: WeightLoader, ropes: RopeCache
) -> GatedAttention:
    p = f"blk.{i}."
    shape = attention_shape(cfg, spec)  # full attention: these layers have no window
    return GatedAttention(
        shape=shape,
        q_gate=loader.linear(p + "attn_q.weight"),
        k=loader.linear(p + "attn_k.weight"),
        v=loader.linear(p + "attn_v.weight"),
        o=loader.linear(p + "attn_output.weight"),
        rope=ropes.get_rope(spec.rope),
        q_norm=loader.vector(p + "attn_q_norm.weight"),
        k_norm=loader.vector(p + "attn_k_norm.weight"),
        norm_eps=cfg.rms_eps,
    )


def _ffn(cfg: HybridConfig, i: int, spec: LayerSpec, loader: WeightLoader) -> MoEWithSharedExpert:
    p = f"blk.{i}."
    routed = standard_ffn(cfg, i, spec, loader)
    assert not isinstance(routed, GatedMLP)  # every layer is MoE (spec.moe)
    shared = SharedExpert(
        mlp=GatedMLP(
            gate=loader.linear(p + "ffn_gate_shexp.weight"),
            up=loader.linear(p + "ffn_up_shexp.weight"),
            down=loader.linear(p + "ffn_down_shexp.weight"),
            act=activation(cfg.activation),
        ),
        gate=loader.vector(p + "ffn_gate_inp_shexp.weight").reshape(-1),  # [1, D] or [D] in the file
    )
    return MoEWithSharedExpert(routed=routed, shared=shared)


def build_block(cfg: ModelConfig, i: int, spec: LayerSpec, loader: WeightLoader, ropes: RopeCache) -> Block:
    """Layer i: pre-norm delta-net or gated attention, then (`post_attention_norm`) the MoE FFN."""
    if not isinstance(cfg, HybridConfig):
        raise TypeError("qwen35moe blocks need the HybridConfig from qwen35moe.read_config")
    p = f"blk.{i}."
    mixer = _delta_net(cfg, i, loader) if cfg.recurrent[i] else _gated_attention(cfg, i, spec, loader, ropes)
    return Block(
        mixer_norm=loader.vector(p + "attn_norm.weight"),
        mixer=mixer,
        post_mixer_norm=None,
        ffn_norm=loader.vector(p + "post_attention_norm.weight"),
        ffn=_ffn(cfg, i, spec, loader),
        post_ffn_norm=None,
        eps=cfg.rms_eps,
    )
