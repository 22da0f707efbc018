#!/usr/bin/env python
"""Record llama.cpp's logits for tiny gpt-oss variants (tests/fixtures/gpt_oss_{variant}_llamacpp.json).

* yarn: gpt-oss's YaRN rope. transformers and llama.cpp read it differently (docs/yarn.md); tandem follows
  llama.cpp for GGUF files, so tests/test_gpt_oss_llamacpp.py compares tandem against these logits.
* mxfp4: the experts stored as MXFP4 like the released checkpoints, repacked by the converter; llama.cpp
  runs the same ggml MXFP4 kernels, so this checks the MXFP4 path end to end.

    python scripts/record_gpt_oss_fixtures.py [--variant all|yarn|mxfp4] [--lib DIR] [--threads N]

The parent process builds the model (tests/tiny_models.make_tiny_gpt_oss(**VARIANTS[v]), seed 0) and its
F32 GGUF with tandem's converter, then runs llama-cpp-python (CPU build, default
$HOME/.cache/tandem/peers/llama_cpp_cpu) in a child process: llama_cpp has to be imported before numpy
there. The child evaluates each prompt from an empty cache in one batch with logits for every position,
F32 K/V cache and no flash attention, and writes the logits as base64 float32. The fixture records the
GGUF's sha256, so the test can tell when the tiny model no longer builds bit-identically.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import os
import sys
import tempfile

from llamacpp_child import (
    DEFAULT_LIB,
    FIXTURES_DIR,
    build_tiny_gguf,
    have_llama_cpp,
    open_llama,
    run_child,
    sha256_file,
)

VARIANTS: dict[str, dict[str, bool]] = {"yarn": {"yarn": True}, "mxfp4": {"mxfp4": True}}
PROMPT_LENGTHS = (7, 48)  # 48 > the sliding window (8); positions up to 47
PROMPT_SEED = 1234


def prompts(n_vocab: int) -> list[list[int]]:
    """The token prompts (also used by the test): seeded random ids >= 4."""
    import random

    rng = random.Random(PROMPT_SEED)
    return [[rng.randrange(4, n_vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def fixture_path(variant: str) -> str:
    return os.path.join(FIXTURES_DIR, f"gpt_oss_{variant}_llamacpp.json")


def worker(lib: str, model: str, threads: int, prompts_json: str) -> None:
    """Child process: llama.cpp logits for every prompt, as JSON on stdout."""
    llama_cpp, llm = open_llama(lib, model, 64, threads)  # before numpy
    import numpy as np

    out = []
    for ids in json.loads(prompts_json):
        llm.reset()
        llm._ctx.kv_cache_clear()  # a fresh sequence for every prompt
        llm.eval(ids)
        logits = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
        out.append({"ids": ids, "logits_b64": base64.b64encode(logits.tobytes()).decode("ascii")})
    json.dump({"prompts": out, "n_vocab": llm.n_vocab(), "llama_cpp_version": llama_cpp.__version__}, sys.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", default=DEFAULT_LIB)
    ap.add_argument("--variant", choices=["all", *VARIANTS], default="all")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", nargs=2, metavar=("MODEL", "PROMPTS_JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.lib, args.worker[0], args.threads, args.worker[1])
        return 0
    if not have_llama_cpp(args.lib):
        return 1
    for variant in VARIANTS if args.variant == "all" else [args.variant]:
        if (rc := record(variant, args.lib, args.threads)) != 0:
            return rc
    return 0


def record(variant: str, lib: str, threads: int) -> int:
    """Build the variant's GGUF, run llama.cpp on it in a child process and write the fixture."""
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_gguf("make_tiny_gpt_oss", tmp, f"tiny_gpt_oss_{variant}-f32.gguf", **VARIANTS[variant])
        from tandem.gguf import open_gguf

        n_vocab = len(open_gguf(model).require("tokenizer.ggml.tokens"))
        result = run_child(__file__, ["--lib", lib, "--threads", str(threads), "--worker", model,
                                      json.dumps(prompts(n_vocab))])  # fmt: skip
        if isinstance(result, int):
            return result
        result["meta"] = {
            "model": f"tests/tiny_models.make_tiny_gpt_oss(seed=0, **{VARIANTS[variant]}), converted by tandem"
                     " (outtype f32)",
            "gguf_sha256": sha256_file(model),
            "llama_cpp_python": result.pop("llama_cpp_version"),
            "settings": "n_ctx 64, one batch per prompt, logits_all, F32 K/V, no flash attention",
            "threads": threads,
            "date": datetime.date.today().isoformat(),
        }
    out = fixture_path(variant)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
