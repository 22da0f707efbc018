"""Online re-placement of the experts cached in VRAM (`--moe-cache-refresh STEPS`).

The plan caches some experts of a layer whose expert tensors stay in host RAM (placement/experts.py); with
re-placement each such layer also keeps a spare slot. Every STEPS steps the routing counts (layers/moe.py
`RoutingCounts`, on the device) are copied to page-locked host memory without waiting; once they are there, at a
later step boundary, each layer's recent picks (a decaying sum over the windows) are compared: when an expert
outside the cache is picked clearly more than the coldest one inside it, the outside one's rows are copied from
the page-locked file mapping into the spare slot on a side stream. At the first step boundary after that copy is
done, the slot map (read on the device by every step, the captured ones too) points the expert at the slot and
the coldest expert at nothing; its slot is the next spare. Up to MAX_SWAPS pairs (the next hottest outside, the
next coldest inside) swap in one window: beyond the first, the cold expert leaves its slot at once (the CPU
computes it meanwhile) and the hot one is copied into it. No step waits for a copy, nothing but the slot map
changes under a captured step, and the VRAM stays what the plan counted (the spare is part of it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from tandem.layers.moe import RoutingCounts

MARGIN = 1.25  # an outside expert replaces the coldest cached one when picked this much more often (and ...)
MIN_GAIN = 2.0  # ... by at least this many picks of the decaying sum
DECAY = 0.5  # weight of the previous windows in the decaying sum
# Swaps per layer per window. When the text moves on, a layer's hot set changes by tens of experts, which one swap
# per window follows too slowly (docs/PERFORMANCE.md).
MAX_SWAPS = 4


@dataclass(eq=False)
class CacheSlots:
    """One layer's cache: the slots' device tensors and where each slot's rows come from.

    `experts[s]` is the expert in slot s (-1: spare); `slot_map` [E] int32 on the device is its inverse (-1: not
    cached), shared with the layer's OffloadedExperts. `matrices`: (device blocks [S * per], host blocks [E * per]
    in the page-locked file mapping, per = one expert's bytes); `vectors`: (device [S, ...], host [E, ...] f32)."""

    layer: int
    slot_map: torch.Tensor
    experts: list[int]
    matrices: list[tuple[torch.Tensor, torch.Tensor, int]] = field(default_factory=list)
    vectors: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @property
    def cached(self) -> list[int]:
        return [e for e in self.experts if e >= 0]

    def copy_in(self, slot: int, expert: int) -> None:
        """Copy `expert`'s rows into `slot` (on the current stream; non-blocking from page-locked memory)."""
        for dev, host, per in self.matrices:
            dev[slot * per : (slot + 1) * per].copy_(host[expert * per : (expert + 1) * per], non_blocking=True)
        for dev, host in self.vectors:
            dev[slot].copy_(host[expert], non_blocking=True)


@dataclass(eq=False)
class _Swap:
    slots: CacheSlots
    slot: int  # the spare being filled
    expert: int  # the expert copied in
    victim: int  # the slot of the expert it replaces
    done: torch.cuda.Event | None  # the copy's completion (None: copied already, on the CPU)


class ExpertCacheRefresher:
    """Re-places the cached experts of `layers` from the routing counts, every `every` steps (see the module)."""

    def __init__(self, layers: Sequence[CacheSlots], counts: RoutingCounts, every: int) -> None:
        assert every > 0
        self.layers = list(layers)
        self.counts = counts
        self.every = every
        device = counts.counts.device
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        shape = tuple(counts.counts.shape)
        self._host = torch.empty(shape, dtype=torch.int64, pin_memory=self.cuda)
        self._read: torch.cuda.Event | None = None
        self._reading = False
        self._last = np.zeros(shape, dtype=np.int64)
        self.recent = np.zeros(shape, dtype=np.float64)  # the decaying sum of picks per window
        self._pending: list[_Swap] = []
        self.steps = 0
        self.swaps = 0  # swaps made, for notices and tests

    def between_steps(self) -> None:
        """Called before every step, while no step runs: flip the slot maps of the copies done, take the counts
        read meanwhile, start reading them again every `every` steps. Never waits for the device."""
        self.steps += 1
        self._flip_done()
        if self._reading and (self._read is None or self._read.query()):
            self._reading = False
            self._decide(self._host.numpy().copy())
        if not self._reading and not self._pending and self.steps % self.every == 0:
            self._start_read()

    def _start_read(self) -> None:
        self._host.copy_(self.counts.counts, non_blocking=self.cuda)
        if self.cuda:
            self._read = torch.cuda.Event()
            self._read.record()
        self._reading = True

    def _decide(self, counts: np.ndarray) -> None:
        window = counts - self._last
        self._last = counts
        self.recent = self.recent * DECAY + window
        for s in self.layers:
            if -1 not in s.experts:
                continue
            picks = self.recent[s.layer]
            inside = set(s.cached)
            outside = [int(e) for e in np.argsort(-picks, kind="stable") if int(e) not in inside]
            # the cached experts' slots, coldest first; spares (a cache not filled yet) before any of them
            victims = sorted(range(len(s.experts)), key=lambda k: (s.experts[k] >= 0, picks[s.experts[k]], k))
            spare = victims.pop(0)  # the one spare slot kept free
            for hot in outside[:MAX_SWAPS]:
                if not victims:
                    break
                victim = victims.pop(0)
                cold = s.experts[victim]
                coldest = 0.0 if cold < 0 else float(picks[cold])
                if picks[hot] < coldest * MARGIN or picks[hot] - coldest < MIN_GAIN:
                    break
                if spare >= 0:  # into the spare; the cold expert leaves at the flip, its slot the next spare
                    self._copy(s, hot, spare, victim if cold >= 0 else -1)
                    spare = -1
                    continue
                if cold >= 0:  # into the cold expert's slot, which it leaves now
                    s.slot_map[cold] = -1
                    s.experts[victim] = -1
                self._copy(s, hot, victim, -1)

    def _copy(self, s: CacheSlots, expert: int, spare: int, victim: int) -> None:
        """Copy `expert` into the empty slot `spare`; at the flip `victim`'s expert (a slot, or -1: none) leaves."""
        if self.copy_stream is None:
            s.copy_in(spare, expert)
            self._pending.append(_Swap(s, spare, expert, victim, None))
            return
        ready = torch.cuda.Event()
        ready.record()  # the work already queued (which may still read the spare's previous expert) comes first
        self.copy_stream.wait_event(ready)
        with torch.cuda.stream(self.copy_stream):
            s.copy_in(spare, expert)
            done = torch.cuda.Event()
            done.record()
        self._pending.append(_Swap(s, spare, expert, victim, done))

    def _flip_done(self) -> None:
        still = []
        for swap in self._pending:
            if swap.done is not None and not swap.done.query():
                still.append(swap)
                continue
            s = swap.slots
            if swap.done is not None:  # the step's kernels read the slot after the copy, on the device too
                torch.cuda.current_stream().wait_event(swap.done)
            s.slot_map[swap.expert] = swap.slot
            s.experts[swap.slot] = swap.expert
            if swap.victim >= 0:
                s.slot_map[s.experts[swap.victim]] = -1
                s.experts[swap.victim] = -1  # the next spare
            self.swaps += 1
        self._pending = still
