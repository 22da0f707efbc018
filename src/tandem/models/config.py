"""What a decoder-only model is, read from GGUF metadata: one ModelConfig with a LayerSpec per layer."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tandem.errors import GGUFFormatError, UnsupportedModelError
from tandem.gguf import GGUFFile
from tandem.gguf.header import quote
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
    # where attn_scale is applied, as llama.cpp's graph of the family does: False, on the scores in the softmax
    # (kq_scale); True, on the queries before q.k (Gemma 3's ggml_scale of Q). The two round apart where the
    # queries meet an f16 cache as f16.
    scale_queries: bool = field(default=False, kw_only=True)  # keyword-only: subclasses add required fields

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
        self._check_ranges()

    def _check_ranges(self) -> None:
        """Upper bounds and cross-checks, before anything is sized from these numbers: far above any real model's,
        they refuse a hostile file's 2^31 rotated dimensions or 2^32 experts before a buffer is asked for (the
        tensors' shapes then tie the sizes to what the file holds)."""
        check_range(self.arch, "vocabulary", self.n_vocab, 1, MAX_VOCAB)
        for name, value in (("width", self.hidden), ("query heads", self.n_heads), ("head size", self.head_dim),
                            ("value head size", self.value_dim)):  # fmt: skip
            check_range(self.arch, name, value, 1, MAX_WIDTH)
        check_range(self.arch, "FFN size", self.ffn_dim, 0, MAX_WIDTH)
        check_range(self.arch, "context length", self.context_length, 1, MAX_CONTEXT)
        check_range(self.arch, "heads x head size", self.n_heads * max(self.head_dim, self.value_dim), 1, MAX_WIDTH)
        for name, x in (("rms epsilon", self.rms_eps), ("embedding scale", self.embed_scale),
                        ("attention scale", self.attn_scale)):  # fmt: skip
            check_finite(self.arch, name, x, positive=name != "rms epsilon")
        for name, cap in (("final logit softcap", self.final_logit_softcap),
                          ("attention logit softcap", self.attn_logit_softcap)):  # fmt: skip
            if cap is not None:
                check_finite(self.arch, name, cap, positive=True)
        if self.moe is not None:
            check_range(self.arch, "expert count", self.moe.n_experts, 1, MAX_EXPERTS)
            check_range(self.arch, "experts used per token", self.moe.n_active, 1, self.moe.n_experts)
            check_range(self.arch, "expert FFN size", self.moe.expert_ffn_dim, 1, MAX_WIDTH)
        for i, layer in enumerate(self.layers):
            head_dim = layer.head_dim or self.head_dim
            check_range(self.arch, f"layer {i} head size", head_dim, 1, MAX_WIDTH)
            n_kv = layer.n_kv_heads or self.n_kv_heads
            if n_kv <= 0 or self.n_heads % n_kv:
                raise UnsupportedModelError(
                    f"{self.arch}: layer {i}: {self.n_heads} query heads are not a multiple of {n_kv} KV heads"
                )
            if layer.sliding_window is not None:
                check_range(self.arch, f"layer {i} sliding window", layer.sliding_window, 1, MAX_CONTEXT)
            _check_rope(self.arch, i, layer.rope, head_dim)


# Sane maxima for hyper-parameters (the largest real models are 10-100 times below each).
MAX_VOCAB = 1 << 24
MAX_WIDTH = 1 << 20  # widths, head sizes, FFN sizes, heads x head size
MAX_CONTEXT = 1 << 30
MAX_EXPERTS = 1 << 16
MAX_LAYERS = 1 << 12


def check_range(where: str, name: str, value: int, lo: int, hi: int) -> None:
    """A size from the metadata within [lo, hi], or a one-line GGUFFormatError naming it."""
    if not lo <= value <= hi:
        raise GGUFFormatError(f"{where}: the metadata's {name} is {value}; it must be in [{lo}, {hi}]")


def check_finite(where: str, name: str, value: float, positive: bool = False) -> None:
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        need = "> 0" if positive else ">= 0"
        raise GGUFFormatError(f"{where}: the metadata's {name} is {value}; it must be finite and {need}")


def _check_rope(arch: str, i: int, rope: RopeSpec, head_dim: int) -> None:
    """Rotated dimensions come in pairs within the head; the frequencies are finite."""
    if not 0 < rope.dim <= head_dim or rope.dim % 2:
        raise GGUFFormatError(
            f"{arch}: layer {i} rotates {rope.dim} dimensions of a head of {head_dim}: it must be even and in "
            f"[2, {head_dim}]"
        )
    check_finite(arch, "rope frequency base", rope.base, positive=True)
    check_finite(arch, "rope scale", rope.scale, positive=True)
    if rope.freq_factors is not None and len(rope.freq_factors) != rope.dim // 2:
        raise GGUFFormatError(
            f"{arch}: rope_freqs has {len(rope.freq_factors)} factors for {rope.dim} rotated dimensions"
        )
    if rope.yarn is not None:
        check_range(arch, "rope original context length", rope.yarn.n_ctx_orig, 1, MAX_CONTEXT)
        check_finite(arch, "rope attention factor", rope.yarn.attn_factor, positive=True)


def block_count(f: GGUFFile) -> int:
    """`{arch}.block_count`, bounded by the tensors the file holds (each layer has several) before any per-layer
    list is built from it."""
    n = int(f.arch_require("block_count"))
    if n > (limit := min(len(f.tensors), MAX_LAYERS)):
        raise GGUFFormatError(f"{f.path.name}: {f.arch}.block_count is {n}: at most {limit} for this file's tensors")
    return n


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
        n_layers=block_count(f),
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
        raise UnsupportedModelError(f"{f.path.name}: rope scaling {quote(str(kind))} is not supported for {f.arch}")
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
        raise UnsupportedModelError(f"{f.path.name}: rope scaling {quote(str(kind))} is not supported for {f.arch}")
    n_ctx_orig = int(f.arch_get("rope.scaling.original_context_length", 0) or f.arch_get("context_length", 4096))
    factor = 1.0 / scale
    attn = (0.1 * math.log(factor) + 1.0) if factor > 1.0 else 1.0
    attn /= 1.0 + 0.1 * math.log(factor)
    attn *= float(f.arch_get("rope.scaling.attn_factor", 1.0))
    return scale, YarnSpec(n_ctx_orig=n_ctx_orig, ext_factor=1.0, attn_factor=attn)
