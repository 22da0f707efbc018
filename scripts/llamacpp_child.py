"""What the fixture-recording scripts share: where llama-cpp-python lives, the tiny models' GGUFs, the child
process that runs llama.cpp, and the fixture's checksum.

llama.cpp runs in a child process because `llama_cpp` must be imported before numpy there (numpy first made
its loader segfault: ../shared/peers/README.md); this module imports neither, so a child may import it first.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_LIB = os.path.join(os.path.expanduser("~"), ".cache", "tandem", "peers", "llama_cpp_cpu")
FIXTURES_DIR = os.path.join(REPO, "tests", "fixtures")


def import_llama_cpp(lib: str) -> ModuleType:
    """llama_cpp from the llama-cpp-python install under `lib` (call before importing numpy)."""
    sys.path.insert(0, lib)
    import llama_cpp

    return llama_cpp


def open_llama(lib: str, model: str, n_ctx: int, threads: int, cache_type: str = "f32") -> tuple[ModuleType, Any]:
    """(llama_cpp, a Llama on `model`) as the fixtures are recorded: one batch of n_ctx, logits at every
    position, an F32 (or `cache_type`) K/V cache, no flash attention. Call before importing numpy."""
    llama_cpp = import_llama_cpp(lib)
    kv = {"f32": 0, "f16": 1}[cache_type]  # ggml type ids
    llm = llama_cpp.Llama(model_path=model, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads,
                          n_threads_batch=threads, logits_all=True, type_k=kv, type_v=kv, flash_attn=False, seed=0,
                          verbose=False)  # fmt: skip
    return llama_cpp, llm


def have_llama_cpp(lib: str) -> bool:
    """Whether `lib` holds a llama-cpp-python install; says where it looked when not."""
    if os.path.isdir(os.path.join(lib, "llama_cpp")):
        return True
    print(f"llama-cpp-python not found under {lib}", file=sys.stderr)
    return False


def build_tiny_gguf(factory: str, out_dir: str, gguf_name: str, outtype: str = "f32", **options: object) -> str:
    """tests/tiny_models.<factory>(out_dir/hf, seed=0, **options) converted by tandem to out_dir/gguf_name, as
    tests/conftest.py builds it; returns the GGUF's path."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    sys.path.insert(0, os.path.join(REPO, "src"))
    import tiny_models

    from tandem.convert import convert_hf

    hf_dir = getattr(tiny_models, factory)(os.path.join(out_dir, "hf"), seed=0, **options)
    return str(convert_hf(hf_dir, os.path.join(out_dir, gguf_name), outtype))


def run_child(script: str, args: Sequence[str]) -> dict | int:
    """Run `script --worker ...args` in a fresh interpreter; its JSON from stdout, or its exit code after
    printing the end of its stderr."""
    cmd = [sys.executable, os.path.abspath(script), *args]
    run = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if run.returncode != 0:
        print(run.stderr[-4000:], file=sys.stderr)
        return run.returncode
    return json.loads(run.stdout)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
