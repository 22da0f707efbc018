"""Per-architecture conversion hooks, for the families whose checkpoints need more than a name map.

An `ArchHooks` subclass (one module per family, e.g. `convert.gpt_oss`) may take over tensors that are
fused or laid out differently, generate tensors that the checkpoint does not store, write the family's
metadata and read its vocabulary. `hf_to_gguf` calls these hooks; this module depends on nothing there,
so the family modules can be imported by it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import gguf
import numpy as np

from tandem.convert.vocab import Vocab


class AddTensor(Protocol):
    """Plan one output tensor: GGUF name, shape (elements, PyTorch order) and the loader of its float32
    data; with `raw_qtype`, the loader gives that type's finished bytes instead (written unchanged)."""

    def __call__(self, name: str, shape: tuple[int, ...], load: Callable[[], np.ndarray],
                 raw_qtype: gguf.GGMLQuantizationType | None = None) -> None: ...  # fmt: skip


@dataclass
class PlanContext:
    """What a tensor hook may use while the converter plans the output tensors."""

    cfg: dict[str, Any]
    load: Callable[[Any], np.ndarray]  # a safetensors tensor -> float32 array
    name_of: Callable[[str], str]  # HF tensor name -> GGUF tensor name (raises when unmapped)
    add: AddTensor
    tensors: dict[str, Any] = field(default_factory=dict)  # every safetensors tensor of the checkpoint, by name
    load_raw: Callable[[Any], np.ndarray] | None = None  # a safetensors tensor as stored (e.g. uint8 blocks)


class ArchHooks:
    """Default: no special tensors, no extra metadata, the converter's own vocabulary handling."""

    def tensor(self, hf_name: str, t: Any, ctx: PlanContext) -> bool:
        """Plan the HF tensor `hf_name` (shape `t.shape`, data `ctx.load(t)`) itself; True when handled."""
        return False

    def extra_tensors(self, ctx: PlanContext) -> None:
        """Plan tensors that the checkpoint does not store."""

    def write_hparams(self, w: gguf.GGUFWriter, cfg: dict[str, Any], ftype: gguf.LlamaFileType) -> None:
        """Write the `{arch}.*` hyper-parameters (replaces the converter's generic ones)."""
        raise NotImplementedError

    def load_vocab(self, cfg: dict[str, Any], hf_dir: Path) -> Vocab | None:
        """The vocabulary, or None for the converter's default for the arch's `vocab_kind`."""
        return None

    def after_vocab(self, w: gguf.GGUFWriter, vocab: Vocab) -> None:
        """Tokenizer keys written after the vocabulary (e.g. add_space_prefix)."""


def write_attention_common(w: gguf.GGUFWriter, cfg: dict[str, Any], head_dim: int) -> None:
    """Keys every attention model writes the same way: depth, widths, heads, norms, context."""
    w.add_block_count(int(cfg["num_hidden_layers"]))
    if "max_position_embeddings" in cfg:
        w.add_context_length(int(cfg["max_position_embeddings"]))
    w.add_embedding_length(int(cfg["hidden_size"]))
    w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_head_count(int(cfg["num_attention_heads"]))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))


def layer_is_swa(cfg: dict[str, Any], default_period: int) -> list[bool]:
    """Per layer: sliding-window attention? From `layer_types`, else every `default_period`-th layer is full."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        return [bool((i + 1) % default_period) for i in range(n)]
    return [t == "sliding_attention" for t in types]
