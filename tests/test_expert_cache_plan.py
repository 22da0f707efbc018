"""Per-expert placement under a budget (issue 21): the selection's math, the plan's expert cache (--moe-cache,
--gpu-memory) chosen from routing statistics or by default, never over the budget, and the statistics file's
checks. Dry runs: no GPU, no weights read."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tandem.convert import convert_hf
from tandem.errors import PlacementError, TandemError
from tandem.gguf import open_gguf
from tandem.models import read_config
from tandem.placement import ExpertStats, PlacementRequest, RuntimeShape, expert_layer, plan_placement
from tandem.placement.experts import HOST_LAYER_COST, LayerExperts, estimated_shares, select_experts

E, A = 8, 2  # the tiny Qwen3-MoE's experts per layer and per token


@pytest.fixture(scope="module")
def q8_moe(tiny_qwen3moe_gguf: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-MoE in Q8_0: expert matrices of a type the GPU kernels read, so single experts can be cached."""
    return convert_hf(tiny_qwen3moe_gguf[0], tmp_path_factory.mktemp("q8") / "tiny-q8_0.gguf", "q8_0")


def _plan(path: Path, counts: np.ndarray | None = None, **flags: object):  # type: ignore[no-untyped-def]
    f = open_gguf(path)
    req = PlacementRequest.from_flags(device="cuda", **flags)  # type: ignore[arg-type]
    return f, plan_placement(f, read_config(f), req, RuntimeShape(n_ctx=256), expert_counts=counts,
                             counts_label="test counts")  # fmt: skip


def _layers(n: int, e: int = 16, per: int = 100, splittable: bool = True) -> list[LayerExperts]:
    return [LayerExperts(i, e, e * per, per, splittable) for i in range(n)]


def test_uniform_routing_fills_whole_layers_first() -> None:
    """Without statistics every expert saves the same: whole layers save the host round trip too, later ones
    first (as --gpu-memory always moved layers 0..N-1 off), and the rest of the budget caches single experts."""
    sel = select_experts(_layers(4), 2 * 1600 + 5 * 100 + 50, None, A)
    assert sel.full == {3, 2}  # (filled expert by expert with ties to later layers, the same selection)
    assert sel.partial == {1: (0, 1, 2, 3, 4)} and sel.bytes == 2 * 1600 + 500
    expected = 2 * (A + HOST_LAYER_COST) - 5 * A / 16  # layers 0 and 1 in host RAM, 5 of layer 1's experts cached
    assert sel.cost == pytest.approx(expected)


def test_skewed_routing_caches_the_hottest_experts_of_every_layer() -> None:
    counts = np.ones((4, 16))
    counts[:, 5] = counts[:, 9] = 200  # two hot experts per layer
    counts[2, 1] = 500
    sel = select_experts(_layers(4), 9 * 100, counts, A)
    assert sel.policy == "per expert" and not sel.full
    assert sel.partial == {0: (5, 9), 1: (5, 9), 2: (1, 5, 9), 3: (5, 9)}
    assert sel.bytes == 900


def _uniform_counts(rng: np.random.Generator, layers: int, tokens: int, e: int = 128, a: int = 8) -> np.ndarray:
    """The pick counts of `tokens` tokens routed uniformly: each picks `a` distinct experts of `e` per layer."""
    counts = np.zeros((layers, e))
    for layer in range(layers):
        picks = np.argsort(rng.random((tokens, e)), axis=1)[:, :a]
        counts[layer] = np.bincount(picks.ravel(), minlength=e)
    return counts


