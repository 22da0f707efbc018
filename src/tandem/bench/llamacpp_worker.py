"""One llama.cpp benchmark process for one placement (through llama-cpp-python's C API): load, warm up
once, time every repetition, printing each repetition's result as it finishes (see worker.py).

    python src/tandem/bench/llamacpp_worker.py --lib DIR -m MODEL --placement JSON --pp 512,2048 --tg 128 ...

Run BY PATH, not with `-m tandem.bench...`: importing the `tandem` package pulls in numpy and torch, and
llama_cpp must be imported before numpy (numpy first made llama.cpp's loader segfault, see
shared/peers/README.md); torch would also inflate this process's RSS. So this file imports only the standard
library and its two stdlib-only siblings (protocol.py, vram.py, loaded by path), then llama_cpp from --lib.

The placement arrives translated (spec.to_llama): n_gpu_layers, main_gpu and (regex, "cpu"|"cuda:K")
overrides that go into llama_model_params.tensor_buft_overrides. The timing protocol is worker.py's.
Exit status: 0 with a result line; 4 when llama_cpp cannot be imported from --lib; other non-zero on failure.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any


def _sibling(name: str) -> ModuleType:
    path = Path(__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_tandem_bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


protocol = _sibling("protocol")
vram = _sibling("vram")
EXIT_PEER_MISSING = protocol.EXIT_PEER_MISSING

CACHE_TYPES = {"f32": 0, "f16": 1, "bf16": 30}  # GGML_TYPE_*


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llamacpp_worker.py", description=__doc__)
    p.add_argument("--lib", required=True, help="directory holding the llama_cpp package (a pip --target)")
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--placement", required=True, help="JSON: n_gpu_layers, main_gpu, overrides")
    p.add_argument("-t", "--threads", type=int, required=True)
    p.add_argument("-c", "--ctx-size", type=int, default=4096)
    p.add_argument("-b", "--batch-size", type=int, default=512)
    p.add_argument("--cache-type", default="f16", choices=sorted(CACHE_TYPES))
    p.add_argument("--pp", default="128", help="prompt sizes, comma-separated")
    p.add_argument("--tg", type=int, default=64)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline", type=float, default=None, help="time.time() after which no repetition starts")
    return p


def _import_llama(lib: str) -> ModuleType:
    if not Path(lib, "llama_cpp", "__init__.py").is_file():
        hint = "build it with scripts/build_llamacpp.sh"
        print(f"peer missing: no llama_cpp package under {lib} ({hint})", file=sys.stderr)
        sys.exit(EXIT_PEER_MISSING)
    sys.path.insert(0, lib)
    try:
        import llama_cpp
    except Exception as e:  # an ImportError, or an OSError from a library that does not load
        print(f"peer missing: cannot import llama_cpp from {lib}: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(EXIT_PEER_MISSING)
    return llama_cpp


class _Log:
    """llama.cpp's log: kept in memory (for the buffer sizes), warnings and errors echoed to stderr."""

    def __init__(self, llama_cpp: ModuleType) -> None:
        self.lines: list[str] = []

        @llama_cpp.llama_log_callback
        def callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            line = text.decode("utf-8", "replace")
            self.lines.append(line)
            if level in (2, 3):  # GGML_LOG_LEVEL_WARN, _ERROR
                sys.stderr.write(line)

        self._callback = callback  # keep it alive as long as llama.cpp may call it
        llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))

    def flash_attention(self, requested: int) -> str:
        """'on' or 'off': what llama.cpp's context computes attention with, as its log says it resolved
        `flash_attn_type` (auto: on wherever the KV cache's device has the kernels, the CPU included)."""
        text = "".join(self.lines)
        if "Flash Attention enabled" in text:
            return "on"
        if "Flash Attention not supported" in text:
            return "off"
        return {0: "off", 1: "on"}.get(requested, "not reported")

    def buffer_sizes(self) -> dict[str, float]:
        """'CUDA0 model buffer size = 1234.5 MiB' lines -> {buffer: MiB}: where the weights went."""
        out: dict[str, float] = {}
        for line in "".join(self.lines).splitlines():
            if "model buffer size" in line and "=" in line:
                name = line.split(":", 1)[-1].split("model buffer size")[0].strip()
                mib = float(line.rsplit("=", 1)[1].split()[0])
                out[name] = out.get(name, 0.0) + mib
        return out


