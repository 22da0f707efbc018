"""GPU-side weights: linears and stacked experts, quantized (Triton) or dense (torch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.cuda.qlinear import GPUQuantWeight, ggml_rounded_input, matmul_out, qmatmul, qmatmul_id
from tandem.cuda.routing import router_logits

ROUTER_GEMV_MAX_ROWS = 16  # decode batches; larger ones are worth cuBLAS's GEMM


@dataclass(eq=False)
class GPUQuantLinear:
    weight: GPUQuantWeight
    ieee: bool  # exact f32 products (--dtype f32) instead of bf16 tensor-core products

    @property
    def out_features(self) -> int:
        return self.weight.n_out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return qmatmul(x, self.weight, self.ieee)


@dataclass(eq=False)
class GPUQuantExperts:
    weight: GPUQuantWeight  # [E, N, K]
    ieee: bool
    # Inputs rounded first as ggml's CPU backend rounds them (`ggml_rounded_input`): experts computed here in
    # place of ggml's, beside ggml's own, which must give its values (--pcie-experts).
    ggml_inputs: bool = False
    # One part of a split (layers/moe.py split_routing): ids -1 are slots another part computes, rows of zeros.
    skips: bool = False

    @property
    def out_features(self) -> int:
        return self.weight.n_out

    def __call__(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.ggml_inputs:
            x = ggml_rounded_input(x, self.weight.qtype)
        return qmatmul_id(x, self.weight, ids, self.ieee, self.skips)


@dataclass(eq=False)
class DenseLinear:
    """A plain float weight [N, K] (kept in its own float type, or dequantized at load)."""

    weight: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return matmul_out(x.to(self.weight.dtype), self.weight.T, x.dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T in f32 for a router, x [T, K] in any float type -> [T, N] f32: one GEMV kernel for a few
        rows on the GPU (see router_logits), else as __call__ on x in f32."""
        if x.is_cuda and x.shape[0] <= ROUTER_GEMV_MAX_ROWS:
            return router_logits(x, self.weight)
        return self(x.float())


@dataclass(eq=False)
class DenseExperts:
    """Plain float experts [E, N, K]: one product per distinct selected expert."""

    weight: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.weight.shape[1]

    def __call__(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        t, a = ids.shape
        xs = x.unsqueeze(1).expand(t, a, x.shape[-1]) if x.dim() == 2 else x
        flat_x = xs.reshape(t * a, -1).to(self.weight.dtype)
        flat_ids = ids.reshape(-1)
        if t * a <= 32:  # decode: gather the selected experts (no host sync, so it can be graph-captured)
            w = self.weight.index_select(0, flat_ids)  # [R, N, K]
            return torch.bmm(w, flat_x.unsqueeze(-1)).squeeze(-1).to(x.dtype).view(t, a, -1)
        out = torch.empty(t * a, self.weight.shape[1], dtype=x.dtype, device=x.device)
        for e in torch.unique(flat_ids).tolist():
            rows = (flat_ids == e).nonzero(as_tuple=True)[0]
            out[rows] = matmul_out(flat_x[rows], self.weight[e].T, x.dtype)
        return out.view(t, a, -1)
