"""Architectures, one file each, found by the GGUF `general.architecture` key."""

from tandem.models.registry import SUPPORTED_ARCHITECTURES, read_config

__all__ = ["SUPPORTED_ARCHITECTURES", "read_config"]
