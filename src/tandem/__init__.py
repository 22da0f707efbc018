"""tandem: Mixture-of-Experts inference from GGUF files, experts in host RAM, the rest on the GPU."""

from tandem.api import LLM
from tandem.errors import (
    ChatTemplateError,
    ConversionError,
    GGUFFormatError,
    PlacementError,
    TandemError,
    UnsupportedModelError,
)

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
