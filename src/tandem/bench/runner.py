"""`tandem bench`: prefill (pp) and decode (tg) tokens/s, the median of several repetitions."""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from tandem.api import LLM


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
    _sync(logits)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(tg):
        logits = engine.append([int(torch.argmax(logits))])
    _sync(logits)
    decode_s = time.perf_counter() - start
    return prefill_s, decode_s


def _sync(t: torch.Tensor) -> None:
    """Wait for the device: CUDA work is asynchronous, a timer must not stop before it ends."""
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def run_bench(llm: LLM, model_name: str, load_s: float, pp: int, tg: int, reps: int) -> BenchResult:
    """Warm up once, then time `reps` repetitions and report the medians."""
    time_prefill_decode(llm, min(pp, 16), min(tg, 4), seed=-1 % 2**31)
    prefill, decode = [], []
    for rep in range(reps):
        p, d = time_prefill_decode(llm, pp, tg, seed=rep)
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
