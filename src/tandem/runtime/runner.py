"""The model runner: one step over a batch of sequences, then the step's tokens counted in their slots.

On a GPU a decode step (one token per sequence) is replayed as a CUDA graph captured per batch-size bucket
(split around the host ops of CPU experts, cuda/graphs.py); the batch is padded to its bucket with rows that
touch no state. Where the model has no host ops (every weight in VRAM), a step that is one sequence's full
prompt chunk (n_batch tokens) is replayed as a graph too, captured per power-of-two bound of the cache rows its
attention reads: eager, such a prefill is ~2,000-7,000 launches whose host time exceeds the GPU's. Every other
step runs eagerly."""

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


class CapturedStep:
    """A pooled step shaped like `template` with static inputs, captured on its first call and replayed after.
    `pool`: the graph memory pool it shares with other steps that never run at the same time (None: its own)."""

    def __init__(
        self, model: DecoderModel, state: StatePool, template: StepBatch, pool: tuple[int, int] | None = None
    ) -> None:
        from tandem.cuda.graphs import SegmentedGraph

        self.model, self.state = model, state
        self.x = torch.zeros(template.n_tokens, model.cfg.hidden, dtype=model.dtype, device=model.device)
        assert template.slots is not None
        self.batch = StepBatch(
            ids=template.ids,
            positions=template.positions.clone(),
            spans=(),  # the pooled paths read the device tensors only
            decode=template.decode,
            slots=template.slots.clone(),
            logit_rows=template.logit_rows,
            key_rows=template.key_rows,
        )
        self.graph = SegmentedGraph(pool)
        self.logits: torch.Tensor | None = None

    def capture(self) -> None:
        """Record the step (nothing runs: the state is untouched)."""
        self.logits = self.graph.capture(
            lambda: self.model.blocks_and_head(self.x, self.batch, self.state), self.model.host_boundaries
        )

    def __call__(self, batch: StepBatch) -> torch.Tensor:
        # The embedding lookup stays outside the graph: the table may be in host RAM (as llama.cpp keeps it).
        self.x.copy_(self.model.embed_tokens(batch.ids))
        self.batch.positions.copy_(batch.positions)
        assert batch.slots is not None and self.batch.slots is not None
        self.batch.slots.copy_(batch.slots)
        if self.logits is None:
            self.capture()
        self.graph.replay()
        return self.logits  # type: ignore[return-value]


class ModelRunner:
    """Runs steps of the model over the slots of a state pool."""

    def __init__(self, model: DecoderModel, pool: StatePool, graphs: bool = True) -> None:
        self.model, self.pool = model, pool
        self.capturable = graphs and _capturable(model)
        # prefill chunks too, where no host op splits the step: streamed experts (CPU ones) read the routing on
        # the host
        self.capturable_chunks = self.capturable and not model.host_boundaries
        # a CPU step as ggml graphs, where they cover the model (a whole one: not a rank's under --tp)
        self.cpu_graph = StepGraph.create(model, pool) if model.reduce is None else None
        self._graphs: dict[tuple[bool, int, int], CapturedStep] = {}  # (decode, rows, key rows) -> its graph
        self._warm: set[tuple[bool, int, int]] = set()  # run once eagerly: that compiles what the capture records
        # The graph memory every captured step shares: no two of them run at once, and a step's output is read
        # before the next step replays (a pool per bucket kept each bucket's working set reserved: as llama.cpp's
        # one compute buffer, the steps' largest is what stays)
        self._graph_pool: tuple[int, int] | None = None

    def captured(self, size: int = 1) -> CapturedStep | None:
        """The captured decode step of `size` rows, once it has been captured."""
        graph = self._graphs.get((True, size, 0))
        return graph if graph is not None and graph.logits is not None else None

    def captured_chunks(self) -> list[CapturedStep]:
        """The prompt-chunk steps captured so far."""
        return [g for (decode, _, _), g in self._graphs.items() if not decode and g.logits is not None]

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
            logits = self._step(StepBatch.build(at, device, pad_to=size))[: len(pieces)]
        elif self.capturable_chunks and not all_logits and len(pieces) == 1 and len(at[0][2]) == self.pool.n_batch:
            logits = self._step(StepBatch.chunk(*at[0], device))
        elif self.cpu_graph is not None:  # a CPU step as ggml graphs: no batch descriptor tensors to make
            logits = self.cpu_graph.run(at, all_logits)
        else:
            logits = self.model.forward(StepBatch.build(at, device, all_logits=all_logits), self.pool)
        for cache, (_, tokens) in zip(caches, pieces, strict=True):
            cache.advance(tokens)
        return logits

    def _step(self, batch: StepBatch) -> torch.Tensor:
        """A pooled step: eager the first time its shape comes, then replayed; a decode step is captured the second
        time (its first replay), a prompt chunk right after its eager run (prefill is what a benchmark's warm-up
        and a user's first prompt do once)."""
        key = (batch.decode, batch.n_tokens, batch.key_rows)
        if key in self._graphs:
            return self._graphs[key](batch)
        if batch.decode and key in self._warm:
            self._graphs[key] = CapturedStep(self.model, self.pool, batch, self._shared_graph_pool())
            return self._graphs[key](batch)
        self._warm.add(key)
        logits = self.model.forward(batch, self.pool)
        if not batch.decode:
            self._capture_chunk(key, batch)
        return logits

    def _shared_graph_pool(self) -> tuple[int, int]:
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        return self._graph_pool

    def _capture_chunk(self, key: tuple[bool, int, int], batch: StepBatch) -> None:
        """Capture a prompt chunk's step for its next replays. A model with an operation that cannot be captured
        (float experts read their routing on the host past 32 slots: cuda/weights.py DenseExperts) keeps its
        chunks eager."""
        # the blocks the eager chunk left in torch's cache go back to the driver: the graph's pool is about the
        # same working set, and both at once would be that much more VRAM
        torch.cuda.empty_cache()
        step = CapturedStep(self.model, self.pool, batch, self._shared_graph_pool())
        try:
            step.capture()
        except RuntimeError:  # torch.AcceleratorError: an operation not permitted while capturing
            self.capturable_chunks = False
            return
        self._graphs[key] = step
