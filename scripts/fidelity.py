#!/usr/bin/env python
"""How close tandem's and llama.cpp's logits are to transformers', family by family, with each engine's defaults.

Tiny random `transformers` models of the MoE families (tests/tiny_models.py, seed 0: sliding windows shorter than
the longer prompts, 80 tokens past one delta-net chunk), converted to F32 GGUF by tandem's converter; prompts of
1, 7, 33 and 80 tokens from an empty cache in one batch; transformers' f32 eager logits as the reference. Prints
max |logit - reference| per prompt and the argmax agreement over the 121 positions for each engine setting.

    python scripts/fidelity.py [--families qwen3moe,qwen35moe,gpt_oss,gemma4] [--settings cpu,cpu-f32,gpu,...]
                               [--lib DIR] [--backend cpu|cuda] [--flash-attn] [--record] [--json FILE]

`--record` writes tests/fixtures/fidelity_llamacpp_<backend>[_fa].json: per family, the GGUF's sha256, llama.cpp's
(f16 K/V cache; without flash attention, the Python class's default, or with it: `--flash-attn`, its CLI's default
`-fa auto` on the CPU) max |diff| per prompt, its argmax ids and its logits on 64 columns,
which tests/test_fidelity.py holds tandem's defaults to. llama.cpp runs in a child process (llama_cpp must be
imported before numpy there).
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from llamacpp_child import DEFAULT_LIB, FIXTURES_DIR, build_tiny_gguf, import_llama_cpp, sha256_file

FAMILIES = ("qwen3moe", "qwen35moe", "gpt_oss", "gemma4")
PROMPT_LENGTHS = (1, 7, 33, 80)
PROMPT_SEED = 1234
N_COLUMNS = 64
# tandem settings: LLM keyword arguments
SETTINGS: dict[str, dict[str, Any]] = {
    "cpu": {"device": "cpu"},
    "cpu-f32": {"device": "cpu", "cache_type": "f32"},
    "gpu": {"device": "cuda"},
    "gpu-cpu-moe": {"device": "cuda", "cpu_moe": True},
    "gpu-n-cpu-moe": {"device": "cuda", "n_cpu_moe": 1},
    "gpu-f32": {"device": "cuda", "dtype": "f32"},
    "gpu-f32-f32kv": {"device": "cuda", "dtype": "f32", "cache_type": "f32"},
}


def prompts(n_vocab: int) -> list[list[int]]:
    """The prompts (also the test's): seeded random ids >= 4."""
    import random

    rng = random.Random(PROMPT_SEED)
    return [[rng.randrange(4, n_vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def columns(n_vocab: int) -> list[int]:
    import random

    return sorted(random.Random(PROMPT_SEED + 1).sample(range(n_vocab), N_COLUMNS))


def llama_child(lib: str, model: str, prompts_json: str, out_path: str, n_gpu_layers: int, flash_attn: bool) -> None:
    """Child process: llama.cpp's logits for every prompt with its defaults (f16 K/V), flash attention or not."""
    llama_cpp = import_llama_cpp(lib)  # before numpy
    llm = llama_cpp.Llama(
        model_path=model, n_ctx=128, n_batch=128, n_ubatch=128, n_threads=2, n_threads_batch=2, logits_all=True,
        n_gpu_layers=n_gpu_layers, flash_attn=flash_attn, seed=0, verbose=False,
    )
    import numpy as np

    out = {}
    for i, ids in enumerate(json.loads(prompts_json)):
        llm.reset()
        llm._ctx.kv_cache_clear()  # a fresh sequence, recurrent state included
        llm.eval(ids)
        out[f"p{i}"] = np.array(llm.scores[: len(ids)], dtype=np.float32)  # a copy: the buffer is reused
    np.savez(out_path, **out)


def llama_logits(lib: str, model: str, ids: list[list[int]], backend: str, flash_attn: bool) -> list[Any]:
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "logits.npz")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", lib, model, json.dumps(ids), out,
               str(99 if backend == "cuda" else 0), str(int(flash_attn))]  # fmt: skip
        subprocess.run(cmd, check=True)
        z = np.load(out)
        return [z[f"p{i}"] for i in range(len(ids))]


def reference_logits(hf_dir: str, ids: list[list[int]]) -> list[Any]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0].float().numpy() for p in ids]