def test_statistics_of_uniform_routing_place_as_none_do() -> None:
    """A uniform router's counts over a few hundred tokens vary by sampling alone (some experts look 15-30 % hotter
    than others); taken at face value they would scatter single experts over every layer instead of whole layers,
    which also save the host round trip (measured on the device: 0.95x whole layers). Shrunk towards uniform by
    the spread sampling explains, they place as no statistics do."""
    rng = np.random.default_rng(1)
    layers = _layers(8, e=128)
    budget = 3 * 128 * 100 + 40 * 100  # three whole layers and 40 experts
    plain = select_experts(layers, budget, None, 8)
    for tokens in (256, 768, 4096):
        counts = _uniform_counts(rng, 8, tokens)
        sel = select_experts(layers, budget, counts, 8)
        # three whole layers (which ones, and where the 40 single experts go, are near ties)
        assert len(sel.full) == len(plain.full) == 3, (tokens, sel.policy, sorted(sel.full))
        raw = counts / counts.sum(axis=1, keepdims=True)
        assert raw.max() * 128 > 1.15  # the counts alone do make some experts look hot
        for row in counts:
            assert np.abs(estimated_shares(row, 8) * 128 - 1).max() < 0.1


def test_estimated_shares_keep_a_skewed_routers_ranking_and_spread() -> None:
    rng = np.random.default_rng(2)
    share = 1.0 / np.arange(1, 129)
    share = share / share.sum()  # zipf:1.0 over 128 experts
    for tokens in (256, 768, 4096):
        counts = np.zeros(128)
        for _ in range(tokens):  # 8 distinct picks per token, drawn by popularity
            counts[rng.choice(128, size=8, replace=False, p=share)] += 1
        shrunk = estimated_shares(counts, 8)
        assert shrunk.sum() == pytest.approx(1.0)
        assert np.array_equal(np.argsort(-shrunk, kind="stable"), np.argsort(-counts, kind="stable"))
        observed = counts / counts.sum()
        assert np.abs(shrunk - 1 / 128).sum() > 0.9 * np.abs(observed - 1 / 128).sum()
    assert np.array_equal(estimated_shares(np.zeros(16), 2), np.full(16, 1 / 16))
    assert np.array_equal(estimated_shares(np.full(16, 5.0), 2), np.full(16, 1 / 16))


def test_budget_is_never_exceeded_and_a_fully_cached_layer_becomes_whole() -> None:
    rng = np.random.default_rng(0)
    layers = [LayerExperts(i, 8, 8 * (90 + 10 * i), 90 + 10 * i, i != 2) for i in range(5)]
    for budget in [0, 1, 89, 90, 500, 720, 2000, 4000, 100_000]:
        counts = rng.zipf(1.5, size=(5, 8)).astype(float)
        for c in (None, counts):
            sel = select_experts(layers, budget, c, A)
            assert sel.bytes <= budget
            assert 2 not in sel.partial  # not splittable: whole or nothing
            assert all(0 < len(ids) < 8 for ids in sel.partial.values())
            assert not set(sel.partial) & sel.full
    assert select_experts(layers, 100_000, None, A).full == set(range(5))


def test_moe_cache_beside_cpu_moe(q8_moe: Path) -> None:
    """--cpu-moe --moe-cache: the expert tensors stay planned on the CPU; single experts take at most the size
    given, counted in the VRAM estimate; without statistics the lowest ids, with them the most picked."""
    f, plain = _plan(q8_moe, cpu_moe=True)
    per_expert = sum(i.n_bytes for n, i in f.tensors.items() if expert_layer(n) == 0) // E
    _, plan = _plan(q8_moe, cpu_moe=True, moe_cache=3 * per_expert + 7)
    assert plan.devices == plain.devices  # the tensors stay where --cpu-moe put them
    cache = plan.expert_cache
    assert cache.bytes == 3 * per_expert <= 3 * per_expert + 7
    assert sorted(len(ids) for ids in cache.layers.values()) in ([3], [1, 2])
    assert "lowest expert ids" in cache.source
    assert plan.gpu_bytes() == plain.gpu_bytes() + cache.bytes
    counts = np.zeros((2, E), dtype=np.int64)
    counts[0, [6, 7]] = 50
    counts[1, 3] = 80
    counts += 1
    _, hot = _plan(q8_moe, counts, cpu_moe=True, moe_cache=3 * per_expert)
    assert dict(hot.expert_cache.layers) == {0: (6, 7), 1: (3,)}
    assert "test counts" in hot.expert_cache.source
    d = hot.to_dict()
    assert d["expert_cache"]["experts_per_layer"] == {"0": 2, "1": 1}  # type: ignore[index]
    assert d["expert_cache"]["experts"] == {"0": [6, 7], "1": [3]}  # type: ignore[index]
    json.dumps(d)
    _, whole = _plan(q8_moe, cpu_moe=True, moe_cache=E * per_expert + 100)  # one layer fits whole
    assert whole.expert_cache.bytes == 0 or len(whole.cpu_expert_layers) == 1
    assert len(whole.cpu_expert_layers) == 1 and whole.gpu_bytes() <= plain.gpu_bytes() + E * per_expert + 100


