"""Sampling, as llama.cpp's sampler chain: repetition penalty, top-k, top-p, min-p, temperature, then a draw;
temperature <= 0 means greedy (argmax).

After the penalty, the filters work on candidates, as llama.cpp's token array: the tokens still in play, most likely
first. Top-k takes its k from the vocabulary at once, a partial selection: a sort of every logit and masks over all
of them cost 23 ms per token with Gemma's 262,144 tokens on a 2-core CPU, more than the forward pass. Without
top-k, top-p widens its selection until it holds the mass it keeps. The draw is over the candidates
left, with the probabilities the masked full-vocabulary chain gives them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.errors import TandemError


@dataclass(frozen=True)
class SamplingParams:
    """llama.cpp's defaults; `seed=None` draws a fresh seed."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.top_k < 0:
            raise TandemError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise TandemError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise TandemError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repeat_penalty <= 0.0:
            raise TandemError(f"repeat_penalty must be > 0, got {self.repeat_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def penalize_repeats(logits: torch.Tensor, history: Sequence[int], penalty: float, last_n: int) -> torch.Tensor:
    """Divide positive (multiply negative) logits of tokens seen in the last `last_n` tokens (all with 0)."""
    recent = history[-last_n:] if last_n > 0 else history
    if not recent:
        return logits
    ids = torch.tensor(sorted(set(recent)), dtype=torch.long, device=logits.device)
    seen = logits[ids]
    logits = logits.clone()
    logits[ids] = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits


def largest(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits and their token ids, most likely first, ties to the lower id, as a partial selection.
    torch.topk orders (and at the k-th value, picks) tied logits as it likes on a GPU, where a bf16 model's
    logits tie often: a seed would not repeat its tokens there."""
    values, ids = torch.topk(logits, k, sorted=False)
    threshold = values.min()
    if int((logits == threshold).sum()) > int((values == threshold).sum()):  # the cut splits a tie: its lowest ids
        above = values > threshold
        ties = torch.nonzero(logits == threshold).flatten()[: k - int(above.sum())]
        ids = torch.cat([ids[above], ties])
        values = logits[ids]
    by_id = torch.argsort(ids)
    values, ids = values[by_id], ids[by_id]
    by_value = torch.sort(values, descending=True, stable=True).indices  # equal values keep their ascending ids
    return values[by_value], ids[by_value]


def top_p_candidates(logits: torch.Tensor, k: int, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Of the `k` most likely tokens (k = the vocabulary: all), the smallest most-likely-first set whose
    probability (normalised over those k) reaches p: (logits, ids), most likely first."""
    vocab = logits.numel()
    if k < vocab:
        values, ids = largest(logits, k)
        log_total = torch.logsumexp(values, dim=0)
    else:  # no top-k: take more of the sorted vocabulary until the mass it holds reaches p
        log_total = torch.logsumexp(logits, dim=0)
        m = min(vocab, 256)
        while True:
            values, ids = largest(logits, m)
            if m == vocab or float(torch.exp(values.double() - log_total.double()).sum()) >= p:
                break
            m = min(vocab, 16 * m)
    probs = torch.exp(values.double() - log_total.double())  # double: a float cumsum of 262,144 drifts by ~1e-5
    before = torch.cumsum(probs, dim=0) - probs  # the mass of the tokens ahead of each one
    n = max(1, int((before < p).sum()))
    return values[:n], ids[:n]


class Sampler:
    """Picks the next token from a logits vector [V] given the token history."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()
        # The draw runs where the logits are, and torch draws only with a generator of that device: one per
        # device, seeded like the CPU's (the same seed gives the same tokens on one device, not across them).
        self._generators = {torch.device("cpu"): self.generator}

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device)
            generator.manual_seed(self.generator.initial_seed())  # the seed given, or the one drawn above
        return generator

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(probabilities, token ids) of the draw from `logits` (after the repetition penalty): the tokens top-k,
        top-p and min-p leave (most likely first, except with neither top-k nor top-p), with their probabilities
        at the temperature (not greedy)."""
        p = self.params
        vocab = logits.numel()
        k = p.top_k if 0 < p.top_k < vocab else vocab
        if p.top_p < 1.0:
            values, ids = top_p_candidates(logits, k, p.top_p)
        elif k < vocab:
            values, ids = largest(logits, k)
        else:  # no top-k, no top-p: the whole vocabulary, in its own order
            values, ids = logits, torch.arange(vocab, device=logits.device)
        if p.min_p > 0.0:  # probability at least min_p times the most likely token's
            keep = values >= values.max() + math.log(p.min_p)
            values, ids = values[keep], ids[keep]
        return torch.softmax(values / p.temperature, dim=0), ids

    def __call__(self, logits: torch.Tensor, history: Sequence[int]) -> int:
        logits = logits.float()
        if self.params.repeat_penalty != 1.0:
            logits = penalize_repeats(logits, history, self.params.repeat_penalty, self.params.repeat_last_n)
        if self.params.greedy:
            return int(torch.argmax(logits).item())
        probs, ids = self.candidates(logits)
        # Drawn in token order, as over the whole vocabulary: logits moved by rounding (the same prompt through
        # another path, e.g. its cached prefix) then move the draw's boundaries by as little. In likelihood order,
        # two near-equal candidates trading places would move every boundary between them by a whole probability.
        ids, order = torch.sort(ids)
        probs = probs[order]
        pick = torch.multinomial(probs, 1, generator=self._generator(probs.device))
        return int(ids[pick].item())
