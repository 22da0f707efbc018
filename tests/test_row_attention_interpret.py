"""Row-by-row attention of a step's short spans (layers/attention.py `_row_spans`, `_attend_rows`: on a GPU, one-token
sequences and short prompt chunks attend together as a pooled decode step's rows do), run on the CPU by Triton's
interpreter: which spans go by rows, and for a step of a one-token sequence, a chunk continuing its sequence and a
chunk from an empty cache, full buffers and sliding-window rings (sinks, softcap), the cache rows and attention
outputs of each sequence attended alone (`LayerKV.store` + `attend`)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # on a GPU machine (pytest -m gpu collects this module too) the kernels compile
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

from types import SimpleNamespace

import pytest

triton = pytest.importorskip("triton", reason="triton is a dev dependency (pip install -e '.[dev]')")
if os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available():
    pytest.skip("the interpreter run is for machines without a GPU", allow_module_level=True)

from tandem.layers.attention import (  # noqa: E402 (after the skips above)
    ROW_ATTENTION_PAIRS,
    AttentionShape,
    _attend_rows,
    _row_spans,
    attend,
)
from tandem.state.batch import StepBatch  # noqa: E402
from tandem.state.kv_cache import KVPool  # noqa: E402

N_BATCH = 16


def test_which_spans_go_by_rows() -> None:
    big = int(ROW_ATTENTION_PAIRS**0.5) + 1  # a chunk from an empty cache just past the bound
    pieces = [(0, 40, [1]), (1, 0, [2] * 9), (2, 0, [3] * big), (3, 1000, [4] * 70)]
    batch = StepBatch.build(pieces, torch.device("cpu"))
    rows = _row_spans(batch)
    assert rows is not None and not rows.every_row
    assert rows.offsets == {0, 1}  # the one-token sequence and the short chunk
    assert rows.rows.tolist() == list(range(10)) and rows.slots.tolist() == [0] + [1] * 9
    assert _row_spans(batch) is rows  # made once per step
    alone = StepBatch.build([(0, 0, [5] * big)], torch.device("cpu"))
    assert _row_spans(alone) is None
    short = StepBatch.build([(0, 3, [1, 2]), (1, 7, [3])], torch.device("cpu"))
    every = _row_spans(short)
    assert every is not None and every.every_row


@pytest.mark.parametrize(
    "window, softcap, sinks", [(None, None, False), (12, None, True), (12, 3.0, False)], ids=["full", "ring", "cap"]
)
def test_rows_match_each_sequence_alone(window: int | None, softcap: float | None, sinks: bool) -> None:
    g = torch.Generator().manual_seed(3)
    h, kv, d, n_ctx = 4, 2, 16, 64
    shape = AttentionShape(h, kv, d, d, d**-0.5, window, softcap)
    layer = SimpleNamespace(shape=shape)
    sink = torch.randn(h, generator=g) if sinks else None
    # slot 0 decodes at 40, slot 1 continues at 12 by 7, slot 2 starts a prompt of 9 (a ring of 12 + 16 - 1 rows
    # holds positions 13..40 of slot 0 after this step: the ring has wrapped)
    history = {0: 40, 1: 12, 2: 0}
    pieces = [(0, 40, [0]), (1, 12, [0] * 7), (2, 0, [0] * 9)]
    pool = KVPool.allocate(3, n_ctx, kv, d, d, torch.float32, "cpu", window, N_BATCH)
    for slot, n in history.items():
        for start in range(0, n, N_BATCH):  # a ring takes at most n_batch rows a step
            m = min(N_BATCH, n - start)
            pool.slot(slot).store(start, torch.randn(m, kv, d, generator=g), torch.randn(m, kv, d, generator=g))
    reference = KVPool(pool.k.clone(), pool.v.clone(), pool.window, [])
    reference.slots = [type(s)(k=reference.k[i], v=reference.v[i], window=s.window) for i, s in enumerate(pool.slots)]
    batch = StepBatch.build(pieces, torch.device("cpu"))
    t = batch.n_tokens
    q, k, v = (torch.randn(t, n, d, generator=g) for n in (h, kv, kv))
    expected = []
    for span in batch.spans:
        rows, cache = span.rows, reference.slot(span.slot)
        keys, values, first = cache.store(span.start, k[rows], v[rows])
        expected.append(attend(q[rows], keys, values, batch.positions[rows], shape, sink, first, cache))
    by_rows = _row_spans(batch)
    assert by_rows is not None and by_rows.every_row
    out = _attend_rows(layer, q, k, v, batch.positions, pool, sink, by_rows.slots)  # type: ignore[arg-type]
    torch.testing.assert_close(out, torch.cat(expected), rtol=1e-5, atol=1e-5)
    assert torch.equal(pool.k, reference.k) and torch.equal(pool.v, reference.v)
