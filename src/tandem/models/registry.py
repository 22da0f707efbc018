"""Architecture lookup by GGUF `general.architecture`, with a small alias table."""

from __future__ import annotations

from collections.abc import Callable

from tandem.errors import UnsupportedModelError
from tandem.gguf import GGUFFile
from tandem.models import gemma3, qwen3, qwen3moe
from tandem.models.config import ModelConfig

_READERS: dict[str, Callable[[GGUFFile], ModelConfig]] = {
    "qwen3": qwen3.read_config,
    "qwen3moe": qwen3moe.read_config,
    "gemma3": gemma3.read_config,
}
_ALIASES: dict[str, str] = {}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_READERS))


def read_config(f: GGUFFile) -> ModelConfig:
    """The ModelConfig of a GGUF file, or a one-line UnsupportedModelError."""
    arch = _ALIASES.get(f.arch, f.arch)
    reader = _READERS.get(arch)
    if reader is None:
        raise UnsupportedModelError(
            f"{f.path.name}: architecture '{f.arch}' is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return reader(f)
