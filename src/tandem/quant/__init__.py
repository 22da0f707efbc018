"""GGUF quant formats: dequantization (torch) and products on quantized blocks (ggml CPU kernels)."""
