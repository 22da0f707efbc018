"""The decoder-only transformer every supported architecture is an instance of.

Shapes: T = tokens in this step, D = hidden, V = vocabulary.
"""

from __future__ import annotations

import torch

from tandem.layers.linear import Linear
from tandem.layers.norm import rms_norm
from tandem.models.blocks import BlockBuilder, RopeCache, standard_block
from tandem.models.config import ModelConfig
from tandem.runtime.kv_cache import KVCache
from tandem.runtime.loader import QuantEmbedding, WeightLoader


class DecoderModel:
    """Embedding, blocks, final norm and output head, built from a WeightLoader."""

    def __init__(self, cfg: ModelConfig, loader: WeightLoader, build_block: BlockBuilder = standard_block) -> None:
        self.cfg = cfg
        self.device = loader.compute_device
        self.dtype = loader.act_dtype  # of the hidden state
        self.embed: QuantEmbedding = loader.embedding("token_embd.weight")
        self.output_norm = loader.vector("output_norm.weight")
        # Tied embeddings: the output head reads the embedding table when there is no `output`.
        head = "output.weight" if loader.has("output.weight") else "token_embd.weight"
        self.output: Linear = loader.linear(head)
        ropes = RopeCache()
        self.ropes = ropes
        self.blocks = [build_block(cfg, i, spec, loader, ropes) for i, spec in enumerate(cfg.layers)]
        self.host_boundaries = list(loader.host_boundaries)  # where a captured decode step must run host code

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: KVCache, all_logits: bool = False) -> torch.Tensor:
        """Run tokens `ids` [T] after the cache's current length; logits [T, V] or [1, V] (last only)."""
        t = ids.shape[0]
        cache.check_room(t)
        start = cache.length
        positions = torch.arange(start, start + t, device=self.device)
        logits = self.step(ids, positions, cache, start, all_logits)
        cache.length += t
        cache.tokens.extend(ids.tolist())
        return logits

    @torch.inference_mode()
    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, D] on the compute device (the table may live in host RAM)."""
        return self.embed(ids) * self.cfg.embed_scale

    @torch.inference_mode()
    def step(
        self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, start: int, all_logits: bool = False
    ) -> torch.Tensor:
        """The computation of `forward`, without the cache bookkeeping."""
        return self.blocks_and_head(self.embed_tokens(ids), positions, cache, start, all_logits)

    @torch.inference_mode()
    def blocks_and_head(
        self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, start: int, all_logits: bool = False
    ) -> torch.Tensor:
        """From embeddings x [T, D] to logits: with one token on a GPU this reads positions from the
        device and has fixed shapes, so it can be captured as a CUDA graph."""
        for block, kv in zip(self.blocks, cache.layers, strict=True):
            x = block(x, positions, kv, start)
        if not all_logits:
            x = x[-1:]
        logits = self.output(rms_norm(x, self.output_norm, self.cfg.rms_eps)).float()  # [T, V]
        if self.cfg.final_logit_softcap is not None:
            cap = self.cfg.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits

    def new_cache(self, n_ctx: int, dtype: torch.dtype, n_batch: int) -> KVCache:
        """Fresh sequence state on the compute device for steps of at most n_batch tokens: each block's mixer
        allocates what it needs."""
        for rope in self.ropes.values():
            rope.reserve(n_ctx, self.device)
        states = [b.mixer.new_state(n_ctx, dtype, self.device, n_batch) for b in self.blocks]
        return KVCache(layers=states, n_ctx=n_ctx)
