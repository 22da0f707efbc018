"""Sampling, composed from small steps as in llama.cpp's sampler chain.

Order: repetition penalty, top-k, top-p, min-p, temperature, then a draw. A step with nothing to
do is left out of the chain; temperature <= 0 means greedy (argmax).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tandem.errors import TandemError

LogitStep = Callable[[torch.Tensor, Sequence[int]], torch.Tensor]


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


def repetition_penalty(penalty: float, last_n: int) -> LogitStep:
    """Divide positive (multiply negative) logits of tokens seen in the last `last_n` tokens."""

    def step(logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        recent = history[-last_n:] if last_n > 0 else history
        if not recent:
            return logits
        ids = torch.tensor(sorted(set(recent)), dtype=torch.long)
        seen = logits[ids]
        logits = logits.clone()
        logits[ids] = torch.where(seen > 0, seen / penalty, seen * penalty)
        return logits

    return step


def top_k(k: int) -> LogitStep:
    def step(logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        if k >= logits.numel():
            return logits
        threshold = torch.topk(logits, k).values[-1]
        return logits.masked_fill(logits < threshold, float("-inf"))

    return step


def top_p(p: float) -> LogitStep:
    """Keep the smallest set of most likely tokens whose probability reaches p."""

    def step(logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= p  # mass before this token already >= p
        drop[0] = False
        return logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))

    return step


def min_p(p: float) -> LogitStep:
    """Drop tokens whose probability is below p times the most likely token's."""

    def step(logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        probs = torch.softmax(logits, dim=-1)
        return logits.masked_fill(probs < p * probs.max(), float("-inf"))

    return step


class Sampler:
    """Picks the next token from a logits vector [V] given the token history."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        steps: list[LogitStep] = []
        if params.repeat_penalty != 1.0:
            steps.append(repetition_penalty(params.repeat_penalty, params.repeat_last_n))
        if not params.greedy:
            if params.top_k > 0:
                steps.append(top_k(params.top_k))
            if params.top_p < 1.0:
                steps.append(top_p(params.top_p))
            if params.min_p > 0.0:
                steps.append(min_p(params.min_p))
        self.steps = steps
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

    def __call__(self, logits: torch.Tensor, history: Sequence[int]) -> int:
        logits = logits.float()
        for step in self.steps:
            logits = step(logits, history)
        if self.params.greedy:
            return int(torch.argmax(logits).item())
        probs = torch.softmax(logits / self.params.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self._generator(probs.device)).item())
