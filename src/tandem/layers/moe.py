"""Mixture-of-experts: routing (softmax, top-k, renormalisation) and the gated experts.

Shapes: T = tokens, D = hidden, E = experts, A = active experts per token, F = expert FFN dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.layers.activations import ACTIVATIONS, GLU
from tandem.layers.linear import Experts, GGMLExperts, Linear
from tandem.layers.norm import rms_norm

# ggml's fused gated units for the activations it computes the same way (ggml_gelu is the tanh form).
_GGML_GLU = {ACTIVATIONS["silu"]: "swiglu", ACTIVATIONS["gelu_tanh"]: "geglu"}


@dataclass(frozen=True)
class Routing:
    ids: torch.Tensor  # [T, A] int64 selected experts
    weights: torch.Tensor  # [T, A] float32 mixing weights


@dataclass
class SoftmaxTopKRouter:
    """Qwen-style router: softmax over all experts, keep the top A, optionally renormalise."""

    proj: Linear  # [E, D]
    n_active: int
    renormalize: bool

    def __call__(self, x: torch.Tensor) -> Routing:
        logits = self.proj(x).float()  # [T, E]
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, self.n_active, dim=-1)  # [T, A]
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(ids=ids, weights=weights)


@dataclass
class GatedExperts:
    """down_e(act(gate_e(x)) * up_e(x)) for each selected expert e, mixed by the routing weights."""

    gate: Experts
    up: Experts
    down: Experts
    act: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        glu = _GGML_GLU.get(self.act)
        if glu is not None and all(isinstance(p, GGMLExperts) for p in (self.gate, self.up, self.down)):
            # All on the CPU: one fused ggml graph for the three products and the mixing.
            kernels = self.gate.kernels  # type: ignore[union-attr]
            return kernels.gated_experts(
                x,
                self.gate.weight,
                self.up.weight,
                self.down.weight,
                routing.ids,
                routing.weights,
                glu,  # type: ignore[union-attr]
            )
        hidden = self.act(self.gate(x, routing.ids)) * self.up(x, routing.ids)  # [T, A, F]
        out = self.down(hidden, routing.ids)  # [T, A, D]
        return (out * routing.weights.unsqueeze(-1).to(out.dtype)).sum(dim=1)  # [T, D]


class Router(Protocol):
    """Picks each token's experts and their mixing weights."""

    def __call__(self, x: torch.Tensor) -> Routing: ...


class RoutedExperts(Protocol):
    """The selected experts of each token, mixed by the routing weights: [T, D] -> [T, D]."""

    def __call__(self, x: torch.Tensor, routing: Routing) -> torch.Tensor: ...


@dataclass
class MoE:
    router: Router
    experts: RoutedExperts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))


@dataclass
class TopKSoftmaxRouter:
    """gpt-oss router: logits (+ bias), keep the top A logits, softmax over those A only."""

    proj: Linear  # [E, D]
    n_active: int
    bias: torch.Tensor | None = None  # [E]

    def __call__(self, x: torch.Tensor) -> Routing:
        logits = self.proj(x).float()  # [T, E]
        if self.bias is not None:
            logits = logits + self.bias
        top, ids = torch.topk(logits, self.n_active, dim=-1)  # [T, A]
        return Routing(ids=ids, weights=torch.softmax(top, dim=-1))


@dataclass
class NormedSoftmaxTopKRouter:
    """Gemma 4 router: logits of rms_norm(x) * input_scale (the norm has no weight of its own), softmax over
    all experts, top A, renormalised."""

    proj: Linear  # [E, D]
    input_scale: torch.Tensor  # [D]
    n_active: int
    eps: float

    def __call__(self, x: torch.Tensor) -> Routing:
        logits = self.proj(rms_norm(x, self.input_scale, self.eps)).float()  # [T, E]
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, self.n_active, dim=-1)  # [T, A]
        return Routing(ids=ids, weights=weights / weights.sum(dim=-1, keepdim=True))


@dataclass
class GLUExperts:
    """down_e(glu(gate_e(x) + bg_e, up_e(x) + bu_e)) * s_e + bd_e for each selected expert e, mixed by
    the routing weights. Gate and up are two stacks, or one fused stack [E, 2F, D] with the gate rows first
    (as llama.cpp's `ffn_gate_up_exps`); biases and the per-expert output scale are optional."""

    down: Experts
    glu: GLU
    gate: Experts | None = None
    up: Experts | None = None
    gate_up: Experts | None = None
    gate_bias: torch.Tensor | None = None  # [E, F]
    up_bias: torch.Tensor | None = None  # [E, F]
    down_bias: torch.Tensor | None = None  # [E, D]
    down_scale: torch.Tensor | None = None  # [E]

    def __call__(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        ids = routing.ids  # [T, A]
        if self.gate_up is not None:
            gate_up = self.gate_up(x, ids)  # [T, A, 2F]
            f = gate_up.shape[-1] // 2
            gate, up = gate_up[..., :f], gate_up[..., f:]
        else:
            assert self.gate is not None and self.up is not None, "GLUExperts needs gate and up, or gate_up"
            gate, up = self.gate(x, ids), self.up(x, ids)  # [T, A, F]
        if self.gate_bias is not None:
            gate = gate + self.gate_bias[ids]
        if self.up_bias is not None:
            up = up + self.up_bias[ids]
        out = self.down(self.glu(gate, up), ids)  # [T, A, D]
        if self.down_scale is not None:
            out = out * self.down_scale[ids].unsqueeze(-1)
        if self.down_bias is not None:
            out = out + self.down_bias[ids]
        return (out * routing.weights.unsqueeze(-1).to(out.dtype)).sum(dim=1)  # [T, D]
