"""The decoder-only transformer every supported architecture is an instance of.

Shapes: T = tokens in this step (of every sequence in it), D = hidden, V = vocabulary.
"""

from __future__ import annotations

import torch

from tandem.layers.linear import Linear
from tandem.layers.norm import rms_norm
from tandem.layers.parallel import Reduce
from tandem.models.blocks import BlockBuilder, RopeCache, standard_block
from tandem.models.config import ModelConfig
from tandem.state.batch import StepBatch
from tandem.state.pool import StatePool
from tandem.weights.expert_cache import ExpertCacheRefresher
from tandem.weights.loader import QuantEmbedding, WeightLoader


class DecoderModel:
    """Embedding, blocks, final norm and output head, built from a WeightLoader.

    Under --tp, `cfg` and the loader are one rank's (its share of the heads, its slices of the weights) and `reduce`
    sums each block's partial outputs over the ranks (docs/TENSOR_PARALLEL.md); the embedding and the head are whole
    on every rank."""

    def __init__(
        self,
        cfg: ModelConfig,
        loader: WeightLoader,
        build_block: BlockBuilder = standard_block,
        reduce: Reduce | None = None,
    ) -> None:
        self.cfg = cfg
        self.reduce = reduce
        self.device = loader.compute_device
        self.dtype = loader.act_dtype  # of the hidden state
        self.embed: QuantEmbedding = loader.embedding("token_embd.weight")
        self.output_norm = loader.vector("output_norm.weight")
        # every layer's expert picks (--expert-stats), or None
        self.routing_counts = getattr(loader, "routing_counts", None)
        self.expert_refresher: ExpertCacheRefresher | None = None  # --moe-cache-refresh, run between steps
        # Tied embeddings: the output head reads the embedding table when there is no `output`.
        head = "output.weight" if loader.has("output.weight") else "token_embd.weight"
        self.output: Linear = loader.linear(head)
        ropes = RopeCache()
        self.ropes = ropes
        self.blocks = [build_block(cfg, i, spec, loader, ropes) for i, spec in enumerate(cfg.layers)]
        if reduce is not None:
            for block in self.blocks:
                block.reduce_with(reduce)
        self.host_boundaries = list(loader.host_boundaries)  # where a captured decode step must run host code

    @torch.inference_mode()
    def forward(self, batch: StepBatch, pool: StatePool) -> torch.Tensor:
        """Run one step over the sequences of `batch` (their states in `pool`): logits [rows, V] of the batch's
        logit rows (each sequence's last token, or every token). The caller counts the tokens in the caches."""
        return self.blocks_and_head(self.embed_tokens(batch.ids), batch, pool)

    @torch.inference_mode()
    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, D] on the compute device (the table may live in host RAM)."""
        return self.embed(ids) * self.cfg.embed_scale

    @torch.inference_mode()
    def blocks_and_head(self, x: torch.Tensor, batch: StepBatch, pool: StatePool) -> torch.Tensor:
        """From embeddings x [T, D] to logits: a decode step on a GPU reads positions and slots from the device
        and has fixed shapes, so it can be captured as a CUDA graph."""
        if self.routing_counts is not None:  # the padding rows of a pooled step are not counted
            self.routing_counts.begin_step(x.shape[0], batch.slots)
        for block, layer_pool in zip(self.blocks, pool.layers, strict=True):
            x = block(x, batch, layer_pool)
        if batch.logit_rows is not None:
            x = x.index_select(0, batch.logit_rows)
        logits = self.output(rms_norm(x, self.output_norm, self.cfg.rms_eps)).float()  # [rows, V]
        if self.cfg.final_logit_softcap is not None:
            cap = self.cfg.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def new_pool(self, n_slots: int, n_ctx: int, dtype: torch.dtype, n_batch: int) -> StatePool:
        """Fresh state of `n_slots` sequences on the compute device for steps of at most n_batch tokens each:
        each block's mixer allocates what it needs."""
        for rope in self.ropes.values():
            rope.reserve(n_ctx, self.device)
        layers = [b.mixer.new_state(n_slots, n_ctx, dtype, self.device, n_batch) for b in self.blocks]
        return StatePool.of_layers(layers, n_slots, n_ctx, n_batch)
