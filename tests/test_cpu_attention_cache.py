"""The CPU decode step's attention reads the values transposed that the f16 cache keeps (LayerKV.attention_rows)
instead of transposing the whole cache at every step: the same values bit for bit as those transposed per step,
after overwrites (a shorter sequence continued), across the doubling of the transposed values, and with ggml's
threads; a padded read past the pool's last row stays in its buffer."""

from __future__ import annotations

import torch

from tandem.layers.attention import AttentionShape, _attend_ggml_nodes
from tandem.state.kv_cache import KVPool, LayerKV

SHAPE = AttentionShape(n_heads=4, n_kv_heads=2, head_dim=64, value_dim=64, scale=0.125, sliding_window=None)


def _step(cache: LayerKV, position: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Store position's k/v, then one query row's attention twice: from the kept transposed values and from values
    transposed for this step alone."""
    k, v = torch.randn(1, 2, 64, generator=g), torch.randn(1, 2, 64, generator=g)
    keys, values, first = cache.store(position, k, v)
    q = torch.randn(1, 4, 64, generator=g)
    allowed = (torch.arange(keys.shape[0]).unsqueeze(0) <= position - first).numpy()  # [1, N]
    kept = _attend_ggml_nodes(q, cache, allowed, SHAPE)
    fresh = _attend_ggml_nodes(q, LayerKV(k=keys.clone(), v=values.clone()), allowed, SHAPE)  # anew
    return kept, fresh


def test_kept_transposed_values_give_the_per_step_values() -> None:
    g = torch.Generator().manual_seed(0)
    cache = KVPool.allocate(1, 2048, 2, 64, 64, torch.float16, "cpu").slot(0)
    for position in [*range(0, 70), *range(40, 140), *range(1000, 1100)]:  # 40..: an overwrite; 1000..: a jump
        if position == 1000:  # positions 140..999 written without a decode step reading them (prefill)
            cache.store(140, torch.randn(860, 2, 64, generator=g), torch.randn(860, 2, 64, generator=g))
        kept, fresh = _step(cache, position, g)
        assert torch.equal(kept, fresh), position
    assert cache._vt is not None and cache._vt.shape[-1] >= 1088  # grown past its first size


def test_a_padded_read_of_the_last_rows_stays_in_the_pool() -> None:
    """A context that is no multiple of KV_PAD: the padded keys of the last slot read the pool's tail (zeros), not
    memory past it, and equal the rows of a buffer padded with zeros."""
    pool = KVPool.allocate(2, 100, 2, 64, 64, torch.float16, "cpu")
    g = torch.Generator().manual_seed(2)
    for slot in (0, 1):
        cache = pool.slot(slot)
        cache.store(0, torch.randn(100, 2, 64, generator=g), torch.randn(100, 2, 64, generator=g))
        keys, vt = cache.attention_rows(100, 128)
        assert keys.shape == (128, 2, 64) and vt.shape == (2, 64, 128)
        assert keys.data_ptr() == cache.k.data_ptr()  # read where they lie, not copied
        assert torch.equal(keys[:100], cache.k) and torch.equal(vt[..., :100], cache.v.permute(1, 2, 0))
    assert not keys[100:].any()  # the last slot's padding: the tail


def test_attention_threads_leave_the_values() -> None:
    """From ATTENTION_THREADED_FROM positions ggml's attention runs on torch's threads: each output is one
    thread's sum, so 1 and 2 threads agree bit for bit."""
    from tandem.quant.ggml_ops import ggml_attention

    g = torch.Generator().manual_seed(1)
    n = 1536
    q = torch.randn(4, 1, 64, generator=g).numpy()
    k = torch.randn(n, 2, 64, generator=g).half().numpy()
    vt = torch.randn(2, 64, n, generator=g).half().numpy()
    mask = torch.zeros(1, n).numpy()
    mask[:, 1500:] = float("-inf")
    one, two = (ggml_attention(q, k, vt, mask, 0.125, threads) for threads in (1, 2))
    assert (one == two).all()
