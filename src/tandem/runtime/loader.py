"""Turn tensors of a GGUF file into layer weights, each where the placement plan puts it."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from tandem.errors import UnsupportedModelError
from tandem.gguf import GGUFFile, TensorInfo
from tandem.layers.linear import GGMLExperts, GGMLLinear
from tandem.placement import PlacementPlan
from tandem.quant.dequant import dequantize, dequantize_rows
from tandem.quant.ggml_cpu import CPUKernels, GGMLWeight


def _as_torch_bytes(data: np.ndarray) -> torch.Tensor:
    """A uint8 torch view of mmap'd bytes (read-only in practice; torch warns about that)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data)


@dataclass
class QuantEmbedding:
    """Token embedding rows dequantized on lookup; the table stays quantized in the mmap."""

    info: TensorInfo

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        data = _as_torch_bytes(self.info.data)
        return dequantize_rows(data, self.info.qtype, self.info.shape, ids)


class WeightLoader:
    """Hands out layer weights by GGUF tensor name, obeying the plan."""

    def __init__(self, f: GGUFFile, plan: PlacementPlan, kernels: CPUKernels) -> None:
        self.file = f
        self.plan = plan
        self.kernels = kernels

    def has(self, name: str) -> bool:
        return name in self.file.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.file.tensors[name]
        except KeyError:
            raise UnsupportedModelError(f"{self.file.path.name}: required tensor '{name}' is missing") from None

    def vector(self, name: str) -> torch.Tensor:
        """A small tensor (norm weights, biases) as float32."""
        info = self.info(name)
        return dequantize(_as_torch_bytes(info.data), info.qtype, info.shape)

    def _ggml_weight(self, info: TensorInfo) -> GGMLWeight:
        return GGMLWeight(data=info.data, qtype=info.qtype, shape=info.shape)

    def linear(self, name: str) -> GGMLLinear:
        info = self.info(name)
        return GGMLLinear(self._ggml_weight(info), self.kernels)

    def experts(self, name: str) -> GGMLExperts:
        info = self.info(name)
        return GGMLExperts(self._ggml_weight(info), self.kernels)

    def embedding(self, name: str) -> QuantEmbedding:
        return QuantEmbedding(self.info(name))
