"""tandem: Mixture-of-Experts inference from GGUF files, experts in host RAM, the rest on the GPU."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tandem.errors import (
    ChatTemplateError,
    ConversionError,
    GGUFFormatError,
    PlacementError,
    TandemError,
    UnsupportedModelError,
)

if TYPE_CHECKING:
    from tandem.api import LLM

__all__ = [
    "LLM",
    "ChatTemplateError",
    "ConversionError",
    "GGUFFormatError",
    "PlacementError",
    "TandemError",
    "UnsupportedModelError",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # LLM imports torch (over a second): on first use, so that the CLI, which every `tandem` command imports through
    # this package, parses its flags and catches Ctrl-C (cli/main.py) before torch loads.
    if name == "LLM":
        from tandem.api import LLM

        return LLM
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
