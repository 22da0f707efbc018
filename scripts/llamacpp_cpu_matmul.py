#!/usr/bin/env python
"""llama.cpp's CPU matrix products where they differ from tandem's ggml (ggml-python 0.0.45) calls.

tandem runs its CPU products through ggml's `mul_mat` on the raw GGUF blocks. llama.cpp (0.3.36, CPU
build, defaults) computes two kinds of products differently, and the difference is a few units in the
last place -- enough for llama.cpp's greedy tokens to change (tests/test_real_gemma3.py):

1. Repacked weights. llama.cpp loads the weights its CPU backend can repack into the `CPU_REPACK`
   buffer type (x86 with AVX2: Q4_0, Q4_K, IQ4_NL, MXFP4, and Q2_K with AVX-512, when the row count is
   a multiple of 8) and multiplies them with the interleaved gemm/gemv kernels (`q4_K_8x8_q8_K`, ...),
   which add in another order. ggml-python's CPU backend has the same buffer type and kernels:
   `RepackedWeights` copies a weight into it, and the product then matches llama.cpp exactly.
2. The tiled K-quant product (ggml-cpu/tiled, new in this llama.cpp): for 8 rows of activations or
   more, K-quant weights that are not repacked (Q6_K, Q5_K, Q3_K, IQ*) go through a 256x256 tiled
   kernel instead of `vec_dot`. ggml-python does not have it. `tiled_q6_k_matmul` computes its Q6_K
   case exactly in torch: the integer sub-block sums are exact, and the float steps are the kernel's
   (per 256-block: float(sum) * d_weight, then fma(that, d_activation, accumulator), block by block).

`install()` routes `GGMLLinear` through these (a monkeypatch, for experiments and tests):

    python scripts/greedy_vs_llamacpp.py --llamacpp-matmul     # 8 of 8 prompts, 32 tokens each

The proper home is tandem/quant/ggml_cpu.py (repack at load time, the tiled path in `CPUKernels.matmul`).
A third difference is in the model graph: llama.cpp drops all rows but the ones whose logits it returns
right after the last layer's attention, so that layer's FFN runs on 1 row (vec_dot) where tandem's runs
on all (tiled when >= 8).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import ggml
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from tandem.layers import linear
from tandem.quant.ggml_cpu import GGMLWeight

REPACKABLE = {Q.Q4_0, Q.Q4_K, Q.IQ4_NL, Q.MXFP4, Q.Q2_K}  # ggml's x86 candidates; ggml has the last word
TILED_MIN_ROWS = 8  # ggml_tiled_min_batch
_QK_K = 256
_Q6_K_BYTES = 210  # ql[128], qh[64], scales[16] (int8), d (f16)


def _repack_buffer_type() -> int | None:
    """ggml's CPU_REPACK buffer type, from the CPU device's extra buffer types (None if absent)."""
    reg = ggml.ggml_backend_cpu_reg()
    proc = ggml.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if not proc:
        return None
    get_extra = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(proc)
    types = get_extra(ggml.ggml_backend_reg_dev_get(reg, 0))
    i = 0
    while types[i]:
        if ggml.ggml_backend_buft_name(types[i]) == b"CPU_REPACK":
            return int(types[i])
        i += 1
    return None


class RepackedWeights:
    """Weights copied into ggml's CPU_REPACK buffers, and products on them (one CPU backend)."""

    def __init__(self, n_threads: int) -> None:
        self._buft = _repack_buffer_type()
        self._backend = ggml.ggml_backend_cpu_init()
        ggml.ggml_backend_cpu_set_n_threads(self._backend, n_threads)
        self._tensors: dict[int, tuple[Any, Any, Any, GGMLWeight] | None] = {}
        self._lock = threading.Lock()

    def _repacked(self, w: GGMLWeight) -> Any | None:
        """The repacked ggml tensor of w, or None when ggml does not repack it."""
        key = id(w)
        if key in self._tensors:
            entry = self._tensors[key]
            return None if entry is None else entry[1]
        entry = None
        if self._buft is not None and w.qtype in REPACKABLE and len(w.shape) == 2:
            n, k = w.shape
            mem = ggml.ggml_tensor_overhead() * 2
            ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=mem, mem_buffer=None, no_alloc=True))
            t = ggml.ggml_new_tensor_2d(ctx, int(w.qtype), k, n)
            buf = ggml.ggml_backend_buft_alloc_buffer(self._buft, ggml.ggml_nbytes(t) + 64)
            ggml.ggml_backend_tensor_alloc(buf, t, ggml.ggml_backend_buffer_get_base(buf))
            if t.contents.extra:  # ggml chose a repacked layout (set_tensor would abort otherwise)
                ggml.ggml_backend_tensor_set(t, w.data.ctypes.data_as(ctypes.c_void_p), 0, w.data.nbytes)
                entry = (ctx, t, buf, w)
            else:
                ggml.ggml_backend_buffer_free(buf)
                ggml.ggml_free(ctx)
        self._tensors[key] = entry
        return None if entry is None else entry[1]

    def matmul(self, x: torch.Tensor, w: GGMLWeight) -> torch.Tensor | None:
        """x [T, K] @ W^T through the repacked kernels, or None when W is not repacked."""
        with self._lock:
            t = self._repacked(w)
            if t is None:
                return None
            n, k = w.shape
            x = x.to(dtype=torch.float32, device="cpu").contiguous()
            rows = x.shape[0]
            mem = ggml.ggml_tensor_overhead() * 8 + ggml.ggml_graph_overhead()
            ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=mem, mem_buffer=None, no_alloc=True))
            try:
                xt = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, k, rows)
                out = ggml.ggml_mul_mat(ctx, t, xt)
                y = torch.empty(rows, n, dtype=torch.float32)
                xt.contents.data = x.data_ptr()
                out.contents.data = y.data_ptr()
                graph = ggml.ggml_new_graph(ctx)
                ggml.ggml_build_forward_expand(graph, out)
                if ggml.ggml_backend_graph_compute(self._backend, graph) != 0:
                    raise RuntimeError("ggml graph compute failed")
            finally:
                ggml.ggml_free(ctx)
            return y


