"""One sequence's engine: feed tokens (reusing the cached prefix), get next-token logits."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tandem.layers.attention import Attention
from tandem.layers.delta_net import GatedDeltaNet
from tandem.layers.gated_attention import GatedAttention
from tandem.models.decoder import DecoderModel

# Mixers whose one-token step on a GPU keeps fixed shapes, reads positions from the device and updates its
# state in place, so it can be captured as a CUDA graph: attention stores K/V by a device index
# (kv_cache.LayerKV.store); the delta-net updates its conv and recurrent state with copy_ and leaves its
# position count to KVCache.captured_step / advance.
CAPTURABLE_MIXERS = (Attention, GatedAttention, GatedDeltaNet)


class Engine:
    """Owns a model and the KV cache of the current sequence; prefill runs in batches of n_batch."""

    def __init__(
        self, model: DecoderModel, n_ctx: int, cache_dtype: torch.dtype, n_batch: int = 512, graphs: bool = True
    ) -> None:
        self.model = model
        self.n_batch = n_batch
        self.cache = model.new_cache(n_ctx, cache_dtype, n_batch)
        self._decode_graph = self._graph_if_possible() if graphs else None
        self._warm = False

    def _graph_if_possible(self) -> Callable[[int], torch.Tensor] | None:
        """A captured decode step on a GPU when every layer's mixer is one of CAPTURABLE_MIXERS."""
        model = self.model
        if model.device.type != "cuda":
            return None
        if not all(type(b.mixer) in CAPTURABLE_MIXERS for b in model.blocks):
            return None
        from tandem.cuda.graphs import DecodeGraph

        return DecodeGraph(model, self.cache, model.host_boundaries)

    @property
    def context_full(self) -> bool:
        """Whether the sequence fills the context: nothing more can be appended."""
        return self.cache.length >= self.cache.n_ctx

    def reset(self) -> None:
        self.cache.truncate(0)

    def feed(self, ids: Sequence[int]) -> torch.Tensor:
        """Make the sequence equal to `ids` and return the logits [V] after its last token.

        The longest prefix already in the cache is kept (multi-turn chat does not recompute it);
        at least the last token is recomputed, since its logits are needed. Recurrent (linear-attention)
        state cannot be cut back to an arbitrary prefix: the cache falls back to its latest checkpoint
        below it (or to the start), and a checkpoint is taken before the last prompt token so that the
        next turn, which starts with this prompt, resumes there.
        """
        cached = self.cache.tokens
        keep = 0
        limit = min(len(cached), len(ids) - 1)
        while keep < limit and cached[keep] == ids[keep]:
            keep += 1
        self.cache.truncate(keep)
        start = self.cache.length  # <= keep with recurrent layers
        if self.cache.has_recurrent and start < len(ids) - 1:
            self.append(ids[start:-1])
            self.cache.checkpoint()
            return self.append(ids[-1:])
        return self.append(ids[start:])

    def append(self, ids: Sequence[int]) -> torch.Tensor:
        """Run new tokens after the cached ones; logits [V] after the last."""
        if len(ids) == 1 and self._decode_graph is not None:
            if self._warm:  # the first step runs eagerly: it compiles the kernels the capture will record
                self.cache.check_room(1)
                with self.cache.captured_step():  # no Python-side counting in what is captured ...
                    logits = self._decode_graph(ids[0])
                self.cache.advance(ids)  # ... it is done here, after every replay
                return logits
            self._warm = True
        logits = None
        for i in range(0, len(ids), self.n_batch):
            chunk = torch.tensor(ids[i : i + self.n_batch], dtype=torch.long)
            logits = self.model.forward(chunk, self.cache)
        assert logits is not None, "append() needs at least one token"
        return logits[-1]

    def all_logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Logits [T, V] at every position of a fresh sequence `ids`."""
        self.reset()
        out = []
        for i in range(0, len(ids), self.n_batch):
            chunk = torch.tensor(ids[i : i + self.n_batch], dtype=torch.long)
            out.append(self.model.forward(chunk, self.cache, all_logits=True))
        return torch.cat(out)
