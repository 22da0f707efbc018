"""tandem's defaults at least as close to transformers as llama.cpp's defaults, family by family.

The tiny MoE models of every family (f32 GGUF), prompts of 1, 7, 33 and 80 tokens (past the sliding windows and a
delta-net chunk); transformers' f32 logits computed here, llama.cpp's closeness to them recorded with the peer build
(scripts/fidelity.py --record: f16 K/V cache, no flash attention; on the CPU also `--flash-attn`, llama.cpp's CLI
default there, which tandem's CPU step graphs compute by default with an f16 cache). The CPU path is compared with
llama.cpp's CPU build here and in CI; the GPU path (bf16 products, f16 cache, experts on the GPU or in host RAM)
with its CUDA build under `pytest -m gpu`.

Bound: tandem's largest |logit difference| over the prompts at most 1.1 times llama.cpp's, and at least as many
positions whose argmax agrees. The engines do not round at the same places (for float files tandem's GELU is
transformers' tanh formula, llama.cpp's ggml's f16 table; the GPU products differ), so equal-or-better closeness,
not equal logits, is the bar; the failures this guards against were 100 times llama.cpp's.
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tandem

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from fidelity import SETTINGS, prompts  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
FAMILIES = ["qwen3moe", "qwen35moe", "gpt_oss", "gemma4"]
RATIO = 1.1
REFERENCE_ROUNDING = 1e-6  # transformers' f32 logits, from one CPU to another


def _fixture(backend: str, flash: bool) -> dict[str, Any]:
    name = f"fidelity_llamacpp_{backend}{'_fa' if flash else ''}.json"
    return json.loads((FIXTURES / name).read_text(encoding="utf-8"))["families"]


def _reference(hf_dir: Path, ids: list[list[int]]) -> list[np.ndarray]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0].float().numpy() for p in ids]


def _llama(family: str, backend: str, flash: bool, gguf_path: Path, refs: list[np.ndarray]) -> tuple[float, int]:
    """llama.cpp's recorded closeness (max |diff|, argmax agreement), with flash attention or without."""
    fx = _fixture(backend, flash)[family]
    if hashlib.sha256(gguf_path.read_bytes()).hexdigest() != fx["gguf_sha256"]:
        pytest.fail(f"the tiny {family} no longer converts to the recorded GGUF: re-run scripts/fidelity.py --record")
    llama_max = max(fx["max_abs_diff"])
    # the recorded figures belong to these prompts and this reference: llama.cpp's stored columns say so too. The
    # reference's own sums round by CPU (MKL picks its kernels by machine): ~1e-8 apart between CI machines, while a
    # wrong prompt or reference is off by whole logits.
    for b64, r in zip(fx["logits_b64"], refs, strict=True):
        cols = np.frombuffer(base64.b64decode(b64), dtype=np.float32).reshape(len(r), -1)
        assert float(np.abs(cols - r[:, fx["columns"]]).max()) <= llama_max + REFERENCE_ROUNDING
    return llama_max, sum(int((np.asarray(a) == r.argmax(-1)).sum()) for a, r in zip(fx["argmax"], refs, strict=True))


def _check(family: str, backend: str, settings: list[str], request: pytest.FixtureRequest) -> None:
    """Each setting against llama.cpp computing attention as it does: on the CPU, with flash attention where its
    step graphs use ggml's flash-attention node (their default with an f16 cache, as llama.cpp's CLI default), else
    without (its graph of `-fa off`, and the layer path's attention, which is that graph's)."""
    hf_dir, gguf_path = request.getfixturevalue(f"tiny_{family}_gguf")
    with tandem.LLM(gguf_path, device="cpu", n_ctx=128) as probe:
        ids = prompts(probe.config.n_vocab)
    refs = _reference(hf_dir, ids)
    failures = []
    for name in settings:
        with tandem.LLM(gguf_path, threads=2, n_ctx=128, **SETTINGS[name]) as llm:
            graph = llm.engine.runner.cpu_graph
            flash = backend == "cpu" and graph is not None and graph.flash
            outs = [llm.logits(p) for p in ids]
        llama_max, llama_agree = _llama(family, backend, flash, gguf_path, refs)
        ours_max = max(float(np.abs(o - r).max()) for o, r in zip(outs, refs, strict=True))
        agree = sum(int((o.argmax(-1) == r.argmax(-1)).sum()) for o, r in zip(outs, refs, strict=True))
        line = (f"{family} tandem {name}: max |diff| {ours_max:.2e}, argmax {agree}; llama.cpp {backend}"
                f"{' with flash attention' if flash else ''} {llama_max:.2e}, {llama_agree}")  # fmt: skip
        print(line)
        if ours_max > RATIO * llama_max or agree < llama_agree:
            failures.append(line)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("family", FAMILIES)
def test_cpu_defaults_as_close_as_llama_cpp(family: str, request: pytest.FixtureRequest) -> None:
    _check(family, "cpu", ["cpu"], request)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run with -m gpu on the device)")
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_defaults_as_close_as_llama_cpp(family: str, request: pytest.FixtureRequest) -> None:
    _check(family, "cuda", ["gpu", "gpu-cpu-moe", "gpu-n-cpu-moe"], request)