def closeness(outs: list[Any], refs: list[Any]) -> tuple[list[float], int]:
    """(max |diff| per prompt, positions whose argmax agrees)."""
    import numpy as np

    diffs = [float(np.abs(o - r).max()) for o, r in zip(outs, refs, strict=True)]
    agree = sum(int((o.argmax(-1) == r.argmax(-1)).sum()) for o, r in zip(outs, refs, strict=True))
    return diffs, agree


def tandem_logits(gguf: str, ids: list[list[int]], setting: dict[str, Any]) -> list[Any]:
    import tandem

    with tandem.LLM(gguf, threads=2, n_ctx=128, **setting) as llm:
        return [llm.logits(p) for p in ids]


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        llama_child(*sys.argv[2:6], n_gpu_layers=int(sys.argv[6]), flash_attn=sys.argv[7] == "1")
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--settings", default="cpu,cpu-f32")
    ap.add_argument("--lib", default=DEFAULT_LIB, help="llama-cpp-python install ('' to leave llama.cpp out)")
    ap.add_argument("--backend", choices=("cpu", "cuda"), default="cpu", help="llama.cpp's build: its layers there")
    ap.add_argument("--flash-attn", action="store_true", help="llama.cpp with flash attention (its CLI's default)")
    ap.add_argument("--record", action="store_true", help="write tests/fixtures/fidelity_llamacpp_<backend>.json")
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
    import numpy as np

    results: dict[str, Any] = {}
    fixture: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            gguf = build_tiny_gguf(f"make_tiny_{family}", os.path.join(tmp, family), f"{family}.gguf")
            hf_dir = os.path.join(tmp, family, "hf")
            import tandem

            with tandem.LLM(gguf, device="cpu", n_ctx=128) as probe:
                n_vocab = probe.config.n_vocab
            ids = prompts(n_vocab)
            refs = reference_logits(hf_dir, ids)
            rows: dict[str, Any] = {}
            if args.lib:
                outs = llama_logits(args.lib, gguf, ids, args.backend, args.flash_attn)
                diffs, agree = closeness(outs, refs)
                rows[f"llama.cpp-{args.backend}"] = {"max_abs_diff": diffs, "argmax_agree": agree}
                cols = columns(n_vocab)
                fixture[family] = {
                    "gguf_sha256": sha256_file(gguf),
                    "max_abs_diff": diffs,
                    "argmax": [o.argmax(-1).tolist() for o in outs],
                    "columns": cols,
                    "logits_b64": [base64.b64encode(np.ascontiguousarray(o[:, cols]).tobytes()).decode() for o in outs],
                }
            for name in args.settings.split(","):
                diffs, agree = closeness(tandem_logits(gguf, ids, SETTINGS[name]), refs)
                rows[f"tandem-{name}"] = {"max_abs_diff": diffs, "argmax_agree": agree}
            results[family] = rows
            n = sum(PROMPT_LENGTHS)
            for label, r in rows.items():
                line = " ".join(f"{d:9.2e}" for d in r["max_abs_diff"])
                print(f"{family:10s} {label:24s} {line}   max {max(r['max_abs_diff']):9.2e}  "
                      f"argmax {r['argmax_agree']}/{n}", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    if args.record:
        path = os.path.join(FIXTURES_DIR, f"fidelity_llamacpp_{args.backend}{'_fa' if args.flash_attn else ''}.json")
        meta = {
            "models": "tests/tiny_models.make_tiny_<family>(seed=0), converted to F32 by tandem",
            "prompts": f"scripts/fidelity.py prompts(): lengths {list(PROMPT_LENGTHS)}, seed {PROMPT_SEED}",
            "settings": f"llama.cpp defaults: f16 K/V cache, {'' if args.flash_attn else 'no '}flash attention, "
            "one batch per prompt, n_ctx 128"
            + (", all layers on the GPU" if args.backend == "cuda" else ", 2 threads"),
            "flash_attn": args.flash_attn,
            "llama_cpp_python": "0.3.36",
            "date": datetime.date.today().isoformat(),
        }
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"meta": meta, "families": fixture}, f, indent=1)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
