"""Sampling, as llama.cpp's sampler chain: repetition penalty, top-k, top-p, min-p, temperature, then a draw;
temperature <= 0 means greedy (argmax).

Non-finite logits (NaN or infinity: corrupt weights, an overflow) are an error (`NonFiniteLogitsError`), in greedy
decoding too, never an arbitrary token. A temperature so small that logits / temperature overflow draws from the
distribution's limit (the most likely token, or one of the tied most likely ones), not from NaNs.

Every numeric option, of the API, the CLI or a server's request, is checked by `check_option` against one table
(OPTION_LIMITS), with a message naming the CLI flag.

After the penalty, the filters work on candidates, as llama.cpp's token array: the tokens still in play, most likely
first. Top-k takes its k from the vocabulary at once, a partial selection: a sort of every logit and masks over all
of them cost more than the forward pass with Gemma's 262,144 tokens on a small CPU. Without
top-k, top-p widens its selection until it holds the mass it keeps. The draw is over the candidates
left, with the probabilities the masked full-vocabulary chain gives them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tandem.errors import TandemError


class NonFiniteLogitsError(TandemError):
    """The model computed NaN or infinite logits."""


@dataclass(frozen=True)
class Limit:
    """The values an option may take (inclusive bounds), and the CLI flag that gives it."""

    flag: str
    lo: float
    hi: float
    integer: bool = True


# Far above any sensible value, so that a typo or an attack is refused before it allocates (a 10^12-token KV cache,
# 10^5 OpenMP threads) or overflows (a seed past torch's 64 bits).
OPTION_LIMITS: dict[str, Limit] = {
    "temperature": Limit("--temp", -1e9, 1e9, integer=False),
    "top_k": Limit("--top-k", -(2**31), 2**31 - 1),
    "top_p": Limit("--top-p", 0.0, 1.0, integer=False),
    "min_p": Limit("--min-p", 0.0, 1.0, integer=False),
    "repeat_penalty": Limit("--repeat-penalty", 1e-9, 1e9, integer=False),
    "repeat_last_n": Limit("--repeat-last-n", -1, 2**31 - 1),
    "presence_penalty": Limit("--presence-penalty", -2.0, 2.0, integer=False),  # OpenAI's range
    "frequency_penalty": Limit("--frequency-penalty", -2.0, 2.0, integer=False),
    "seed": Limit("-s/--seed", -(2**63), 2**64 - 1),  # what torch.Generator.manual_seed takes
    "max_tokens": Limit("-n/--n-predict", -1, 2**31 - 1),
    "n_ctx": Limit("-c/--ctx-size", 1, 1 << 24),
    "n_batch": Limit("-b/--batch-size", 1, 1 << 20),
    "n_ubatch": Limit("-ub/--ubatch-size", 1, 1 << 20),
    "n_parallel": Limit("-np/--parallel", 1, 32),  # the largest decode graph (runtime/runner.py DECODE_BUCKETS)
    "threads": Limit("-t", -(2**31), 512),  # ggml's GGML_MAX_N_THREADS; 0 and negatives: api.resolve_threads
    "pcie_experts": Limit("--pcie-experts", 0, 1 << 16),
    "n_cpu_moe": Limit("--n-cpu-moe", 0, 2**31 - 1),
}


def check_option(name: str, value: object) -> None:
    """`value` is a number within OPTION_LIMITS[name] (an integer where it must be), else a one-line TandemError
    naming the option and its flag."""
    limit = OPTION_LIMITS[name]
    what = f"{name} ({limit.flag})"
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or (limit.integer and not isinstance(value, int)):
        raise TandemError(f"{what} must be {'an integer' if limit.integer else 'a number'}, got {value!r}")
    assert isinstance(value, (int, float))
    if not math.isfinite(value):
        raise TandemError(f"{what} must be finite, got {value}")
    if value < limit.lo:
        bound = "positive" if limit.lo == 1 and limit.integer else f">= {limit.lo:g}"
        raise TandemError(f"{what} must be {bound}, got {value}")
    if value > limit.hi:
        raise TandemError(f"{what} must be at most {limit.hi:g}, got {value}")


@dataclass(frozen=True)
class SamplingParams:
    """llama.cpp's defaults; `seed=None` (or -1, llama.cpp's and Ollama's "random") draws a fresh seed; `top_k` <= 0
    keeps every token, as llama.cpp's."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
                     "frequency_penalty"):  # fmt: skip
            check_option(name, getattr(self, name))
        if self.seed == -1:
            object.__setattr__(self, "seed", None)
        if self.seed is not None:
            check_option("seed", self.seed)
        if not 0.0 < self.top_p <= 1.0:
            raise TandemError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise TandemError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repeat_penalty <= 0.0:
            raise TandemError(f"repeat_penalty must be > 0, got {self.repeat_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalizes(self) -> bool:
        return self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def penalize_repeats(logits: torch.Tensor, history: Sequence[int], p: SamplingParams) -> torch.Tensor:
    """llama.cpp's penalties sampler over the tokens seen in the last `repeat_last_n` (all with 0): each one's
    logit divided (if positive, else multiplied) by the repeat penalty, then lowered by count * frequency_penalty
    + presence_penalty (count: its occurrences there)."""
    recent = history[-p.repeat_last_n :] if p.repeat_last_n > 0 else history
    if not recent:
        return logits
    counts = Counter(recent)
    ids = torch.tensor(sorted(counts), dtype=torch.long, device=logits.device)
    seen = logits[ids]
    seen = torch.where(seen > 0, seen / p.repeat_penalty, seen * p.repeat_penalty)
    if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
        n = torch.tensor([counts[i] for i in sorted(counts)], dtype=torch.float32, device=logits.device)
        seen = seen - n * p.frequency_penalty - p.presence_penalty
    logits = logits.clone()
    logits[ids] = seen
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
        probs = torch.softmax(values / p.temperature, dim=0)
        if not bool(torch.isfinite(probs).all()):  # logits / temperature overflowed: the limit, the top ones alike
            top = (values == values.max()).float()
            probs = top / top.sum()
        return probs, ids

    def __call__(self, logits: torch.Tensor, history: Sequence[int]) -> int:
        logits = logits.float()
        if not bool(torch.isfinite(logits).all()):
            bad = int((~torch.isfinite(logits)).sum())
            raise NonFiniteLogitsError(
                f"the model computed {bad} non-finite logits (NaN or infinity) of {logits.numel()}: its weights are "
                "corrupt or its activations overflowed"
            )
        if self.params.penalizes:
            logits = penalize_repeats(logits, history, self.params)
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


def sample_rows(samplers: Sequence[Sampler], logits: torch.Tensor, histories: Sequence[Sequence[int]]) -> list[int]:
    """Each row's next token, row i of logits [B, V] drawn by samplers[i] after histories[i]: what each sampler
    gives alone, with the plain greedy rows (no penalties) picked together, one argmax over those rows and one
    transfer for the step instead of two host syncs per row."""
    plain = [s.params.greedy and not s.params.penalizes for s in samplers]
    picked: dict[int, int] = {}
    if any(plain):
        rows = [i for i, p in enumerate(plain) if p]
        block = (logits if len(rows) == len(samplers) else logits[rows]).float()
        if block.is_cuda:
            finite, best = torch.stack([torch.isfinite(block).all(dim=1).long(), torch.argmax(block, dim=1)]).tolist()
        else:  # numpy's argmax over a 262k vocabulary takes a twentieth of torch's CPU one (both: the first maximum)
            values = block.numpy()
            finite, best = np.isfinite(values).all(axis=1).tolist(), values.argmax(axis=1).tolist()
        picked = {i: token for i, token, ok in zip(rows, best, finite, strict=True) if ok}
    # The others, and a plain row with a non-finite logit (its sampler raises the error naming it).
    return [picked[i] if i in picked else sampler(logits[i], histories[i]) for i, sampler in enumerate(samplers)]
