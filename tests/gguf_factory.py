"""Small hand-made GGUF files for error-path tests (no model weights needed)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

QWEN3_KEYS = {
    "embedding_length": 64,
    "block_count": 1,
    "feed_forward_length": 128,
    "attention.head_count": 4,
    "attention.head_count_kv": 2,
    "attention.key_length": 16,
    "attention.value_length": 16,
    "attention.layer_norm_rms_epsilon": 1e-6,
    "context_length": 256,
}


def write_gguf(
    path: Path,
    arch: str = "qwen3",
    drop_keys: tuple[str, ...] = (),
    tensor_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    values: dict[str, object] | None = None,
    extra_tensors: dict[str, tuple[int, ...]] | None = None,
) -> Path:
    """A one-layer-sized GGUF with metadata for `arch` and one 64x64 tensor of `tensor_type`. `values` replaces
    metadata by full key (`qwen3.block_count`, `tokenizer.ggml.tokens`), whatever its type: str, int, float;
    `extra_tensors` adds F32 tensors of those shapes (PyTorch order)."""
    values = values or {}
    w = gguf.GGUFWriter(str(path), arch)
    metadata: dict[str, object] = {f"{arch}.{k}": v for k, v in QWEN3_KEYS.items() if k not in drop_keys}
    metadata["tokenizer.ggml.tokens"] = [f"t{i}" for i in range(64)]  # the rows of token_embd
    w.add_tokenizer_model("gpt2")
    for key, value in {**metadata, **values}.items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, int(value))
    block, size = gguf.GGML_QUANT_SIZES[tensor_type]
    if tensor_type == gguf.GGMLQuantizationType.F32:
        w.add_tensor("token_embd.weight", np.zeros((64, 64), dtype=np.float32))
    else:
        raw = np.zeros((64, 64 // block * size), dtype=np.uint8)
        w.add_tensor("token_embd.weight", raw, raw_dtype=tensor_type)
    for name, shape in (extra_tensors or {}).items():
        w.add_tensor(name, np.zeros(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
