"""The CPU step as ggml graphs: a whole step of a decoder model (every sequence of the batch) computed by one ggml
graph instead of layer by layer through torch and small ggml calls (models/decoder.py).

`StepGraph.create(model, pool)` gives the runner a callable from a `StepBatch` to the step's logits, or None where
the graphs do not cover the model (`coverage.unsupported`) or are switched off: `TANDEM_CPU_GRAPH=0` (for
comparisons; unset or "1", on for every model they cover). The graphs multiply a MoE model's expert stacks as
the layer path holds them: ggml's repacked copies of the Q4_K ones, which the loader makes by default where the
whole model is on the CPU, as llama.cpp's CPU backend does (weights/repack.py), else the file's blocks.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import torch

from tandem.errors import TandemError
from tandem.models.cpu_graph.coverage import routed_branches, unsupported
from tandem.models.cpu_graph.decoder import StepProgram, build_step
from tandem.models.cpu_graph.ggml_graph import GraphRunner
from tandem.models.cpu_graph.step import CacheCopies, Pieces, StepKey, attention_kinds, sliding_ring, step_key
from tandem.models.decoder import DecoderModel
from tandem.quant import flash_attention as flash_kernel
from tandem.state.batch import StepBatch
from tandem.state.kv_cache import KVPool
from tandem.state.pool import StatePool

__all__ = ["FLASH_ENV", "SWITCH_ENV", "StepGraph", "enabled", "flash_attention"]

SWITCH_ENV = "TANDEM_CPU_GRAPH"
# How the graphs compute attention (docs/FLAGS.md): "auto" (unset), as llama.cpp's CPU default (-fa auto: on) with
# an f16 cache, ggml's flash-attention node, and in float32 with an f32 cache (llama.cpp's would cast it to f16);
# "1"/"on": the flash-attention node always; "0"/"off": llama.cpp's graph without flash attention (-fa off).
FLASH_ENV = "TANDEM_CPU_FLASH_ATTN"
_MAX_PROGRAMS = 8  # step shapes kept: decode moves to a new one every KV_PAD positions


def enabled() -> bool:
    """Whether the switch asks for graphs (they still need to cover the model): unless it is set to "0" or empty.
    Every family's tests against llama.cpp or transformers pass this way, and a benchmark of each showed it faster
    than the layer path (docs/PERFORMANCE.md)."""
    value = os.environ.get(SWITCH_ENV)
    return value is None or value.strip() not in ("", "0")


def flash_attention(pool: StatePool) -> bool:
    """Whether the graphs of `pool`'s steps compute attention as ggml's flash-attention node (FLASH_ENV)."""
    setting = os.environ.get(FLASH_ENV, "auto").strip().lower() or "auto"
    if setting not in ("auto", "1", "on", "0", "off"):
        raise TandemError(f"{FLASH_ENV}={setting!r}: expected auto, on (1) or off (0)")
    if setting == "auto":
        return all(layer.k.dtype == torch.float16 for layer in pool.layers if isinstance(layer, KVPool))
    return setting in ("1", "on")


class StepGraph:
    """Runs steps of `model` over the slots of `pool` as ggml graphs, one program per step shape (kept, least
    recently used out). Returns the logits [B, V] of the batch's logit rows (every row when it names none)."""

    def __init__(self, model: DecoderModel, pool: StatePool) -> None:
        kernels = model.embed.kernels
        assert kernels is not None
        self.model, self.pool = model, pool
        self.kinds = attention_kinds(model)
        # per layer: an attention layer's cache as the graphs read it, or a delta-net's state pool as it is
        self.caches = [CacheCopies.of(layer) if isinstance(layer, KVPool) else layer for layer in pool.layers]
        self._rows = next(((c.rows, c.columns) for c in self.caches if isinstance(c, CacheCopies)), (0, 0))
        # per routed branch, keyed by its id: its experts as the layer path's ggml graph describes them
        self.experts = {id(r): r.experts._graph[1] for r in routed_branches(model)}
        self.runner = GraphRunner(kernels)
        self.flash = flash_attention(pool)
        if self.flash:  # at load: a bad TANDEM_CPU_FLASH_KERNEL is an error here, and the kernel is built here
            flash_kernel.available()
        self.rings = [sliding_ring(w, pool.n_ctx, pool.n_batch) for w in self.kinds]
        self._programs: OrderedDict[StepKey, StepProgram] = OrderedDict()

    @classmethod
    def create(cls, model: DecoderModel, pool: StatePool, force: bool | None = None) -> StepGraph | None:
        """The graphs of this model's CPU steps, or None: not covered, or switched off (`force` overrides the
        switch)."""
        wanted = enabled() if force is None else force
        if not wanted or unsupported(model, pool) is not None:
            return None
        return cls(model, pool)

    def __call__(self, batch: StepBatch) -> torch.Tensor:
        """The step of a batch descriptor (its logit rows: each sequence's last, or every row)."""
        ids = batch.ids.tolist()
        pieces = [(s.slot, s.start, ids[s.rows]) for s in batch.spans]
        return self.run(pieces, all_logits=batch.logit_rows is None)

    def run(self, pieces: Pieces, all_logits: bool = False) -> torch.Tensor:
        """The step of `pieces` (slot, position of the first token, token ids) per sequence, which follow the
        slots' cached tokens: logits [B, V] after each piece's last token, or [T, V] of every token with
        `all_logits` (decoding, every row is a piece's last)."""
        key = step_key(pieces, self.kinds, all_logits, self.flash, self.rings)
        step = self._programs.get(key)
        if step is None:
            step = build_step(self.model, self.caches, key, self.experts, self.runner.kernels.n_threads)
            self._programs[key] = step
            while len(self._programs) > _MAX_PROGRAMS:
                self._programs.popitem(last=False)
        else:
            self._programs.move_to_end(key)
        step.inputs.fill(pieces, key, self.kinds, *self._rows)
        n_logits = key.n_tokens if key.n_logits is None else key.n_logits
        logits = torch.empty(n_logits, self.model.cfg.n_vocab, dtype=torch.float32)
        step.logits.data = logits.data_ptr()
        self.runner.run(step.program)
        return logits

    def close(self) -> None:
        self._programs.clear()
        self.runner.close()