def quantize_q8_k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's `quantize_row_q8_K_ref` on x [T, K]: codes [T, K/256, 256] (as float) and d [T, K/256].

    Per 256-block: the value of largest magnitude (the first one), iscale = -127/max, codes
    nearest_int(iscale * x) capped at 127 (round half to even, as the magic-number trick), d = 1/iscale."""
    t, k = x.shape
    blocks = x.float().reshape(t, k // _QK_K, _QK_K)
    first = blocks.abs().argmax(-1, keepdim=True)
    peak = blocks.gather(-1, first)
    zero = peak == 0
    iscale = torch.where(zero, 0.0, (-127.0 / peak.double()).float())
    codes = torch.round(iscale * blocks).clamp(max=127)
    d = torch.where(zero, 0.0, (1.0 / iscale.double()).float())
    return codes, d[..., 0]


_Q6: dict[int, tuple[torch.Tensor, torch.Tensor, GGMLWeight]] = {}


def _q6_k_parts(w: GGMLWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale * (q - 32)) as float64 [K/256, 256, N] (exact integers) and d [N, K/256] of a Q6_K weight."""
    key = id(w)
    if key not in _Q6:
        n, k = w.shape
        raw = w.data.reshape(n, k // _QK_K, _Q6_K_BYTES)
        scales = raw[:, :, 192:208].copy().view(np.int8).astype(np.float64)  # [N, B, 16]
        d = raw[:, :, 208:210].copy().view(np.float16).astype(np.float32)[..., 0]  # [N, B]
        unit = raw.copy()  # the same blocks with d = 1 and every scale 1: dequantizing gives q - 32
        unit[:, :, 192:208] = 1
        unit[:, :, 208:210] = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
        q = dequantize(unit.reshape(-1), Q.Q6_K).reshape(n, k // _QK_K, 16, 16).astype(np.float64)
        weights = torch.from_numpy((q * scales[..., None]).reshape(n, k // _QK_K, _QK_K))
        _Q6[key] = (weights.permute(1, 2, 0).contiguous(), torch.from_numpy(d), w)
    weights, d, _ = _Q6[key]
    return weights, d


def tiled_q6_k_matmul(x: torch.Tensor, w: GGMLWeight) -> torch.Tensor:
    """x [T, K] @ W^T for a Q6_K W, as ggml's tiled kernel computes it (AVX-512 VNNI build)."""
    weights, d_w = _q6_k_parts(w)
    codes, d_x = quantize_q8_k(x)
    # per block: sum_s scale_s * sum_e (q - 32) * code, exact in float64 (|sum| < 2^28)
    sums = torch.bmm(codes.double().transpose(0, 1), weights)  # [B, T, N]
    per_block = sums.float() * d_w.t()[:, None, :]  # float(s1) * d_weight
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32)
    for b in range(per_block.shape[0]):  # acc = fma(per_block, d_activation, acc), block after block
        acc = (per_block[b].double() * d_x[:, b, None].double() + acc.double()).float()
    return acc


def install(n_threads: int = 2) -> Callable[[], None]:
    """Route `GGMLLinear` products through llama.cpp's kernels (repacked, tiled Q6_K); returns the undo."""
    repacked = RepackedWeights(n_threads)
    original = linear.GGMLLinear.__call__

    def call(self: linear.GGMLLinear, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        y = repacked.matmul(x, w)
        if y is not None:
            return y
        if w.qtype == Q.Q6_K and x.shape[0] >= TILED_MIN_ROWS:
            return tiled_q6_k_matmul(x, w)
        return original(self, x)

    linear.GGMLLinear.__call__ = call  # type: ignore[method-assign]

    def undo() -> None:
        linear.GGMLLinear.__call__ = original  # type: ignore[method-assign]

    return undo


@contextmanager
def installed(n_threads: int = 2) -> Iterator[None]:
    """`install()` for the duration of a with-block."""
    undo = install(n_threads)
    try:
        yield
    finally:
        undo()
