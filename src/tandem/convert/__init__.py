"""Hugging Face checkpoint -> GGUF conversion (Qwen3, Qwen3-MoE, Gemma 3), llama.cpp-compatible output."""

from tandem.convert.hf_to_gguf import ARCHITECTURES, OUTTYPES, convert_hf

__all__ = ["ARCHITECTURES", "OUTTYPES", "convert_hf"]
