#!/usr/bin/env python
"""Record llama.cpp's logits for tiny models, so that the tests can check tandem against the reference
reader of these GGUF files, not only against transformers:

* tests/fixtures/qwen35moe_llamacpp.json: the tiny Qwen3.5-MoE and Qwen3-Next (tests/test_qwen35moe.py);
* tests/fixtures/gemma4_llamacpp.json: the tiny Gemma 4 MoE converted to Q8_0 (tests/test_gpt_oss_gemma4.py).
  Q8_0, not F32: llama.cpp's CPU GELU reads ggml's f16 table, which tandem follows for quantized files only;
  for float files it keeps transformers' tanh formula, ~1e-3 from llama.cpp (docs/gemma4_gelu.md).
* tests/fixtures/qwen3_llamacpp.json: the tiny dense Qwen3 in Q8_0, F32 K/V cache, one prompt of 171 tokens
  (tests/test_llamacpp_q8_0.py): the step graphs must sum q.k in the order of llama.cpp's product of the
  permuted queries (ggml's own dot product), or one rounding moves a Q8_0 activation code.
* tests/fixtures/gemma3_llamacpp.json: the tiny Gemma 3 in Q8_0 with llama.cpp's default f16 K/V cache
  (tests/test_llamacpp_q8_0.py): its query scale, 1/sqrt(32), is no power of two, so scaling the queries
  before their f16 rounding (llama.cpp's Gemma 3 graph) and scaling the scores round apart.

    python scripts/record_qwen35moe_fixture.py [--fixture all|qwen35moe|gemma4|gemma3|qwen3] [--lib DIR]
                                               [--out-dir DIR]
                                               [--threads N]

The parent process builds each model (tests/tiny_models.make_tiny_<arch>, seed 0) and its GGUF (F32, Q8_0
for Gemma 4) with tandem's converter, as tests/conftest.py does, then runs llama-cpp-python (CPU build, default
$HOME/.cache/tandem/peers/llama_cpp_cpu) in a child process (llama_cpp must be imported before numpy
there). Per prompt, from an empty cache: all positions' logits of one batch (for the Qwen models,
llama.cpp's chunked delta-net), then the last DECODE_STEPS tokens again one by one after the rest (its
autoregressive form); the same prompts for every model, the longer one past Gemma 4's sliding window.
F32 K/V cache, no flash attention. To keep the file small only the logits of COLUMNS seeded vocabulary
ids are stored (base64 float32). The fixture records each GGUF's sha256, so the test can tell when a tiny
model no longer builds bit-identically.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import os
import random
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

# fixture name (file <name>_llamacpp.json) -> the tiny models it holds, convert_hf's outtype for them and the K/V
# cache type
FIXTURES: dict[str, tuple[tuple[str, ...], str, str]] = {
    "qwen35moe": (("qwen35moe", "qwen3next"), "f32", "f32"),
    "gemma4": (("gemma4",), "q8_0", "f32"),  # quantized: the GELU is ggml's table in tandem as in llama.cpp
    "gemma3": (("gemma3",), "q8_0", "f16"),  # f16: the queries' rounding (see above)
    "qwen3": (("qwen3",), "q8_0", "f32"),  # f32: the order of q.k's sums (see above)
}
# fixtures whose prompts are not PROMPT_LENGTHS' but these lengths, each prompt seeded by its length: the dense
# Qwen3's 171 tokens are a prompt whose q.k sums in tinyBLAS's order moved a Q8_0 activation code (in ggml's dot
# product's order, as llama.cpp's, none moves). One prompt: recorded after an earlier prompt and its decode steps,
# llama.cpp gave two rows of a later prompt otherwise than from a fresh context.
PROMPT_LENGTHS = (7, 80)  # 80 > one delta-net chunk (64) and > the tiny Gemma 4's sliding window (16)
LENGTHS_OF = {"qwen3": (171,)}
DECODE_STEPS = 5
N_COLUMNS = 64
SEED = 4321


def prompts_and_columns(n_vocab: int, name: str = "") -> tuple[list[list[int]], list[int]]:
    """The token prompts and the stored vocabulary columns of fixture `name` (also used by the test)."""
    rng = random.Random(SEED)
    prompts = [[rng.randrange(4, n_vocab) for _ in range(n)] for n in PROMPT_LENGTHS]
    if name in LENGTHS_OF:
        rngs = [(n, random.Random(SEED + n)) for n in LENGTHS_OF[name]]
        prompts = [[r.randrange(4, n_vocab) for _ in range(n)] for n, r in rngs]
    return prompts, sorted(rng.sample(range(n_vocab), N_COLUMNS))


def context_size(prompts: list[list[int]]) -> int:
    """llama.cpp's n_ctx (and batch) for these prompts: each prompt in one batch, in steps of 128."""
    return -(-max(128, *map(len, prompts)) // 128) * 128


def worker(lib: str, model: str, threads: int, job_json: str) -> None:
    """Child process: llama.cpp logits (stored columns only) for every prompt, as JSON on stdout."""
    job = json.loads(job_json)
    llama_cpp, llm = open_llama(lib, model, context_size(job["prompts"]), threads, job["cache_type"])  # before numpy
    import numpy as np

    cols = np.asarray(job["columns"])

    def b64(x: np.ndarray) -> str:
        return base64.b64encode(np.ascontiguousarray(x[:, cols], dtype=np.float32).tobytes()).decode("ascii")

    out = []
    for ids in job["prompts"]:
        llm.reset()
        llm._ctx.kv_cache_clear()  # a fresh sequence (also clears the recurrent state)
        llm.eval(ids)
        full = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
        llm.reset()
        llm._ctx.kv_cache_clear()
        head = len(ids) - DECODE_STEPS
        llm.eval(ids[:head])
        steps = []
        for t in ids[head:]:
            llm.eval([t])
            steps.append(np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float32))
        out.append({"ids": ids, "logits_b64": b64(full), "decode_b64": b64(np.stack(steps))})
    json.dump({"prompts": out, "llama_cpp_version": llama_cpp.__version__}, sys.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixture", choices=["all", *FIXTURES], default="all")
    ap.add_argument("--lib", default=DEFAULT_LIB)
    ap.add_argument("--out-dir", default=FIXTURES_DIR)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", nargs=2, metavar=("MODEL", "JOB_JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.lib, args.worker[0], args.threads, args.worker[1])
        return 0
    if not have_llama_cpp(args.lib):
        return 1
    for name in FIXTURES if args.fixture == "all" else [args.fixture]:
        if (rc := record(name, args.lib, args.threads, os.path.join(args.out_dir, f"{name}_llamacpp.json"))) != 0:
            return rc
    return 0


