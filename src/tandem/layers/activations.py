"""Gated activations used by the MLPs and experts."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import ggml
import numpy as np
import torch
import torch.nn.functional as F

from tandem.errors import UnsupportedModelError


def _silu(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


@functools.cache
def ggml_gelu_table() -> torch.Tensor:
    """ggml's GELU lookup table [65536] (float32 values of f16 results), indexed by the f16 bit pattern
    of the input: ggml computes it at start-up from the tanh formula and reads it through its own
    `gelu` op here, so that the entries are exactly the ones ggml uses."""
    n = 1 << 16
    mem = 2 * n * 2 + 4 * ggml.ggml_tensor_overhead() + ggml.ggml_graph_overhead() + 4096
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=mem, mem_buffer=None, no_alloc=False))
    if not ctx:
        raise MemoryError("ggml_init failed")
    try:
        x = ggml.ggml_new_tensor_1d(ctx, ggml.GGML_TYPE_F16, n)
        bits = np.arange(n, dtype=np.uint16)
        ctypes.memmove(ggml.ggml_get_data(x), bits.ctypes.data, bits.nbytes)
        y = ggml.ggml_gelu(ctx, x)
        graph = ggml.ggml_new_graph(ctx)
        ggml.ggml_build_forward_expand(graph, y)
        ggml.ggml_graph_compute_with_ctx(ctx, graph, 1)
        ptr = ctypes.cast(ggml.ggml_get_data(y), ctypes.POINTER(ctypes.c_uint16))
        table = np.ctypeslib.as_array(ptr, shape=(n,)).copy().view(np.float16).astype(np.float32)
    finally:
        ggml.ggml_free(ctx)
    return torch.from_numpy(table)


def _gelu_tanh_ggml(x: torch.Tensor) -> torch.Tensor:
    """GELU (tanh approximation) as ggml's CPU backend computes it for float32 (`ggml_vec_gelu_f32` and
    `ggml_vec_geglu_f32` with GGML_GELU_FP16): 0 at or below -10, x at or above 10, and in between
    the f16 table entry of x rounded to f16. That is up to ~1e-3 away from the formula; llama.cpp's
    tokens depend on it. On a GPU this is the formula (torch's fused kernel)."""
    if x.is_cuda:
        return F.gelu(x, approximate="tanh")
    x32 = x.float()
    index = x32.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    y = ggml_gelu_table()[index]
    y = torch.where(x32 >= 10.0, x32, y)
    y = torch.where(x32 <= -10.0, torch.zeros_like(y), y)
    return y.to(x.dtype)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": _silu,  # SwiGLU
    "gelu_tanh": _gelu_tanh,  # GEGLU
    # GEGLU with ggml's f16 GELU table (on the CPU): what llama.cpp computes for the same file
    "gelu_tanh_ggml": _gelu_tanh_ggml,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function called `name`."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise UnsupportedModelError(f"unknown activation '{name}'") from None


GLU = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (gate, up) -> gated hidden state


def gated(act: Callable[[torch.Tensor], torch.Tensor]) -> GLU:
    """The plain gated unit act(gate) * up (SwiGLU for silu, GEGLU for gelu_tanh)."""

    def glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return act(gate) * up

    return glu


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU (ggml_swiglu_oai): g = min(gate, limit), u = clamp(up, +-limit),
    g * sigmoid(alpha * g) * (u + 1)."""
    g = gate.clamp(max=limit)
    u = up.clamp(min=-limit, max=limit)
    return g * torch.sigmoid(alpha * g) * (u + 1)
