"""Every architecture against `transformers` on tiny random models converted to f32 GGUF.

One shared runner: full-sequence logits on several prompts (some longer than Gemma's sliding
window), and the cached (incremental) path against the full one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import tandem

ARCH_FIXTURES = [
    "tiny_qwen3_gguf",
    "tiny_qwen3moe_gguf",
    "tiny_gemma3_gguf",
    "tiny_qwen35moe_gguf",
    "tiny_qwen3next_gguf",
    "tiny_gpt_oss_gguf",
    "tiny_gemma4_gguf",
]
# the tiny Gemma's sliding window (16) is shorter than the longer ones; 80 spans two delta-net chunks (64)
PROMPT_LENGTHS = [1, 7, 23, 48, 80]
# f32 weights, f32 cache: what remains is summation order (ggml vs. torch): measured <= 3e-6.
MAX_ABS_DIFF = 2e-5


def _hf_logits(hf_dir: Path, ids: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


@pytest.fixture(scope="module", params=ARCH_FIXTURES)
def arch_model(request: pytest.FixtureRequest) -> tuple[Path, Path]:
    return request.getfixturevalue(request.param)


def _prompts(n_vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(4, n_vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def test_logits_match_transformers(arch_model: tuple[Path, Path]) -> None:
    hf_dir, gguf_path = arch_model
    with tandem.LLM(gguf_path, cache_type="f32", threads=2) as llm:
        for ids in _prompts(llm.config.n_vocab):
            ours = llm.logits(ids)
            ref = _hf_logits(hf_dir, ids)
            assert ours.shape == ref.shape
            diff = float(np.abs(ours - ref).max())
            print(f"{llm.config.arch} T={len(ids)} max|diff|={diff:.2e}")
            assert diff < MAX_ABS_DIFF, f"{llm.config.arch}, {len(ids)} tokens: max |diff| {diff}"
            assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_cached_decode_matches_full_sequence(arch_model: tuple[Path, Path]) -> None:
    _, gguf_path = arch_model
    with tandem.LLM(gguf_path, cache_type="f32", threads=2, n_batch=5) as llm:
        ids = _prompts(llm.config.n_vocab)[-1]
        full = llm.logits(ids)
        llm.engine.reset()
        llm.engine.feed(ids[:30])  # prefill in batches of 5
        steps = [llm.engine.append([t]).numpy() for t in ids[30:]]
        np.testing.assert_allclose(np.stack(steps), full[30:], atol=1e-4, rtol=0)


def test_greedy_generation_matches_transformers(arch_model: tuple[Path, Path]) -> None:
    from transformers import AutoModelForCausalLM

    hf_dir, gguf_path = arch_model
    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32, attn_implementation="eager")
    with tandem.LLM(gguf_path, cache_type="f32", threads=2) as llm:
        prompt = _prompts(llm.config.n_vocab)[1]
        ours = llm.generate_ids(prompt, max_tokens=20, temperature=0)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=len(ours), do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert ours == out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("fixture", ["tiny_gemma3_gguf", "tiny_gemma4_gguf", "tiny_gpt_oss_gguf"])
def test_sliding_window_rings_match_full_caches(
    fixture: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sliding-window layers keep a ring of window + n_batch - 1 rows on a GPU (layers/attention.py); here on
    the CPU, f32: prefill in batches that wrap the ring, decode past it, and going back to a shorter prefix
    (held, or recomputed from the start when the ring overwrote it) give the logits of full caches."""
    from tandem.layers import attention

    _, gguf_path = request.getfixturevalue(fixture)
    ids = _prompts(512)[-1]  # 80 tokens: several windows (16, 8)
    with tandem.LLM(gguf_path, cache_type="f32", threads=2, n_batch=5) as llm:
        full = llm.logits(ids)
        windows = {b.mixer.shape.sliding_window for b in llm.model.blocks} - {None}
    monkeypatch.setattr(attention, "RING_DEVICE_TYPES", ("cuda", "cpu"))
    with tandem.LLM(gguf_path, cache_type="f32", threads=2, n_batch=5) as llm:
        rows = {kv.rows for kv in llm.engine.cache.layers if kv.window is not None}
        assert rows == {w + 4 for w in windows}, rows  # a ring on every sliding layer
        np.testing.assert_allclose(llm.logits(ids), full, atol=1e-5, rtol=0)
        engine = llm.engine
        engine.reset()
        engine.feed(ids[:30])
        steps = [engine.append([t]).numpy() for t in ids[30:60]]
        np.testing.assert_allclose(np.stack(steps), full[30:60], atol=1e-5, rtol=0)
        for keep in (57, 12):  # 57: still in every ring; 12: overwritten, recomputed from the start
            last = engine.feed(ids[: keep + 1]).numpy()
            assert engine.cache.length == keep + 1
            np.testing.assert_allclose(last, full[keep], atol=1e-5, rtol=0)


def test_causal_attention_from_an_empty_cache_needs_no_mask() -> None:
    """The GPU's prefill from an empty cache without a window (layers/attention.py `attend`) asks SDPA for causal
    attention instead of passing a mask: the same as the mask it replaces (the queries are the keys' positions
    0..T-1), with grouped KV heads and a value size of its own. torch's SDPA on the CPU, the logic only."""
    from tandem.layers.attention import AttentionShape, _sdpa

    torch.manual_seed(0)
    t, h, g, d, dv = 9, 4, 2, 16, 8
    s = AttentionShape(n_heads=h, n_kv_heads=g, head_dim=d, value_dim=dv, scale=d**-0.5, sliding_window=None)
    q, k, v = torch.randn(t, h, d), torch.randn(t, g, d), torch.randn(t, g, dv)
    positions = torch.arange(t)
    allowed = positions.unsqueeze(1) >= positions.unsqueeze(0)
    causal = _sdpa(q, k, v, None, s, h // g)
    assert causal.shape == (t, h, dv)
    torch.testing.assert_close(causal, _sdpa(q, k, v, allowed, s, h // g), rtol=0, atol=1e-6)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("h, g", [(8, 2), (6, 3), (4, 4)])
def test_masked_attention_with_grouped_heads_folds_them_into_rows(h: int, g: int, window: int | None) -> None:
    """A masked chunk's attention on a GPU with grouped KV heads (layers/attention.py `_sdpa`) runs the query heads
    of each KV head as one head's rows: the attention of every head over its KV head's keys, as the float32
    reference computes it head by head (a later chunk: its queries at positions 7.., windowed or not). torch's SDPA
    on the CPU, the layout only."""
    from tandem.layers.attention import AttentionShape, _allowed, _sdpa

    torch.manual_seed(1)
    t, n_keys, d, dv = 6, 13, 16, 8
    s = AttentionShape(n_heads=h, n_kv_heads=g, head_dim=d, value_dim=dv, scale=d**-0.5, sliding_window=window)
    q, k, v = torch.randn(t, h, d), torch.randn(n_keys, g, d), torch.randn(n_keys, g, dv)
    allowed = _allowed(torch.arange(7, 7 + t), torch.arange(n_keys), window)
    out = _sdpa(q, k, v, allowed, s, h // g)
    assert out.shape == (t, h, dv)
    for head in range(h):
        kv = head // (h // g)
        scores = (q[:, head] @ k[:, kv].T * s.scale).masked_fill(~allowed, float("-inf"))
        torch.testing.assert_close(out[:, head], torch.softmax(scores, -1) @ v[:, kv], rtol=0, atol=1e-5)
