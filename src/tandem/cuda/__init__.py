"""CUDA execution: quantized weights kept as GGUF blocks in VRAM, Triton kernels, the hybrid runner."""
