"""The online re-placement policy (`weights/expert_cache.py`) on a stream of picks whose hot set moves, replayed
without a model through `bench/refresh_replay.py`'s caches: after each change it comes to hold as many picks as a
cache fitted to the new hot set, where a cache fixed for the first one falls behind."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.refresh_replay import fixed_hits, hottest, online_hits  # noqa: E402 - the repository root first

LAYERS, EXPERTS, ACTIVE, CACHED, PHASE = 3, 64, 4, 12, 256


def drifting_picks(seed: int) -> np.ndarray:
    """Picks [T, L, E]: each step, per layer, ACTIVE distinct experts drawn by a Zipf law (exponent 1) over an
    order of the experts that is drawn anew for every phase of PHASE steps."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, EXPERTS + 1)
    weights /= weights.sum()
    steps = np.zeros((3 * PHASE, LAYERS, EXPERTS), dtype=np.int64)
    for phase in range(3):
        orders = [rng.permutation(EXPERTS) for _ in range(LAYERS)]
        for t in range(phase * PHASE, (phase + 1) * PHASE):
            for layer, order in enumerate(orders):
                steps[t, layer, order[rng.choice(EXPERTS, ACTIVE, replace=False, p=weights)]] = 1
    return steps


def test_online_follows_the_hot_set_as_a_fitted_cache_would() -> None:
    steps = drifting_picks(seed=0)
    start = hottest(steps[:PHASE].sum(axis=0), CACHED)  # fitted to phase 0
    fixed = fixed_hits(steps, start)
    online, swaps = online_hits(steps, start, every=16)
    assert swaps > 0
    settle = 96  # steps after a change that the refresh may take (six windows of 16)
    for phase in (1, 2):
        now = slice(phase * PHASE + settle, (phase + 1) * PHASE)
        fitted = fixed_hits(steps[now], hottest(steps[now].sum(axis=0), CACHED)).mean()  # in-sample: an upper mark
        assert online[now].mean() >= 0.85 * fitted, (phase, online[now].mean(), fitted)
        assert online[now].mean() >= fixed[now].mean() + 0.2, (phase, online[now].mean(), fixed[now].mean())
    # in the first phase the start is fitted to it (in-sample): online's swaps among near-equal experts of the law's
    # tail cost little of what it holds
    assert online[:PHASE].mean() >= 0.93 * fixed[:PHASE].mean(), (online[:PHASE].mean(), fixed[:PHASE].mean())
