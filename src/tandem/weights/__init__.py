"""Weights where the placement plan puts them: the loader (GGUF tensors to GPU, pinned host RAM or ggml
buffers), the host-op and streaming machinery of offloaded experts, repacked CPU experts. Between the layers
(whose objects it builds) and the models (which ask it for their weights)."""
