"""GGUF files: metadata and memory-mapped, zero-copy tensor data."""

from tandem.gguf.reader import GGUFFile, TensorInfo, metadata_errors, open_gguf

__all__ = ["GGUFFile", "TensorInfo", "metadata_errors", "open_gguf"]
