"""Where llama.cpp's CPU step spends its time, node by node: the twin of bench/cpu_step_nodes.py for the peer.

    python bench/llamacpp_nodes.py --lib DIR -m MODEL [-t THREADS] [--pp 512] [--position 600] [--reps 3]

For a prefill of `--pp` tokens into an empty cache and for one decode step at `--position` (the model on the CPU,
`n_gpu_layers` 0, llama-cpp-python's defaults otherwise, as `tandem bench --compare llamacpp` runs it): the whole
step's time, then each node's alone, summed by op (products by their weight's type) with the largest nodes. Nodes
alone: llama.cpp's scheduler computes one node at a time when its eval callback asks to see every node, so each
node pays one graph launch and a Python callback (a few µs) and may find its inputs in cache where the whole graph
does not: the sum is a floor, the breakdown says which ops to compare with tandem's (same op names, same layout).

Run BY PATH with a llama-cpp-python from --lib (e.g. ~/.cache/tandem/peers/llama_cpp_cpu): it imports llama_cpp
before numpy (see src/tandem/bench/llamacpp_worker.py) and nothing of tandem.
"""

from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

GGML_MAX_SRC = 10


class _Tensor(ctypes.Structure):
    """The head of ggml 0.25.3's `struct ggml_tensor` (ggml.h), as far as the name."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lib", required=True, help="directory holding the llama_cpp package (a pip --target)")
    parser.add_argument("-m", "--model", type=Path, required=True)
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("--pp", type=int, default=512)
    parser.add_argument("--position", type=int, default=600, help="the decode step's position")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--flash-attn", choices=("auto", "on", "off"), default="auto", help="llama.cpp's -fa")
    args = parser.parse_args()

    sys.path.insert(0, args.lib)
    import llama_cpp  # before numpy: see the module docstring

    base = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    base.ggml_op_desc.restype = ctypes.c_char_p
    base.ggml_op_desc.argtypes = [ctypes.c_void_p]
    base.ggml_type_name.restype = ctypes.c_char_p
    base.ggml_type_name.argtypes = [ctypes.c_int]

    @llama_cpp.llama_log_callback
    def quiet(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        if level == 3:  # GGML_LOG_LEVEL_ERROR
            sys.stderr.write(text.decode("utf-8", "replace"))

    llama_cpp.llama_log_set(quiet, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()

    # One record per node, in the order computed: (seconds, op, out ne, src0 ne). `ask` says yes to every node,
    # so the scheduler computes them one by one and calls back (ask=False) after each.
    recording = {"on": False, "last": 0.0, "nodes": []}

    @llama_cpp.ggml_backend_sched_eval_callback
    def each_node(t: int, ask: bool, user_data: ctypes.c_void_p) -> bool:
        if not recording["on"]:
            return False
        if ask:
            return True
        now = time.perf_counter()
        node = _Tensor.from_address(t)
        op = base.ggml_op_desc(t).decode()
        src0 = _Tensor.from_address(node.src[0]) if node.src[0] else None
        if op in ("MUL_MAT", "MUL_MAT_ID") and src0 is not None:
            op += "/" + base.ggml_type_name(src0.type).decode()
        recording["nodes"].append(
            (now - recording["last"], op, tuple(node.ne), tuple(src0.ne) if src0 is not None else ())
        )
        recording["last"] = time.perf_counter()
        return True

    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(str(args.model).encode(), mparams)
    if not model:
        raise SystemExit(f"llama.cpp could not load {args.model}")

    def context(callback: object | None) -> int:
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = max(args.pp, args.position) + 64
        cparams.n_batch = cparams.n_ubatch = args.pp
        cparams.n_seq_max = 1
        cparams.n_threads = cparams.n_threads_batch = args.threads
        cparams.flash_attn_type = {"auto": -1, "off": 0, "on": 1}[args.flash_attn]  # LLAMA_FLASH_ATTN_TYPE_*
        if callback is not None:
            cparams.cb_eval = callback
        ctx = llama_cpp.llama_init_from_model(model, cparams)
        if not ctx:
            raise SystemExit("llama_init_from_model failed")
        return ctx

    # The whole steps run in a context without the callback: with one, the scheduler asks about every node.
    plain, observed = context(None), context(each_node)

    def decode(ctx: int, ids: list[int], pos0: int) -> None:
        batch = llama_cpp.llama_batch_init(len(ids), 0, 1)
        try:
            for i, token in enumerate(ids):
                batch.token[i] = token
                batch.pos[i] = pos0 + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = i == len(ids) - 1
            batch.n_tokens = len(ids)
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise SystemExit("llama_decode failed")
            llama_cpp.llama_synchronize(ctx)
        finally:
            llama_cpp.llama_batch_free(batch)

    rng = random.Random(0)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    prompt = [rng.randrange(3, n_vocab) for _ in range(args.pp)]
    filler = [rng.randrange(3, n_vocab) for _ in range(args.position)]

    def prefill(ctx: int) -> None:
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        decode(ctx, prompt, 0)

    def step(ctx: int) -> None:
        mem = llama_cpp.llama_get_memory(ctx)
        if llama_cpp.llama_memory_seq_pos_max(mem, 0) < args.position - 1:  # the context before it, once
            llama_cpp.llama_memory_clear(mem, True)
            for i in range(0, args.position, args.pp):
                decode(ctx, filler[i : i + args.pp], i)
        llama_cpp.llama_memory_seq_rm(mem, 0, args.position, -1)
        decode(ctx, [5], args.position)

    def profile(title: str, run: object) -> None:
        whole = []
        per_node: list[list[float]] = []
        info: list[tuple[str, tuple, tuple]] = []
        for rep in range(args.reps + 1):  # the first of each kind untimed
            t = time.perf_counter()
            run(plain)  # type: ignore[operator]
            if rep:
                whole.append(time.perf_counter() - t)
            run(observed)  # type: ignore[operator]: fills its context before recording, for the decode step
            recording["nodes"] = []
            recording["on"] = True
            recording["last"] = time.perf_counter()
            run(observed)  # type: ignore[operator]
            recording["on"] = False
            nodes = recording["nodes"]
            if not per_node:
                per_node = [[] for _ in nodes]
                info = [(op, ne, src) for _, op, ne, src in nodes]
            if rep and len(nodes) == len(per_node):
                for times, (seconds, *_rest) in zip(per_node, nodes, strict=True):
                    times.append(seconds)
        medians = [statistics.median(times) for times in per_node]
        by_op: dict[str, float] = defaultdict(float)
        count: dict[str, int] = defaultdict(int)
        for seconds, (op, _, _) in zip(medians, info, strict=True):
            by_op[op] += seconds
            count[op] += 1
        alone = sum(medians)
        print(f"{title}:")
        print(
            f"  {len(info)} nodes computed; the whole step {statistics.median(whole) * 1e3:.2f} ms, "
            f"its nodes alone {alone * 1e3:.2f} ms"
        )
        for op, seconds in sorted(by_op.items(), key=lambda kv: -kv[1]):
            print(f"  {op:24s} {count[op]:5d} nodes {seconds * 1e3:9.2f} ms {100 * seconds / alone:5.1f} %")
        print("  largest nodes:")
        ranked = sorted(zip(medians, range(len(info)), info, strict=True), reverse=True)[: args.top]
        for seconds, i, (op, ne, src_ne) in ranked:
            print(f"    #{i:<5d} {op:24s} {seconds * 1e6:9.1f} µs  out {ne}  src0 {src_ne}")

    print(f"llama.cpp ({getattr(llama_cpp, '__version__', '?')}), {args.model.name}, {args.threads} threads")
    profile(f"prefill of {args.pp} tokens", prefill)
    profile(f"one decode step at position {args.position}", step)
    llama_cpp.llama_free(observed)
    llama_cpp.llama_free(plain)
    llama_cpp.llama_model_free(model)


if __name__ == "__main__":
    main()
