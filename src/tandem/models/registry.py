"""Architecture lookup by GGUF `general.architecture`, with a small alias table.

Adding a family is adding a file with `read_config` (and, for unusual layers, `build_block`) and
one line here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from tandem.errors import GGUFFormatError, UnsupportedModelError
from tandem.gguf import GGUFFile, metadata_errors
from tandem.models import gemma3, gemma4, gpt_oss, qwen3, qwen3moe, qwen35moe
from tandem.models.blocks import BlockBuilder, standard_block
from tandem.models.config import ModelConfig


@dataclass(frozen=True)
class Architecture:
    read_config: Callable[[GGUFFile], ModelConfig]
    build_block: BlockBuilder = standard_block


_ARCHITECTURES: dict[str, Architecture] = {
    "qwen3": Architecture(qwen3.read_config),
    "qwen3moe": Architecture(qwen3moe.read_config),
    "gemma3": Architecture(gemma3.read_config),
    "gpt-oss": Architecture(gpt_oss.read_config, gpt_oss.build_block),
    "gemma4": Architecture(gemma4.read_config, gemma4.build_block),
    "qwen35moe": Architecture(qwen35moe.read_config, qwen35moe.build_block),
    "qwen3next": Architecture(qwen35moe.read_config, qwen35moe.build_block),  # same file, small differences
}
_ALIASES: dict[str, str] = {}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_ARCHITECTURES))


def architecture(f: GGUFFile) -> Architecture:
    """The Architecture of a GGUF file, or a one-line UnsupportedModelError."""
    spec = _ARCHITECTURES.get(_ALIASES.get(f.arch, f.arch))
    if spec is None:
        raise UnsupportedModelError(
            f"{f.path.name}: architecture '{f.arch}' is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return spec


def read_config(f: GGUFFile) -> ModelConfig:
    """The ModelConfig of a GGUF file, checked against its tensors' shapes (metadata that cannot make one, or
    tensors that do not fit it: a one-line error)."""
    spec = architecture(f)
    with metadata_errors(f.path, f.arch):
        cfg = spec.read_config(f)
    check_tensor_shapes(f, cfg)
    return cfg


# Per-layer tensors tied to the residual stream in every architecture: the norms of it (axis 0 is hidden), the
# matrices that read it (its last axis) and those that write to it (axis 0, or 1 for a stack of experts).
_HIDDEN_AXES: dict[str, int] = {
    **dict.fromkeys(("attn_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm"), 0),
    **dict.fromkeys(("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up", "ffn_gate_inp"), -1),
    **dict.fromkeys(("ffn_gate_exps", "ffn_up_exps", "ffn_gate_up_exps"), -1),
    "attn_output": 0,
    "ffn_down": 0,
    "ffn_down_exps": 1,
}


def _expected_sizes(name: str, cfg: ModelConfig) -> list[tuple[int, tuple[int, ...], str]]:
    """(axis, sizes allowed, what they are) for the axes of `name` that the metadata fixes."""
    if name in ("token_embd.weight", "output.weight"):
        return [(0, (cfg.n_vocab,), "vocabulary"), (1, (cfg.hidden,), "width")]
    if name == "output_norm.weight":
        return [(0, (cfg.hidden,), "width")]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
    if m is None or m.group(2) not in _HIDDEN_AXES or int(m.group(1)) >= cfg.n_layers:
        return []
    sizes = [(_HIDDEN_AXES[m.group(2)], (cfg.hidden,), "width")]
    layer = cfg.layers[int(m.group(1))]
    head_dim = layer.head_dim or cfg.head_dim
    if m.group(2) == "attn_k":
        sizes.append((0, ((layer.n_kv_heads or cfg.n_kv_heads) * head_dim,), "KV heads x head size"))
    if m.group(2) == "attn_q":  # twice as many rows where the query carries its output gate (Qwen3.5/3.6)
        sizes.append((0, (cfg.n_heads * head_dim, 2 * cfg.n_heads * head_dim), "heads x head size"))
    if cfg.moe is not None and m.group(2).endswith("_exps"):
        f = cfg.moe.expert_ffn_dim
        sizes.append((0, (cfg.moe.n_experts,), "expert count"))
        if m.group(2) == "ffn_down_exps":
            sizes.append((2, (f,), "expert FFN size"))
        else:  # gate and up stacked in one tensor: twice the rows
            sizes.append((1, (2 * f if "gate_up" in m.group(2) else f,), "expert FFN size"))
    return sizes


def check_tensor_shapes(f: GGUFFile, cfg: ModelConfig) -> None:
    """The sizes every architecture ties to its metadata, as llama.cpp checks them at load: the vocabulary and
    the residual stream's width in the embedding, the output head and each layer's norms and projections, and
    the attention's heads. A tensor that disagrees is a one-line error, not a failure deep in a forward pass."""
    for name, info in f.tensors.items():
        for axis, allowed, what in _expected_sizes(name, cfg):
            if len(info.shape) < (axis + 1 if axis >= 0 else -axis) or info.shape[axis] not in allowed:
                raise GGUFFormatError(
                    f"{f.path.name}: tensor '{name}' has shape {info.shape}; the metadata's {what} is "
                    f"{' or '.join(map(str, allowed))} (axis {axis})"
                )