def _buffer_type(llama_cpp: ModuleType, target: str) -> int:
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    if target == "cpu":
        fn = ctypes.CDLL(str(lib_dir / "libggml-base.so")).ggml_backend_cpu_buffer_type
        fn.restype = ctypes.c_void_p
        fn.argtypes = []
        return int(fn())
    if target.startswith("cuda"):
        path = lib_dir / "libggml-cuda.so"
        if not path.exists():
            raise RuntimeError(f"override to {target}: this llama.cpp build has no CUDA backend ({path})")
        fn = ctypes.CDLL(str(path)).ggml_backend_cuda_buffer_type
        fn.restype = ctypes.c_void_p
        fn.argtypes = [ctypes.c_int]
        return int(fn(int(target.split(":", 1)[1]) if ":" in target else 0))
    raise RuntimeError(f"unknown buffer target '{target}'")


class _Override(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Load with the translated placement, warm up once, time up to `args.reps` repetitions."""
    sampler = vram.VramSampler().start()
    llama_cpp = _import_llama(args.lib)  # before numpy, see the module docstring
    import numpy as np

    log = _Log(llama_cpp)
    placement = json.loads(args.placement)
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = int(placement["n_gpu_layers"])
    mparams.main_gpu = int(placement.get("main_gpu", 0))
    overrides = placement.get("overrides", [])
    table = (_Override * (len(overrides) + 1))()  # NULL-terminated; kept alive until the model is loaded
    for i, (pattern, target) in enumerate(overrides):
        table[i].pattern = pattern.encode()
        table[i].buft = _buffer_type(llama_cpp, target)
    if overrides:
        mparams.tensor_buft_overrides = ctypes.cast(table, ctypes.c_void_p)

    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = args.ctx_size
    cparams.n_batch = cparams.n_ubatch = args.batch_size
    cparams.n_seq_max = 1
    cparams.n_threads = cparams.n_threads_batch = args.threads
    cparams.type_k = cparams.type_v = CACHE_TYPES[args.cache_type]

    start = time.perf_counter()
    model = llama_cpp.llama_model_load_from_file(args.model.encode(), mparams)
    if not model:
        raise RuntimeError(f"llama_model_load_from_file failed for {args.model}:\n{''.join(log.lines[-15:])}")
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        raise RuntimeError(f"llama_init_from_model failed:\n{''.join(log.lines[-15:])}")
    llama_cpp.llama_synchronize(ctx)
    load_s = time.perf_counter() - start
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    mem = llama_cpp.llama_get_memory(ctx)

    def decode(ids: list[int]) -> int:
        """Feed `ids` in n_batch chunks; return the argmax of the last position's logits."""
        for i in range(0, len(ids), args.batch_size):
            chunk = ids[i : i + args.batch_size]
            arr = (llama_cpp.llama_token * len(chunk))(*chunk)
            rc = llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, len(chunk)))
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
        return int(np.argmax(logits))

    def one_rep(pp_sizes: list[int], tg: int, seed: int) -> tuple[dict[int, float], float]:
        pp_s: dict[int, float] = {}
        tg_s = 0.0
        for k, pp in enumerate(pp_sizes):
            ids = protocol.prompt_ids(n_vocab, pp, seed)
            llama_cpp.llama_memory_clear(mem, True)
            t = time.perf_counter()
            token = decode(ids)  # reading the logits waits for the GPU
            pp_s[pp] = time.perf_counter() - t
            if k == 0:
                t = time.perf_counter()
                for _ in range(tg):
                    token = decode([token])
                tg_s = time.perf_counter() - t
        return pp_s, tg_s

    def memory(vram: Any) -> dict[str, Any]:  # a VramReading (vram.py, loaded by path like protocol)
        return {"peak_rss_bytes": protocol.peak_rss_bytes(), "vram": vram.as_dict(), "torch_peak_bytes": None}

    pp_sizes = [int(v) for v in args.pp.split(",")]
    common = {
        "engine": "llamacpp",
        "load_s": load_s,
        "threads": args.threads,
        "weight_bytes": {name: int(mib * 2**20) for name, mib in log.buffer_sizes().items()},
        "flash_attention": log.flash_attention(int(cparams.flash_attn_type)),
        "version": f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')}",
    }
    try:
        t = time.perf_counter()
        one_rep(sorted({min(pp, args.batch_size) for pp in pp_sizes}), min(args.tg, 4), seed=-1)
        common["warmup_s"] = time.perf_counter() - t
        done = protocol.timed_reps("llamacpp", one_rep, pp_sizes, args, common, lambda: memory(sampler.reading))
    finally:
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    return protocol.run_result(common, done, args.reps, pp_sizes, memory(sampler.stop()))


def main(argv: list[str] | None = None) -> int:
    """Entry point; each repetition, then the whole run, goes to stdout as a marked JSON line."""
    protocol.maybe_inject("llamacpp")
    args = build_parser().parse_args(argv)
    protocol.emit_result(run(args))
    return 0


if __name__ == "__main__":
    protocol.exit_worker(main)
