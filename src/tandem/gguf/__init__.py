"""GGUF files: metadata and memory-mapped, zero-copy tensor data."""

from tandem.gguf.reader import GGUFFile, TensorInfo, open_gguf

__all__ = ["GGUFFile", "TensorInfo", "open_gguf"]