def test_gpu_memory_fills_with_experts_and_stays_in_budget(q8_moe: Path) -> None:
    _, everything = _plan(q8_moe)
    _, all_off = _plan(q8_moe, cpu_moe=True)
    lo, hi = all_off.gpu_bytes(), everything.gpu_bytes()
    assert lo < hi
    counts = np.arange(2 * E, dtype=np.int64).reshape(2, E) ** 2
    cached = []
    for budget in np.linspace(lo, hi - 1, 9).astype(int):
        for c in (None, counts):
            _, plan = _plan(q8_moe, c, gpu_memory=int(budget))
            assert plan.gpu_bytes() <= budget, (budget, plan.notes)
            n = sum(len(ids) for ids in plan.expert_cache.layers.values()) + E * (2 - len(plan.cpu_expert_layers))
            cached.append(n)
            assert any(note.startswith("--gpu-memory") for note in plan.notes)
    assert cached[0] == 0 and max(cached) >= E  # nothing at the floor, a layer or more near the top
    _, hot = _plan(q8_moe, counts, gpu_memory=int((lo + hi) // 2))
    for layer, ids in hot.expert_cache.layers.items():
        assert list(ids) == list(range(E - len(ids), E)), (layer, ids)  # the most picked: the highest ids here


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"moe_cache": "1GiB"}, "no routed experts are in host RAM"),
        ({"cpu_moe": True, "moe_cache": "lots"}, "--moe-cache: cannot read 'lots'"),
        ({"cpu_moe": True, "moe_cache": 0}, "--moe-cache must be positive"),
    ],
)
def test_moe_cache_errors(q8_moe: Path, flags: dict[str, object], message: str) -> None:
    with pytest.raises(PlacementError, match=message):
        _plan(q8_moe, **flags)
    with pytest.raises(PlacementError, match="needs a GPU device"):
        PlacementRequest.from_flags(device="cpu", cpu_moe=True, moe_cache="1GiB")


def test_expert_stats_file_round_trip_and_mismatch(
    q8_moe: Path, tiny_qwen3moe_gguf: tuple[Path, Path], tiny_qwen35moe_gguf: tuple[Path, Path], tmp_path: Path
) -> None:
    f = open_gguf(q8_moe)
    cfg = read_config(f)
    path = tmp_path / "stats.json"
    stats = ExpertStats.open(path, f, cfg)  # absent: empty, saved there later
    assert stats.total == 0 and stats.counts.shape == (2, E)
    stats.add(np.arange(2 * E).reshape(2, E))
    stats.save()
    again = ExpertStats.open(path, f, cfg)
    assert np.array_equal(again.counts, np.arange(2 * E).reshape(2, E)) and again.total == stats.total
    f32 = open_gguf(tiny_qwen3moe_gguf[1])  # the same model in F32: the same F32 routers
    assert np.array_equal(ExpertStats.open(path, f32, read_config(f32)).counts, again.counts)
    other = open_gguf(tiny_qwen35moe_gguf[1])
    with pytest.raises(TandemError, match=r"--expert-stats .*stats\.json: recorded for another model"):
        ExpertStats.open(path, other, read_config(other))
    path.write_text("{not json")
    with pytest.raises(TandemError, match="cannot read it as expert statistics"):
        ExpertStats.open(path, f, cfg)
    doc = {"format": "tandem-expert-stats", "version": 1, "fingerprint": stats.fingerprint, "counts": [[1, 2]]}
    path.write_text(json.dumps(doc))
    with pytest.raises(TandemError, match="counts of shape"):
        ExpertStats.open(path, f, cfg)


