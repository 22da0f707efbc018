"""The loader of one tensor-parallel rank (`--tp N`): the ordinary WeightLoader over the rank's view of the file
(each tensor its slice, placement/tp.py) and its own plan, with two additions: each layer's routed experts are the
rank's subset (`ExpertSubset` maps the router's choices to them), and every upload is recorded, so that what a rank
put in VRAM can be checked against its plan (no CPU-planned tensor on any rank's GPU)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.gguf import GGUFFile, TensorInfo
from tandem.layers.moe import RoutedExperts
from tandem.layers.parallel import ExpertSubset
from tandem.placement import PlacementPlan
from tandem.quant.ggml_cpu import CPUKernels
from tandem.weights.loader import WeightLoader
from tandem.weights.offload import ExpertSource


class RankLoader(WeightLoader):
    """Hands out one rank's slices of the weights, obeying the rank's plan."""

    def __init__(
        self,
        view: GGUFFile,
        plan: PlacementPlan,
        kernels: CPUKernels,
        expert_ranges: dict[int, tuple[int, int]],
        dtype: torch.dtype = torch.float32,
        repack_experts: bool = False,
    ) -> None:
        self.expert_ranges = expert_ranges  # MoE layer -> the experts [first, end) of the model's this rank holds
        self.uploaded: list[str] = []  # every tensor whose bytes went to a GPU, in order
        super().__init__(view, plan, kernels, dtype, repack_experts=repack_experts)

    def _upload(self, info: TensorInfo, device: torch.device) -> torch.Tensor:
        self.uploaded.append(info.name)
        return super()._upload(info, device)

    def routed_experts(self, layer: int, build: Callable[[ExpertSource], RoutedExperts]) -> RoutedExperts:
        first, end = self.expert_ranges[layer]
        return ExpertSubset(super().routed_experts(layer, build), first, end - first)
