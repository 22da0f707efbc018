"""Linear maps over weights kept as they lie in the GGUF file.

A `Linear` is anything callable as y = f(x) with x [T, K] -> [T, N]. Which implementation a
weight gets is decided by the placement plan; the layers never look at devices themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.quant.ggml_cpu import CPUKernels
from tandem.quant.ggml_weights import GGMLWeight


class Linear(Protocol):
    """y = x @ W^T for x [T, K]."""

    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class Experts(Protocol):
    """Stacked expert matrices [E, N, K] applied to each token's selected experts."""

    out_features: int

    def __call__(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, K] (shared by a token's experts) or [T, A, K] (one row per selected expert);
        ids [T, A] -> [T, A, N]."""
        ...


@dataclass
class GGMLLinear:
    """A CPU linear on quantized blocks through ggml's kernels: the weight in the mmap, or as llama.cpp's CPU
    backend holds it when the loader prepared it (`prepare_cpu_weight`: a repacked copy)."""

    weight: GGMLWeight
    kernels: CPUKernels

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.matmul(x, self.weight)


@dataclass
class GGMLExperts:
    """CPU experts through ggml's mul_mat_id: only the selected experts' rows are read."""

    weight: GGMLWeight
    kernels: CPUKernels

    @property
    def out_features(self) -> int:
        return self.weight.shape[1]

    def __call__(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.kernels.mul_mat_id(x, self.weight, ids)


@dataclass
class BiasedLinear:
    """y = inner(x) + bias: a Linear with a bias vector [N] (kept apart from the weight's own format)."""

    inner: Linear
    bias: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.inner.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) + self.bias
