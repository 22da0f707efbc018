"""Which routed experts get VRAM: whole layers, or single experts of a layer whose tensors stay in host RAM.

A layer of experts in host RAM costs each decode token the experts it picks there (ggml reads each from host
memory: ~47 us for a Qwen3-30B-A3B Q4_K expert at 55 GB/s) plus one host round trip (~20 us). An expert cached in
VRAM saves its share of the picks; a whole layer in VRAM also saves the round trip. The selection takes the
experts (and whole layers) that save the most per byte, by the routing statistics when there are some
(`--expert-stats`) and as if routing were uniform otherwise, and keeps the cheaper of two fills of the same budget:
expert by expert, or whole layers first and single experts in what is left; in both, a layer cached all but a few
experts is completed where its round trip outweighs the picks given up elsewhere for the room. With uniform
routing whole layers win (the same picks saved, fewer round trips); with skewed routing single experts do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from tandem.gguf import TensorInfo

# A host round trip, in units of one expert computed on the CPU (decode, Qwen3-30B-A3B on the H200 host:
# ~20 us against ~47 us).
HOST_LAYER_COST = 0.4


@dataclass(frozen=True)
class ExpertCache:
    """Per layer whose expert tensors the plan keeps in host RAM, the experts also kept in VRAM (sorted ids), and
    the VRAM one expert of that layer takes (its rows of every expert matrix, its entries of the expert vectors)."""

    layers: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    expert_bytes: Mapping[int, int] = field(default_factory=dict)
    source: str = ""  # what chose the ids: the statistics, or the default
    spare: int = 0  # empty slots per cached layer, beside the ids: online re-placement copies into them

    @property
    def bytes(self) -> int:
        return sum((len(ids) + self.spare) * self.expert_bytes[layer] for layer, ids in self.layers.items())

    def resident(self, layer: int) -> tuple[int, ...]:
        return tuple(self.layers.get(layer, ()))

    def merged(self, other: ExpertCache) -> ExpertCache:
        if not other.layers:
            return self
        if not self.layers:
            return other
        assert not set(self.layers) & set(other.layers), "a layer's cache is chosen once"
        source = self.source if self.source == other.source else f"{self.source}; {other.source}"
        spare = max(self.spare, other.spare)
        return ExpertCache({**self.layers, **other.layers}, {**self.expert_bytes, **other.expert_bytes}, source, spare)

    def to_dict(self) -> dict[str, object]:
        return {
            "bytes": self.bytes,
            "source": self.source,
            "spare_slots_per_layer": self.spare,
            "experts_per_layer": {str(layer): len(ids) for layer, ids in sorted(self.layers.items())},
            "experts": {str(layer): list(ids) for layer, ids in sorted(self.layers.items())},
        }


@dataclass(frozen=True)
class LayerExperts:
    """One layer's routed experts as the selection sees them."""

    layer: int
    n_experts: int
    layer_bytes: int  # every expert tensor of the layer
    expert_bytes: int  # one expert's share (layer_bytes / n_experts, rounded up)
    splittable: bool  # single experts can be cached (the GPU kernels read the matrices' type)


