"""tandem's logits against llama.cpp's on the same GGUF file, the comparison shared by the llama.cpp fixture
tests (tiny qwen35moe/qwen3next, gpt-oss and Gemma 4).

A fixture's prompts are dicts with the token `ids`, `logits_b64` (llama.cpp's logits for every position of
the prompt run as one batch, base64 float32 [T, V'], V' = all ids or the recorded `columns`) and optionally
`decode_b64` (the last `decode_steps` positions again, each decoded as one token after the rest [steps, V']).
"""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tandem

MAX_ABS_DIFF = 2e-5  # the bound of the transformers comparisons (f32 weights and cache)


def _recorded(b64: str, n_rows: int) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype=np.float32).reshape(n_rows, -1)


def assert_logits_match_llama_cpp(
    gguf_path: Path,
    prompts: list[dict[str, Any]],
    gguf_sha256: str,
    *,
    label: str,
    script: str,
    columns: list[int] | None = None,
    decode_steps: int = 0,
    cache_type: str = "f32",
) -> None:
    """Every prompt's prefill logits (and, with decode_steps, its last tokens decoded one at a time) within
    MAX_ABS_DIFF of llama.cpp's, on the stored columns (all ids without columns). Prints each prompt's
    maximum differences; fails at once when the GGUF is not the one the fixture was recorded from."""
    if hashlib.sha256(gguf_path.read_bytes()).hexdigest() != gguf_sha256:
        pytest.fail(f"the tiny {label} no longer converts to the recorded GGUF: re-run {script}")
    cols: list[int] | slice = slice(None) if columns is None else columns
    failures = []
    with tandem.LLM(gguf_path, cache_type=cache_type, threads=2) as llm:
        for prompt in prompts:
            ids = prompt["ids"]
            full = llm.logits(ids)[:, cols]
            diffs = {"prefill": float(np.abs(full - _recorded(prompt["logits_b64"], len(ids))).max())}
            if decode_steps:
                head = len(ids) - decode_steps
                llm.engine.reset()
                llm.engine.feed(ids[:head])
                steps = np.stack([llm.engine.append([t]).numpy()[cols] for t in ids[head:]])
                diffs["decode"] = float(np.abs(steps - _recorded(prompt["decode_b64"], decode_steps)).max())
            line = f"{label} vs llama.cpp T={len(ids)}: " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items())
            print(line)
            if max(diffs.values()) >= MAX_ABS_DIFF:
                failures.append(line)
    # After every prompt, so that a failure shows all their differences.
    assert not failures, f"max |diff| >= {MAX_ABS_DIFF}: " + "; ".join(failures)
