"""Pooled prompt chunks (state/batch.py `StepBatch.chunk`: one sequence's chunk addressed by device tensors, as a
GPU captures it; layers/attention.py `attend_chunk`, layers/delta_net.py `GatedDeltaNet._pooled_chunk`), run on
the CPU with Triton's interpreter for the cache writes: the attention of a chunk over a full buffer and a
wrapped sliding-window ring (sinks, softcap) equals each sequence's own attention; every family's model, f32,
gives the logits and the states of its eager steps, chunk after chunk, in a slot other than 0."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # on a GPU machine (pytest -m gpu collects this module too) the kernels compile
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

import pytest

triton = pytest.importorskip("triton", reason="triton is a dev dependency (pip install -e '.[dev]')")
if os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available():
    pytest.skip("the interpreter run is for machines without a GPU", allow_module_level=True)

import tandem  # noqa: E402 (after the skips above)
from tandem.layers.attention import AttentionShape, attend, attend_chunk  # noqa: E402
from tandem.layers.delta_net import DeltaNetPool  # noqa: E402
from tandem.state.batch import StepBatch  # noqa: E402
from tandem.state.kv_cache import KVPool  # noqa: E402

N_BATCH = 16
CPU = torch.device("cpu")


@pytest.mark.parametrize("n_ctx", [64, 128], ids=["n_ctx64", "n_ctx128"])
@pytest.mark.parametrize(
    "window, softcap, sinks", [(None, None, False), (12, None, True), (12, 3.0, False)], ids=["full", "ring", "cap"]
)
def test_chunk_attention_matches_the_sequence_alone(
    window: int | None, softcap: float | None, sinks: bool, n_ctx: int
) -> None:
    g = torch.Generator().manual_seed(5)
    h, kv, d = 4, 2, 16
    shape = AttentionShape(h, kv, d, d, d**-0.5, window, softcap)
    sink = torch.randn(h, generator=g) if sinks else None
    ring = window is not None and n_ctx == 64  # a ring of 12 + 16 - 1 rows where n_ctx is larger: both pools
    pool = KVPool.allocate(3, n_ctx, kv, d, d, torch.float32, "cpu", window if ring else None, N_BATCH)
    start = 21  # slot 1 holds 21 positions (stored in steps of at most n_batch), the chunk continues off a multiple
    for s0 in range(0, start, N_BATCH):
        m = min(N_BATCH, start - s0)
        pool.slot(1).store(s0, torch.randn(m, kv, d, generator=g), torch.randn(m, kv, d, generator=g))
    pool.k[0].normal_(generator=g)  # the other slots' rows must not be read
    pool.v[2].normal_(generator=g)
    reference = KVPool(pool.k.clone(), pool.v.clone(), pool.window, [])
    reference.slots = [type(s)(k=reference.k[i], v=reference.v[i], window=s.window) for i, s in enumerate(pool.slots)]
    batch = StepBatch.chunk(1, start, [0] * N_BATCH, CPU)
    assert batch.key_rows == 64  # positions up to 36: the next power of two
    q, k, v = (torch.randn(N_BATCH, n, d, generator=g) for n in (h, kv, kv))
    keys, values, first = reference.slot(1).store(start, k, v)
    expected = attend(q, keys, values, batch.positions, shape, sink, first, reference.slot(1))
    assert batch.slots is not None
    out = attend_chunk(shape, q, k, v, batch.positions, batch.slots, batch.key_rows, pool, sink)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool.k, reference.k) and torch.equal(pool.v, reference.v)


FAMILIES = [
    "tiny_gemma3_gguf",
    "tiny_qwen3moe_gguf",
    "tiny_qwen35moe_gguf",
    "tiny_qwen3next_gguf",
    "tiny_gpt_oss_gguf",
    "tiny_gemma4_gguf",
]


@pytest.mark.parametrize("fixture", FAMILIES)
def test_model_chunks_match_eager_steps(fixture: str, request: pytest.FixtureRequest) -> None:
    """Chunks of 16 (from an empty slot, then continuing at 16 and at 32: past the tiny models' windows and into a
    second delta-net chunk of 64 positions) through `StepBatch.chunk` and through the eager batch descriptor."""
    path = request.getfixturevalue(fixture)[1]
    prompt = torch.randint(4, 500, (3 * N_BATCH,), generator=torch.Generator().manual_seed(8)).tolist()
    with tandem.LLM(path, device="cpu", cache_type="f32", n_ctx=128, n_batch=N_BATCH) as llm:
        model = llm.model
        eager, pooled = (model.new_pool(2, 128, torch.float32, N_BATCH) for _ in range(2))
        for start in range(0, len(prompt), N_BATCH):
            chunk = prompt[start : start + N_BATCH]
            want = model.forward(StepBatch.build([(1, start, chunk)], CPU), eager)
            got = model.forward(StepBatch.chunk(1, start, chunk, CPU), pooled)
            for pool in (eager, pooled):
                pool.caches[1].advance(chunk)
            scale = max(want.abs().max().item(), 1.0)
            assert (got - want).abs().max().item() <= 1e-5 * scale, f"{fixture}: chunk at {start}"
        for layer_eager, layer_pooled in zip(eager.layers, pooled.layers, strict=True):
            if isinstance(layer_eager, DeltaNetPool):
                pairs = [(layer_eager.conv, layer_pooled.conv), (layer_eager.ssm, layer_pooled.ssm)]
            else:
                pairs = [(layer_eager.k, layer_pooled.k), (layer_eager.v, layer_pooled.v)]
            for a, b in pairs:
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
