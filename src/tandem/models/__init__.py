"""Architectures, one file each, found by the GGUF `general.architecture` key."""

from tandem.models.registry import SUPPORTED_ARCHITECTURES, Architecture, architecture, read_config

__all__ = ["SUPPORTED_ARCHITECTURES", "Architecture", "architecture", "read_config"]