def test_expert_stats_keep_their_runs_in_two_halves(q8_moe: Path, tmp_path: Path) -> None:
    """Each run's picks go to the half with fewer; the halves are saved beside the total and read back; a file
    without them (written before them) has all its picks in the first; halves that do not add up are an error."""
    f = open_gguf(q8_moe)
    cfg = read_config(f)
    path = tmp_path / "stats.json"
    runs = [np.full((2, E), k + 1) for k in range(3)]
    for run in runs:
        stats = ExpertStats.open(path, f, cfg)
        stats.add(run)
        stats.save()
    back = ExpertStats.open(path, f, cfg)
    assert np.array_equal(back.halves[0], runs[0] + runs[2]) and np.array_equal(back.halves[1], runs[1])
    assert np.array_equal(back.counts, sum(runs))
    assert back.placement_counts()["expert_counts"] is back.halves
    doc = json.loads(path.read_text())
    del doc["halves"]
    path.write_text(json.dumps(doc))
    old = ExpertStats.open(path, f, cfg)
    assert np.array_equal(old.halves[0], old.counts) and not old.halves[1].any()
    doc["halves"] = [doc["counts"], doc["counts"]]
    path.write_text(json.dumps(doc))
    with pytest.raises(TandemError, match='"halves" must be two non-negative tables that add up to "counts"'):
        ExpertStats.open(path, f, cfg)
    zeros = np.zeros_like(np.asarray(doc["counts"])).tolist()
    for bad in ("abc", None, [[1]], [[[1e30]]], [zeros, [[-1] * E, [1] * E]], {"a": 1}):
        doc["halves"] = bad
        path.write_text(json.dumps(doc))
        with pytest.raises(TandemError, match=r"^--expert-stats .*: \"halves\"") as e:
            ExpertStats.open(path, f, cfg)
        assert "\n" not in str(e.value)


def _runs(rng: np.random.Generator, n_runs: int, lasting: np.ndarray, own: float, tokens: int = 768) -> np.ndarray:
    """Pick counts [n_runs, E] of runs of `tokens` tokens each picking 8 distinct of E experts by popularity:
    `lasting` [E] the router's, scaled per run by a hot set of the run's own text (log-normal, spread `own`)."""
    counts = np.zeros((n_runs, lasting.size))
    for k in range(n_runs):
        p = lasting * np.exp(own * rng.standard_normal(lasting.size))
        counts[k] = np.bincount(
            np.concatenate([rng.choice(lasting.size, 8, replace=False, p=p / p.sum()) for _ in range(tokens)]),
            minlength=lasting.size,
        )
    return counts


