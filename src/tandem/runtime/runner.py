"""The model runner: one step over a batch of sequences, then the step's tokens counted in their slots.

On a GPU a decode step (one token per sequence) is replayed as a CUDA graph captured per batch-size bucket
(split around the host ops of CPU experts, cuda/graphs.py); the batch is padded to its bucket with rows that
touch no state. Every other step runs eagerly."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from tandem.layers.attention import Attention
from tandem.layers.delta_net import GatedDeltaNet
from tandem.layers.gated_attention import GatedAttention
from tandem.models.cpu_graph import StepGraph
from tandem.models.decoder import DecoderModel
from tandem.state.batch import StepBatch
from tandem.state.pool import StatePool

# Mixers whose decode step on a GPU keeps fixed shapes, reads positions and slots from the device and updates the
# pool in place, so it can be captured: attention writes K/V by device index (layers/attention.py
# `_pooled_decode`), the delta-net its conv and recurrent state (cuda/delta_net.py).
CAPTURABLE_MIXERS = (Attention, GatedAttention, GatedDeltaNet)
# Decode batch sizes with a graph of their own; a batch takes the smallest that holds it. At most the host ops'
# buffer rows (weights/offload.py HOST_CALL_ROWS).
DECODE_BUCKETS = (1, 2, 4, 8, 16, 32)


def _capturable(model: DecoderModel) -> bool:
    if model.device.type != "cuda" or model.reduce is not None:  # under --tp decode runs eagerly (not built yet)
        return False
    from tandem.cuda.delta_net import step_fits

    return all(
        type(b.mixer) in CAPTURABLE_MIXERS and (not isinstance(b.mixer, GatedDeltaNet) or step_fits(b.mixer.shape))
        for b in model.blocks
    )


class DecodeGraph:
    """The decode step of `size` rows with static inputs, captured on first use and replayed after."""

    def __init__(self, model: DecoderModel, pool: StatePool, size: int) -> None:
        from tandem.cuda.graphs import SegmentedGraph

        self.model, self.pool = model, pool
        device = model.device
        self.x = torch.zeros(size, model.cfg.hidden, dtype=model.dtype, device=device)
        self.batch = StepBatch(
            ids=torch.zeros(size, dtype=torch.long),
            positions=torch.zeros(size, dtype=torch.long, device=device),
            spans=(),  # the pooled decode path reads the device tensors only
            decode=True,
            slots=torch.full((size,), -1, dtype=torch.long, device=device),
        )
        self.graph = SegmentedGraph()
        self.logits: torch.Tensor | None = None

    def __call__(self, batch: StepBatch) -> torch.Tensor:
        # The embedding lookup stays outside the graph: the table may be in host RAM (as llama.cpp keeps it).
        self.x.copy_(self.model.embed_tokens(batch.ids))
        self.batch.positions.copy_(batch.positions)
        assert batch.slots is not None and self.batch.slots is not None
        self.batch.slots.copy_(batch.slots)
        if self.logits is None:
            self.logits = self.graph.capture(
                lambda: self.model.blocks_and_head(self.x, self.batch, self.pool), self.model.host_boundaries
            )
        self.graph.replay()
        return self.logits


class ModelRunner:
    """Runs steps of the model over the slots of a state pool."""

    def __init__(self, model: DecoderModel, pool: StatePool, graphs: bool = True) -> None:
        self.model, self.pool = model, pool
        self.capturable = graphs and _capturable(model)
        # a CPU step as ggml graphs, where they cover the model (a whole one: not a rank's under --tp)
        self.cpu_graph = StepGraph.create(model, pool) if model.reduce is None else None
        self._graphs: dict[int, DecodeGraph] = {}
        self._warm: set[int] = set()  # buckets run once eagerly: that run compiles what the capture records

    def captured(self, size: int = 1) -> DecodeGraph | None:
        """The captured decode step of `size` rows, once it has been captured."""
        graph = self._graphs.get(size)
        return graph if graph is not None and graph.logits is not None else None

    def run(self, pieces: Sequence[tuple[int, Sequence[int]]], all_logits: bool = False) -> torch.Tensor:
        """Advance each slot of `pieces` (slot, tokens) by its tokens, which follow the slot's cached ones. Returns
        logits [len(pieces), V] after each piece's last token, or with `all_logits` [tokens, V] of every token."""
        refresher = getattr(self.model, "expert_refresher", None)
        if refresher is not None:  # --moe-cache-refresh: between steps (weights/expert_cache.py)
            refresher.between_steps()
        caches = [self.pool.caches[slot] for slot, _ in pieces]
        for cache, (_, tokens) in zip(caches, pieces, strict=True):
            assert tokens, "a piece of a step has at least one token"
            cache.check_room(len(tokens))
            cache.check_order()
        at = [(slot, cache.length, tokens) for cache, (slot, tokens) in zip(caches, pieces, strict=True)]
        decode = not all_logits and all(len(tokens) == 1 for _, tokens in pieces)
        device = self.model.device
        if decode and self.capturable and len(pieces) <= DECODE_BUCKETS[-1]:
            size = DECODE_BUCKETS[bisect.bisect_left(DECODE_BUCKETS, len(pieces))]
            batch = StepBatch.build(at, device, pad_to=size)
            if size in self._warm:
                if size not in self._graphs:
                    self._graphs[size] = DecodeGraph(self.model, self.pool, size)
                logits = self._graphs[size](batch)
            else:
                logits = self.model.forward(batch, self.pool)
                self._warm.add(size)
            logits = logits[: len(pieces)]
        elif self.cpu_graph is not None:  # a CPU step as ggml graphs: no batch descriptor tensors to make
            logits = self.cpu_graph.run(at, all_logits)
        else:
            logits = self.model.forward(StepBatch.build(at, device, all_logits=all_logits), self.pool)
        for cache, (_, tokens) in zip(caches, pieces, strict=True):
            cache.advance(tokens)
        return logits
