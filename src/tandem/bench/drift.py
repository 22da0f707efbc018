"""`tandem bench --drift N`: decode speed along a text whose hot experts change, window by window.

A model written by `tandem synth --routing zipf:S,drift:P` routes the tokens of each phase (a token id range) by a
ranking of its own. In plain decode the model picks its own tokens, so the bench feeds a scripted stream instead
(teacher-forced decode): a prompt of phase 0, then one scripted token per step, waited for as decode waits for its
sampled token, moving to the next phase every N tokens. The decode tok/s of every window of W tokens then shows
the drop after each switch and how fast online re-placement (`--moe-cache-refresh`) recovers from it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

from tandem.api import LLM
from tandem.bench.runner import sync_device
from tandem.errors import TandemError
from tandem.synth.routing import drifting_text, parse_routing

ROUTING_KEY = "tandem.synth.routing"  # written by tandem synth


@dataclass(frozen=True)
class DriftWindow:
    start: int  # the first decoded token of the window (0: the first after the prompt)
    tokens: int
    phase: int  # of every token of the window
    tok_s: float  # the median over the repetitions


@dataclass(frozen=True)
class DriftResult:
    model: str
    routing: str
    every: int  # tokens per phase
    window: int
    pp_tokens: int
    tg_tokens: int
    reps: int
    windows: tuple[DriftWindow, ...]

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def model_phases(llm: LLM) -> tuple[str, int]:
    """The routing spec the file was written with and its phase count; TandemError unless it drifts."""
    spec = llm.file.metadata.get(ROUTING_KEY)
    phases = parse_routing(str(spec)).phases if spec is not None else 1
    if phases < 2:
        raise TandemError(f"--drift needs a model written by `tandem synth --routing zipf:S,drift:P` (this one: "
                          f"{spec or 'no synth routing'})")  # fmt: skip
    return str(spec), phases


def drift_tokens(n_vocab: int, phases: int, pp: int, tg: int, every: int, seed: int) -> tuple[list[int], list[int]]:
    """The prompt (`pp` tokens of phase 0) and the scripted decode tokens (`tg`, the phase moving on every `every`
    tokens, phase 0 first)."""
    prompt = drifting_text(n_vocab, phases, pp, pp, seed)
    return prompt, drifting_text(n_vocab, phases, tg, every, seed + 1)


def time_scripted_decode(llm: LLM, prompt: list[int], script: list[int], window: int) -> list[float]:
    """Prefill `prompt`, then append the `script` tokens one per step; the seconds of each `window` steps."""
    engine = llm.engine
    engine.reset()
    sync_device(engine.append(prompt))
    seconds = []
    start = time.perf_counter()
    for i, token in enumerate(script, 1):
        sync_device(engine.append([token]))  # each step waited for, as decode waits to read its token
        if i % window == 0 or i == len(script):
            now = time.perf_counter()
            seconds.append(now - start)
            start = now
    return seconds


def check_drift(every: int, window: int) -> None:
    """Windows within one phase each: TandemError (a usage error) unless `every` is a multiple of `window`."""
    if every <= 0 or window <= 0 or every % window:
        raise TandemError(f"--drift {every} must be a positive multiple of --drift-window {window}")


def run_drift(
    llm: LLM, model_name: str, pp: int, tg: int, every: int, window: int, reps: int, seed: int = 0
) -> DriftResult:
    """Warm up once, then decode the same scripted text (drawn with `seed`) `reps` times; per window the median
    tok/s. The expert cache is not reset between repetitions: after the first, phase 0 also starts on the last
    phase's cache."""
    check_drift(every, window)
    routing, phases = model_phases(llm)
    prompt, script = drift_tokens(llm.config.n_vocab, phases, pp, tg, every, seed)
    time_scripted_decode(llm, prompt[:16], script[:4], window)
    runs = [time_scripted_decode(llm, prompt, script, window) for _ in range(reps)]
    windows = []
    for k, times in enumerate(zip(*runs, strict=True)):
        start = k * window
        n = min(window, tg - start)
        windows.append(DriftWindow(start, n, start // every % phases, n / statistics.median(times)))
    return DriftResult(model_name, routing, every, window, pp, tg, reps, tuple(windows))
