"""What a decoder-only model is, read from GGUF metadata: one ModelConfig with a LayerSpec per layer."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tandem.errors import UnsupportedModelError
from tandem.gguf import GGUFFile
from tandem.layers.rope import RopeSpec, YarnSpec


@dataclass(frozen=True)
class MoESpec:
    n_experts: int
    n_active: int
    expert_ffn_dim: int
    renormalize: bool  # renormalise the top-k weights to sum to one


@dataclass(frozen=True)
class LayerSpec:
    """What differs between the layers of one model."""

    sliding_window: int | None  # None: full attention
    rope: RopeSpec
    moe: bool  # routed experts instead of a dense MLP
    head_dim: int | None = None  # this layer's q/k/v head size, when it differs from the model's (Gemma 4)
    n_kv_heads: int | None = None  # this layer's KV heads, when they differ from the model's (Gemma 4)


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_vocab: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    value_dim: int
    ffn_dim: int
    context_length: int
    rms_eps: float
    activation: str  # "silu" (SwiGLU) or "gelu_tanh" (GEGLU)
    qk_norm: bool
    sandwich_norms: bool  # Gemma: extra norms after attention and after the MLP
    embed_scale: float  # token embeddings are multiplied by this (Gemma: sqrt(hidden))
    attn_scale: float  # multiplies q.k
    final_logit_softcap: float | None
    attn_logit_softcap: float | None
    moe: MoESpec | None
    layers: tuple[LayerSpec, ...]

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def __post_init__(self) -> None:
        sizes = {"n_vocab": self.n_vocab, "hidden": self.hidden, "n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads,
                 "head_dim": self.head_dim, "layers": len(self.layers)}  # fmt: skip
        if bad := [f"{name} {value}" for name, value in sizes.items() if value <= 0]:
            raise UnsupportedModelError(f"{self.arch}: the metadata gives {', '.join(bad)}; each must be positive")
        if self.n_heads % self.n_kv_heads != 0:
            raise UnsupportedModelError(
                f"{self.arch}: {self.n_heads} query heads are not a multiple of {self.n_kv_heads} KV heads"
            )
        if any(layer.moe for layer in self.layers) and self.moe is None:
            raise UnsupportedModelError(f"{self.arch}: MoE layers without expert metadata")


@dataclass(frozen=True)
class CommonHParams:
    """Hyper-parameters every architecture stores under the same `{arch}.*` keys."""

    n_vocab: int
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    value_dim: int
    ffn_dim: int
    context_length: int
    rms_eps: float
    rope_base: float


def common_hparams(f: GGUFFile) -> CommonHParams:
    """Read the keys shared by the llama-like architectures (missing required keys -> one-line error)."""
    hidden = int(f.arch_require("embedding_length"))
    n_heads = int(f.arch_require("attention.head_count"))
    head_dim = int(f.arch_get("attention.key_length", hidden // n_heads))
    n_vocab = f.arch_get("vocab_size")
    if n_vocab is None:
        n_vocab = len(f.require("tokenizer.ggml.tokens"))
    return CommonHParams(
        n_vocab=int(n_vocab),
        n_layers=int(f.arch_require("block_count")),
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=int(f.arch_get("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        value_dim=int(f.arch_get("attention.value_length", head_dim)),
        ffn_dim=int(f.arch_get("feed_forward_length", 0)),
        context_length=int(f.arch_get("context_length", 4096)),
        rms_eps=float(f.arch_require("attention.layer_norm_rms_epsilon")),
        rope_base=float(f.arch_get("rope.freq_base", 10000.0)),
    )


def shape_fields(f: GGUFFile, hp: CommonHParams) -> dict[str, Any]:
    """The ModelConfig fields every architecture takes straight from the common hyper-parameters."""
    return {
        "arch": f.arch,
        "n_vocab": hp.n_vocab,
        "hidden": hp.hidden,
        "n_heads": hp.n_heads,
        "n_kv_heads": hp.n_kv_heads,
        "head_dim": hp.head_dim,
        "value_dim": hp.value_dim,
        "ffn_dim": hp.ffn_dim,
        "context_length": hp.context_length,
        "rms_eps": hp.rms_eps,
    }


def moe_spec(f: GGUFFile, renormalize: bool) -> MoESpec:
    """The routed-expert hyper-parameters (`expert_count`, `expert_used_count`, ...)."""
    return MoESpec(
        n_experts=int(f.arch_require("expert_count")),
        n_active=int(f.arch_require("expert_used_count")),
        expert_ffn_dim=int(f.arch_require("expert_feed_forward_length")),
        renormalize=renormalize,
    )


def default_attn_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def sliding_window_layers(f: GGUFFile, n_layers: int, default_pattern: int) -> list[bool]:
    """Which layers use the sliding window, as llama.cpp decides it.

    `{arch}.attention.sliding_window_pattern` is either a per-layer bool array or a period n
    (layers with i % n < n - 1 are local); absent, the architecture's default period applies.
    """
    pattern = f.arch_get("attention.sliding_window_pattern", default_pattern)
    if isinstance(pattern, list):
        if len(pattern) < n_layers:
            raise UnsupportedModelError(
                f"{f.path.name}: sliding_window_pattern has {len(pattern)} entries for {n_layers} layers"
            )
        return [bool(p) for p in pattern[:n_layers]]
    n = int(pattern)
    return [n == 0 or i % n < n - 1 for i in range(n_layers)]


def rope_scale(f: GGUFFile) -> float:
    """Position multiplier from `rope.scaling.*` (linear scaling only; 1.0 when absent)."""
    kind = f.arch_get("rope.scaling.type")
    if kind in (None, "none"):
        return 1.0
    if kind != "linear":
        raise UnsupportedModelError(f"{f.path.name}: rope scaling '{kind}' is not supported for {f.arch}")
    return 1.0 / float(f.arch_get("rope.scaling.factor", 1.0))


def yarn_rope_scaling(f: GGUFFile) -> tuple[float, YarnSpec | None]:
    """(frequency scale, YaRN parameters) as llama.cpp's context derives them from `rope.scaling.*`.

    Only `scaling.type`, `scaling.factor`, `scaling.original_context_length` and `scaling.attn_factor`
    are read: llama.cpp ignores the `yarn_*` keys (ext/attn factor, beta fast/slow) for all but a few
    architectures and uses ext_factor 1, beta 32/1. Its attention factor is get_mscale(factor) /
    (1 + 0.1 ln factor) * attn_factor, so that ggml's own 1 + 0.1 ln factor leaves get_mscale(factor).
    """
    kind = f.arch_get("rope.scaling.type")
    factor = float(f.arch_get("rope.scaling.factor", 0.0) or 0.0)
    scale = 1.0 / factor if factor else 1.0
    if kind in (None, "none"):
        return 1.0, None
    if kind == "linear":
        return scale, None
    if kind != "yarn":
        raise UnsupportedModelError(f"{f.path.name}: rope scaling '{kind}' is not supported for {f.arch}")
    n_ctx_orig = int(f.arch_get("rope.scaling.original_context_length", 0) or f.arch_get("context_length", 4096))
    factor = 1.0 / scale
    attn = (0.1 * math.log(factor) + 1.0) if factor > 1.0 else 1.0
    attn /= 1.0 + 0.1 * math.log(factor)
    attn *= float(f.arch_get("rope.scaling.attn_factor", 1.0))
    return scale, YarnSpec(n_ctx_orig=n_ctx_orig, ext_factor=1.0, attn_factor=attn)