def layer_experts(layer: int, infos: Sequence[TensorInfo], splittable: bool) -> LayerExperts:
    n = infos[0].shape[0]
    total = sum(i.n_bytes for i in infos)
    per = sum(-(-i.n_bytes // i.shape[0]) for i in infos)
    return LayerExperts(layer, n, total, per, splittable)


@dataclass(frozen=True)
class Selection:
    full: frozenset[int]  # layers whose experts all go to VRAM (the plan moves their tensors there)
    partial: dict[int, tuple[int, ...]]  # layer -> cached expert ids
    bytes: int
    cost: float  # per decode token, in experts computed on the CPU (host round trips included)
    policy: str  # "per expert" or "whole layers first"


def popularity_table(
    counts: np.ndarray | None, layers: Sequence[LayerExperts], n_active: int
) -> dict[int, np.ndarray]:
    """Per layer, each expert's expected picks per token (summing to n_active), estimated from `counts`
    [n_layers, E] or its two halves [2, n_layers, E] (`estimated_shares`) where the layer has any, else uniform."""
    halves = None
    if counts is not None and np.ndim(counts) == 3:
        halves = np.asarray(counts, dtype=np.float64)
        counts = halves.sum(axis=0)
    out = {}
    for c in layers:
        row = None if counts is None or c.layer >= len(counts) else np.asarray(counts[c.layer], dtype=np.float64)
        if row is None or row.shape != (c.n_experts,) or row.sum() <= 0:
            out[c.layer] = np.full(c.n_experts, n_active / c.n_experts)
        else:
            split = None if halves is None else halves[:, c.layer]
            out[c.layer] = estimated_shares(row, n_active, split) * n_active
    return out


def estimated_shares(counts: np.ndarray, n_active: int, halves: np.ndarray | None = None) -> np.ndarray:
    """Each expert's share of a layer's picks [E] (summing to 1) in the texts to come, from its pick counts [E]:
    the observed shares pulled towards uniform by how far they are to be trusted -- by the agreement of `halves`
    [2, E] (the counts of different texts) when both hold picks, else by sampling noise."""
    c = np.asarray(counts, dtype=np.float64)
    e, total = c.size, float(c.sum())
    uniform = np.full(e, 1.0 / e)
    if total <= 0:
        return uniform
    if halves is not None and min(float(np.sum(h)) for h in halves) > 0:
        trust = _halves_agreement(halves)
    else:
        trust = _beyond_sampling_noise(c, n_active)
    return uniform + trust * (c / total - uniform)


def _halves_agreement(halves: np.ndarray) -> float:
    """How far two halves' shares [2, E] agree: the correlation r of their deviations from uniform, less what
    unrelated halves reach by chance (2 / sqrt(E)), stepped up to the whole (2r / (1 + r)). A router's lasting
    preferences show in both; a text's own hot set and sampling noise in one. A random text's routing can be as
    skewed as a skewed router's and says nothing of the next text's (docs/synth.md)."""
    e = np.shape(halves)[-1]
    a, b = (np.asarray(h, dtype=np.float64) / float(np.sum(h)) - 1.0 / e for h in halves)
    norm = float(np.sqrt((a @ a) * (b @ b)))
    r = float(a @ b) / norm if norm > 0 else 0.0
    chance = 2.0 / np.sqrt(e)  # two standard deviations of r between unrelated halves
    r = min(1.0, max(0.0, (r - chance) / (1.0 - chance)))
    return 2 * r / (1 + r)


def _beyond_sampling_noise(c: np.ndarray, n_active: int) -> float:
    """The fraction of the counts' spread [E] that sampling does not explain (James-Stein). A token picks an expert
    at most once, so under uniform routing an expert's count over n tokens has variance n (A/E)(1 - A/E), and the
    counts' squared deviations from their mean sum to N (1 - A/E) in expectation (N = n A picks): all of the spread
    is kept for a skewed router, none for a uniform one, whose few hundred tokens' counts would otherwise make some
    experts look hot and displace whole layers (which also save the host round trip) with scattered single
    experts."""
    e, total = c.size, float(c.sum())
    spread = float(((c - total / e) ** 2).sum())
    noise = total * (1.0 - min(n_active, e) / e)
    return max(0.0, 1.0 - noise / spread) if spread > 0 else 0.0


def _cost(layers: Sequence[LayerExperts], pop: Mapping[int, np.ndarray], full: set[int],
          partial: Mapping[int, Sequence[int]]) -> float:  # fmt: skip
    cost = 0.0
    for c in layers:
        if c.layer in full:
            continue
        saved = float(pop[c.layer][list(partial.get(c.layer, ()))].sum())
        cost += float(pop[c.layer].sum()) - saved + HOST_LAYER_COST
    return cost


def _fill_experts(layers: Sequence[LayerExperts], pop: Mapping[int, np.ndarray], budget: int,
                  taken: dict[int, list[int]]) -> int:  # fmt: skip
    """Add single experts of the splittable layers to `taken`, most picks per byte first, while they fit `budget`;
    returns the bytes added. Ties go to later layers (as whole layers do), then to lower ids."""
    items = []
    for c in layers:
        if not c.splittable:
            continue
        have = set(taken.get(c.layer, ()))
        for e in range(c.n_experts):
            if e not in have:
                items.append((-float(pop[c.layer][e]) / c.expert_bytes, -c.layer, e, c))
    items.sort(key=lambda t: t[:3])
    used = 0
    for _, _, e, c in items:
        if used + c.expert_bytes <= budget:
            taken.setdefault(c.layer, []).append(e)
            used += c.expert_bytes
    return used


def _complete_layers(layers: Sequence[LayerExperts], pop: Mapping[int, np.ndarray], taken: dict[int, list[int]],
                     left: int) -> int:  # fmt: skip
    """Complete layers cached in part where that saves work: a layer whose missing experts fit the `left` bytes
    plus those of the least picked experts cached elsewhere, and whose missing picks plus its host round trip
    outweigh the picks given up. The layers missing the fewest experts first, until one does not pay. Returns the
    bytes left."""
    by_layer = {c.layer: c for c in layers if c.splittable}

    def partial() -> list[LayerExperts]:
        return [c for c in by_layer.values() if 0 < len(taken.get(c.layer, ())) < c.n_experts]

    while True:
        open_layers = partial()
        if not open_layers:
            return left
        c = min(open_layers, key=lambda c: (c.n_experts - len(taken[c.layer]), -c.layer))
        have = set(taken[c.layer])
        missing = [e for e in range(c.n_experts) if e not in have]
        need = len(missing) * c.expert_bytes - left
        gain = float(pop[c.layer][missing].sum()) + HOST_LAYER_COST
        others = sorted(
            (float(pop[o.layer][e]) / o.expert_bytes, o.layer, e) for o in open_layers if o is not c
            for e in taken[o.layer]
        )  # fmt: skip
        freed, loss, drop = 0, 0.0, []
        for _, layer, e in others:
            if freed >= need:
                break
            drop.append((layer, e))
            freed += by_layer[layer].expert_bytes
            loss += float(pop[layer][e])
        if freed < need or gain <= loss + 1e-9:
            return left
        for layer, e in drop:
            taken[layer].remove(e)
        taken[c.layer].extend(missing)
        left += freed - len(missing) * c.expert_bytes


def _finish(layers: Sequence[LayerExperts], pop: Mapping[int, np.ndarray], full: set[int],
            taken: dict[int, list[int]], used: int, policy: str, spare: int = 0) -> Selection:  # fmt: skip
    by_layer = {c.layer: c for c in layers}
    partial = {}
    for layer, ids in taken.items():
        if len(ids) == by_layer[layer].n_experts:  # every expert cached: the whole layer goes to VRAM
            full.add(layer)
            used += by_layer[layer].layer_bytes - len(ids) * by_layer[layer].expert_bytes
        elif len(ids) >= spare and ids:  # the coldest `spare` of them leave their slots empty
            kept = sorted(ids, key=lambda e: (-float(pop[layer][e]), e))[: len(ids) - spare]
            partial[layer] = tuple(sorted(kept))
        else:
            used -= len(ids) * by_layer[layer].expert_bytes
    return Selection(frozenset(full), partial, used, _cost(layers, pop, full, partial), policy)


def select_experts(
    layers: Sequence[LayerExperts], budget: int, counts: np.ndarray | None, n_active: int, spare: int = 0
) -> Selection:
    """The cheaper of two fills of `budget` bytes over `layers` (see the module docstring). With `spare`, each layer
    cached in part keeps that many of its slots empty (its coldest picks' places) for online re-placement."""
    pop = popularity_table(counts, layers, n_active)
    budget = max(0, budget)
    # expert by expert, then layers completed where that pays (a layer whose experts all fit comes out whole)
    taken: dict[int, list[int]] = {}
    used = _fill_experts(layers, pop, budget, taken)
    used = budget - _complete_layers(layers, pop, taken, budget - used)
    per_expert = _finish(layers, pop, set(), taken, used, "per expert", spare)
    # whole layers first (later layers first, as --gpu-memory always did), then single experts
    full: set[int] = set()
    used = 0
    for c in sorted(layers, key=lambda c: -c.layer):
        if used + c.layer_bytes <= budget:
            full.add(c.layer)
            used += c.layer_bytes
    rest = [c for c in layers if c.layer not in full]
    taken = {}
    used += _fill_experts(rest, pop, budget - used, taken)
    used = budget - _complete_layers(rest, pop, taken, budget - used)
    whole_first = _finish(layers, pop, full, taken, used, "whole layers first", spare)
    # equal costs: more whole layers (fewer host ops to launch); the same selection: "per expert"
    best = min((per_expert, whole_first), key=lambda s: (round(s.cost, 9), -len(s.full), s.policy != "per expert"))
    assert best.bytes <= budget, (best.bytes, budget)
    return best
