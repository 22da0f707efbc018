"""Architecture lookup by GGUF `general.architecture`, with a small alias table.

Adding a family is adding a file with `read_config` (and, for unusual layers, `build_block`) and
one line here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tandem.errors import UnsupportedModelError
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
    """The ModelConfig of a GGUF file (metadata that cannot make one: a one-line error)."""
    spec = architecture(f)
    with metadata_errors(f.path, f.arch):
        return spec.read_config(f)
