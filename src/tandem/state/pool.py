"""The state pool: every layer's sequence state for `-np/--parallel` slots, allocated once.

Each mixer allocates its layer's part with a leading slot axis (`KVPool`, the delta-net's `DeltaNetPool`); a
slot's `KVCache` holds that slot's views and the tokens in it. A sequence of the serving engine owns a slot
while it runs; a finished sequence's tokens stay in its slot, so that the next request starting with them (the
next turn of a chat) resumes there."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.state.kv_cache import KVCache


@dataclass
class StatePool:
    layers: list[Any]  # per layer: the pool of its mixer's state (slot axis first)
    caches: list[KVCache]  # per slot
    n_ctx: int  # positions per slot
    n_batch: int  # the most tokens a step may add to a slot (sliding-window rings are sized for it)

    @classmethod
    def of_layers(cls, layers: list[Any], n_slots: int, n_ctx: int, n_batch: int) -> StatePool:
        caches = [KVCache(layers=[layer.slot(i) for layer in layers], n_ctx=n_ctx) for i in range(n_slots)]
        return cls(layers=layers, caches=caches, n_ctx=n_ctx, n_batch=n_batch)

    @property
    def n_slots(self) -> int:
        return len(self.caches)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)
