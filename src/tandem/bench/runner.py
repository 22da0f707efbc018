"""`tandem bench`: prefill (pp) and decode (tg) tokens/s, the median of several repetitions; with --concurrency,
the engine's throughput with N sequences at once."""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from tandem.api import LLM
from tandem.runtime.sampling import Sampler, SamplingParams


@dataclass(frozen=True)
class BenchResult:
    model: str
    arch: str
    device: str
    threads: int
    pp_tokens: int
    tg_tokens: int
    reps: int
    load_s: float
    pp_tok_s: float
    tg_tok_s: float
    peak_rss_bytes: int

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def time_prefill_decode(llm: LLM, pp: int, tg: int, seed: int) -> tuple[float, float]:
    """Seconds to prefill `pp` random tokens, and to then decode `tg` tokens one at a time."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, llm.config.n_vocab, (pp,), generator=gen).tolist()
    engine = llm.engine
    engine.reset()
    start = time.perf_counter()
    logits = engine.append(prompt)
    sync_device(logits)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(tg):
        logits = engine.append([int(torch.argmax(logits))])
    sync_device(logits)
    decode_s = time.perf_counter() - start
    return prefill_s, decode_s


def sync_device(t: torch.Tensor) -> None:
    """Wait for the device: CUDA work is asynchronous, a timer must not stop before it ends."""
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def run_bench(llm: LLM, model_name: str, load_s: float, pp: int, tg: int, reps: int, seed: int = 0) -> BenchResult:
    """Warm up once, then time `reps` repetitions (prompt seeds seed, seed + 1, ...) and report the medians."""
    time_prefill_decode(llm, min(pp, 16), min(tg, 4), seed=-1 % 2**31)
    prefill, decode = [], []
    for rep in range(reps):
        p, d = time_prefill_decode(llm, pp, tg, seed=seed + rep)
        prefill.append(p)
        decode.append(d)
    return BenchResult(
        model=model_name,
        arch=llm.config.arch,
        device=str(llm.plan.compute_device),
        threads=llm.threads,
        pp_tokens=pp,
        tg_tokens=tg,
        reps=reps,
        load_s=load_s,
        pp_tok_s=pp / statistics.median(prefill),
        tg_tok_s=tg / statistics.median(decode),
        peak_rss_bytes=peak_rss_bytes(),
    )


@dataclass(frozen=True)
class ConcurrentResult:
    """N sequences of pp prompt tokens and tg generated tokens each, admitted together: prefill tok/s (every
    prompt token over the time until every sequence has its first token), aggregate decode tok/s (the tokens
    after the first over the time from then until the last sequence ends) and per stream (aggregate / N)."""

    n_seqs: int
    pp_tokens: int
    tg_tokens: int
    pp_tok_s: float
    tg_tok_s: float
    tg_tok_s_per_stream: float


def time_concurrent(llm: LLM, n: int, pp: int, tg: int, seed: int) -> tuple[float, float]:
    """Seconds for `n` prompts of `pp` random tokens to get their first token, and for `tg - 1` more each."""
    gen = torch.Generator().manual_seed(seed)
    engine = llm.engine
    for cache in engine.pool.caches:  # no prefix reuse across repetitions
        cache.truncate(0)
    prompts = [torch.randint(0, llm.config.n_vocab, (pp,), generator=gen).tolist() for _ in range(n)]
    start = time.perf_counter()
    seqs = [engine.add_request(p, Sampler(SamplingParams(temperature=0.0)), tg, frozenset()) for p in prompts]
    while not all(s.n_output for s in seqs):
        engine.step()
    first = time.perf_counter()
    while engine.has_work:
        engine.step()
    end = time.perf_counter()
    assert all(s.n_output == tg for s in seqs), "a sequence ended early"
    return first - start, end - first


def run_concurrent(llm: LLM, sizes: list[int], pp: int, tg: int, reps: int, seed: int = 0) -> list[ConcurrentResult]:
    """Per size N (at most the engine's slots): a warm-up (it captures the decode graph of N rows), then the
    medians of `reps` repetitions."""
    results = []
    for n in sizes:
        time_concurrent(llm, n, min(pp, 16), min(tg, 4), seed=-1 % 2**31)
        prefill, decode = [], []
        for rep in range(reps):
            p, d = time_concurrent(llm, n, pp, tg, seed=seed + rep)
            prefill.append(p)
            decode.append(d)
        aggregate = n * (tg - 1) / statistics.median(decode)
        results.append(ConcurrentResult(n, pp, tg, n * pp / statistics.median(prefill), aggregate, aggregate / n))
    return results