def test_a_texts_own_hot_set_is_not_taken_for_the_routers() -> None:
    """Runs whose texts each have a hot set of their own (a router with no lasting preference, as a random
    model's) disagree between the halves: the estimate stays near uniform and the budget goes to whole layers,
    as without statistics. A router's lasting skew shows in both halves and keeps its ranking and most of its
    spread."""
    rng = np.random.default_rng(3)
    flat = np.full(128, 1.0)
    zipf = 1.0 / np.arange(1, 129)
    layers = _layers(6, e=128)
    budget = 2 * 128 * 100 + 40 * 100
    plain = select_experts(layers, budget, None, 8)
    runs = np.stack([_runs(rng, 4, flat, own=1.2) for _ in layers], axis=1)  # [runs, layers, E]
    halves = np.stack([runs[0::2].sum(0), runs[1::2].sum(0)])
    total = halves.sum(0)
    assert (np.sort(total, 1)[:, ::-1][:, :12].sum(1) / total.sum(1)).min() > 0.15  # skewed to the eye (uniform .09)
    for layer in range(len(layers)):  # most of the runs' spread is taken for theirs alone
        observed = np.abs(total[layer] / total[layer].sum() - 1 / 128).sum()
        assert np.abs(estimated_shares(total[layer], 8, halves[:, layer]) - 1 / 128).sum() < 0.5 * observed
    sel = select_experts(layers, budget, halves, 8)
    assert len(sel.full) == len(plain.full) == 2, (sel.policy, sorted(sel.full))
    assert len(select_experts(layers, budget, total, 8).full) < 2  # the sum alone is taken at its word
    skewed = np.stack([_runs(rng, 4, zipf, own=0.5) for _ in range(2)], axis=1)
    halves = np.stack([skewed[0::2].sum(0), skewed[1::2].sum(0)])
    for layer in range(2):
        c = halves[:, layer].sum(0)
        shares = estimated_shares(c, 8, halves[:, layer])
        assert np.array_equal(np.argsort(-shares, kind="stable"), np.argsort(-c, kind="stable"))
        assert np.abs(shares - 1 / 128).sum() > 0.8 * np.abs(c / c.sum() - 1 / 128).sum()
    assert np.array_equal(estimated_shares(total[0], 8, np.stack([total[0], 0 * total[0]])),
                          estimated_shares(total[0], 8))  # fmt: skip


def test_refresh_keeps_a_spare_slot_per_cached_layer(q8_moe: Path) -> None:
    """--moe-cache-refresh: each layer cached in part gives its coldest pick's slot to a spare (the same VRAM)."""
    f, _ = _plan(q8_moe, cpu_moe=True)
    per_expert = sum(i.n_bytes for n, i in f.tensors.items() if expert_layer(n) == 0) // E
    counts = np.ones((2, E), dtype=np.int64)
    counts[0, 3], counts[0, 5], counts[1, 2] = 90, 50, 70
    _, static = _plan(q8_moe, counts, cpu_moe=True, moe_cache=4 * per_expert)
    _, online = _plan(q8_moe, counts, cpu_moe=True, moe_cache=4 * per_expert, moe_cache_refresh=16)
    assert online.expert_cache.spare == 1 and static.expert_cache.spare == 0
    assert online.expert_cache.bytes == static.expert_cache.bytes <= 4 * per_expert
    for layer, ids in static.expert_cache.layers.items():
        kept = online.expert_cache.layers[layer]
        assert len(kept) == len(ids) - 1 and set(kept) <= set(ids)
        assert counts[layer][list(kept)].min() >= counts[layer][list(set(ids) - set(kept))].max()
    assert online.to_dict()["expert_cache"]["spare_slots_per_layer"] == 1  # type: ignore[index]
    with pytest.raises(PlacementError, match="--moe-cache-refresh re-places cached experts"):
        _plan(q8_moe, cpu_moe=True, moe_cache_refresh=16)


def test_a_layer_is_completed_when_its_round_trip_outweighs_the_picks_given_up() -> None:
    layers = _layers(2, e=4)
    counts = np.array([[10, 10, 10, 1], [10, 10, 10, 1]])
    # one pick per token: completing layer 1 gives up a third of a pick of layer 0 and saves its round trip (0.4)
    sel = select_experts(layers, 6 * 100, counts, 1)
    assert sel.full == {1} and sel.partial == {0: (1, 2)} and sel.bytes == 600
    # two picks per token: two thirds of a pick given up is more than the round trip
    sel = select_experts(layers, 6 * 100, counts, 2)
    assert not sel.full and sel.partial == {0: (0, 1, 2), 1: (0, 1, 2)}
