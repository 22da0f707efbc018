"""How well `--moe-cache-refresh` follows a drifting hot set, as cache hits (runs anywhere: CPU only).

    python bench/refresh_replay.py MODEL.gguf [--cache 20] [--every 16] [--tg 2048] [--drift 512] [-t 2]

MODEL is written by `tandem synth --routing zipf:S,drift:P` (a few layers are enough, e.g. `--layers 4`). The
model runs on the CPU twice with its routing counted per step: a phase-0 text drawn with seed 1000 (the
statistics a fixed placement is made from) and the drift bench's script (seed 0: a new phase every --drift
tokens). The script's per-step picks are then replayed, with no model, through three caches of --cache experts
per layer:
- fixed: the most picked experts of the phase-0 recording, for the whole script;
- per-phase best: for each phase, its own most picked experts in the script (a fixed placement fitted to that
  phase after the fact: what "the static placement's speed" of each phase can at most be);
- online: the same start as fixed plus one spare slot, re-placed by `weights/expert_cache.py`'s
  ExpertCacheRefresher every --every steps, exactly as on the GPU (its copies done at once).
Printed per window of --window tokens: the share of the routed picks each cache holds. A step's CPU work is the
picks it misses, so near a full cache each point of hit rate is a large share of the decode time.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

import tandem
from tandem.bench.drift import drift_tokens, model_phases
from tandem.layers.moe import RoutingCounts
from tandem.weights.expert_cache import CacheSlots, ExpertCacheRefresher


def step_picks(llm: tandem.LLM, prompt: list[int], script: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The prompt's picks [L, E] and each scripted step's [T, L, E] (read from the routing counts)."""
    counts = llm.routing_counts
    assert counts is not None
    llm.engine.reset()
    before = counts.read().numpy()
    llm.engine.append(prompt)
    last = counts.read().numpy()
    prompt_picks, steps = last - before, []
    for token in script:
        llm.engine.append([token])
        now = counts.read().numpy()
        steps.append(now - last)
        last = now
    return prompt_picks, np.stack(steps)


def hottest(counts: np.ndarray, k: int) -> list[list[int]]:
    return [[int(e) for e in np.argsort(-row, kind="stable")[:k]] for row in counts]


def fixed_hits(steps: np.ndarray, cached: list[list[int]]) -> np.ndarray:
    """Per step, the share of its picks on `cached` experts."""
    mask = np.zeros(steps.shape[1:], dtype=bool)
    for layer, ids in enumerate(cached):
        mask[layer, ids] = True
    return (steps * mask).sum(axis=(1, 2)) / steps.sum(axis=(1, 2))


def online_hits(steps: np.ndarray, start: list[list[int]], every: int) -> tuple[np.ndarray, int]:
    """Per step, the share of its picks on the experts the refresher holds at that step; and its swaps."""
    n_steps, n_layers, n_experts = steps.shape
    counts = RoutingCounts.zeros(n_layers, n_experts, 1, torch.device("cpu"))
    slots = []
    for layer, ids in enumerate(start):
        slot_map = torch.full((n_experts,), -1, dtype=torch.int32)
        for slot, e in enumerate(ids):
            slot_map[e] = slot
        slots.append(CacheSlots(layer, slot_map, [*ids, -1]))  # the spare slot online re-placement keeps
    refresher = ExpertCacheRefresher(slots, counts, every)
    hits = np.empty(n_steps)
    for t in range(n_steps):
        refresher.between_steps()
        held = np.stack([s.slot_map.numpy() >= 0 for s in slots])
        hits[t] = (steps[t] * held).sum() / steps[t].sum()
        counts.counts += torch.from_numpy(steps[t])
    return hits, refresher.swaps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--cache", type=int, default=20, help="experts cached per layer (default 20)")
    ap.add_argument("--every", type=int, default=16, help="--moe-cache-refresh STEPS (default 16)")
    ap.add_argument("--pp", type=int, default=128)
    ap.add_argument("--tg", type=int, default=2048)
    ap.add_argument("--drift", type=int, default=512, help="tokens per phase of the script (default 512)")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("-t", "--threads", type=int, default=None)
    args = ap.parse_args()

    # --expert-stats only for its counting on every step (the file, in a folder of its own, is thrown away)
    with tempfile.TemporaryDirectory() as tmp, tandem.LLM(
        args.model, device="cpu", n_ctx=args.pp + args.tg + 1, threads=args.threads, expert_stats=Path(tmp) / "s"
    ) as llm:
        _, phases = model_phases(llm)
        n_vocab = llm.config.n_vocab
        rec_prompt, rec_steps = step_picks(llm, *drift_tokens(n_vocab, phases, args.pp, args.drift, args.drift, 1000))
        _, steps = step_picks(llm, *drift_tokens(n_vocab, phases, args.pp, args.tg, args.drift, 0))

    start = hottest(rec_prompt + rec_steps.sum(axis=0), args.cache)
    best = np.empty(len(steps))
    for p0 in range(0, len(steps), args.drift):
        phase = steps[p0 : p0 + args.drift]
        best[p0 : p0 + args.drift] = fixed_hits(phase, hottest(phase.sum(axis=0), args.cache))
    online, swaps = online_hits(steps, start, args.every)
    rows = {"fixed (phase 0's statistics)": fixed_hits(steps, start), "per-phase best": best,
            f"online (every {args.every}, {swaps} swaps)": online}  # fmt: skip
    print(f"{args.model}: {args.cache} of {steps.shape[2]} experts cached per layer, {steps.shape[1]} layers, a new "
          f"phase every {args.drift} tokens; share of the picks the cache holds, per {args.window} tokens")  # fmt: skip
    print("| tokens | " + " | ".join(rows) + " |")
    print("|---|" + "---|" * len(rows))
    for w in range(0, len(steps), args.window):
        cells = " | ".join(f"{h[w : w + args.window].mean():.2f}" for h in rows.values())
        print(f"| {w}..{min(w + args.window, len(steps)) - 1} | {cells} |")


if __name__ == "__main__":
    main()