def record(name: str, lib: str, threads: int, out: str) -> int:
    """Build the fixture's GGUFs, run llama.cpp on each in a child process and write the fixture to out."""
    arches, outtype, cache_type = FIXTURES[name]
    # every tiny model has tiny_models.VOCAB_SIZE (512) ids
    prompts, columns = prompts_and_columns(512, name)
    result: dict[str, object] = {"columns": columns, "decode_steps": DECODE_STEPS, "models": {}}
    version = ""
    with tempfile.TemporaryDirectory() as tmp:
        for arch in arches:
            gguf = f"tiny_{arch}-{outtype}.gguf"
            model = build_tiny_gguf(f"make_tiny_{arch}", os.path.join(tmp, arch), gguf, outtype)
            job = json.dumps({"prompts": prompts, "columns": columns, "cache_type": cache_type})
            got = run_child(__file__, ["--lib", lib, "--threads", str(threads), "--worker", model, job])
            if isinstance(got, int):
                return got
            version = got["llama_cpp_version"]
            result["models"][arch] = {"gguf_sha256": sha256_file(model), "prompts": got["prompts"]}  # type: ignore[index]
    factory = f"make_tiny_{arches[0]}" if len(arches) == 1 else f"make_tiny_{{{','.join(arches)}}}"
    result["meta"] = {
        "models": f"tests/tiny_models.{factory}(seed=0), converted to {outtype.upper()} by tandem",
        "llama_cpp_python": version,
        "settings": f"n_ctx {context_size(prompts)}, one batch per prompt, logits_all, {cache_type.upper()} K/V, "
        f"no flash attention; then the last {DECODE_STEPS} tokens one at a time",
        "threads": threads,
        "date": datetime.date.today().isoformat(),
    }
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out} ({os.path.getsize(out)} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
