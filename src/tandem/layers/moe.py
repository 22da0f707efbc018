"""Mixture-of-experts: routing (softmax, top-k, renormalisation) and the gated experts.

Shapes: T = tokens, D = hidden, E = experts, A = active experts per token, F = expert FFN dim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tandem.layers.activations import GLU, gelu_from_table, ggml_gelu_table
from tandem.layers.linear import Experts, GGMLExperts, Linear
from tandem.layers.norm import rms_norm
from tandem.quant.expert_ffn import ExpertFFN, check_gate_up
from tandem.quant.ggml_cpu import CPUKernels
from tandem.quant.ggml_weights import GGMLWeight

# The result of routed experts that may still be computing on the host (see weights/offload.py).
Pending = Callable[[], torch.Tensor]


@dataclass(frozen=True)
class Routing:
    ids: torch.Tensor  # [T, A] selected experts: int32 from the GPU kernel, int64 from torch.topk on the CPU
    weights: torch.Tensor  # [T, A] float32 mixing weights


@dataclass(frozen=True)
class SplitRouting:
    """A token's selected experts split three ways (`split_routing`), each part [T, A] like the routing itself:
    - `resident`: slot ids of the experts cached in VRAM (-1 elsewhere, weight 0);
    - `cpu`: the experts ggml computes, packed to the front of each row (the row's first one repeated, weight 0,
      after them), with `cpu_counts` [T] int32 of them per row;
    - `pcie` (with --pcie-experts): the experts the GPU reads over PCIe (-1 elsewhere, weight 0)."""

    resident: Routing
    cpu: Routing
    cpu_counts: torch.Tensor
    pcie: Routing | None


def split_routing(routing: Routing, slot_map: torch.Tensor, pcie_slots: int = 0) -> SplitRouting:
    """Split each token's experts between the ones cached in VRAM (`slot_map` [E] int32: the expert's slot, or -1)
    and the others; of the others, the last (pcie_slots * others) // A of the row (the lowest weights) go over PCIe
    when pcie_slots > 0, the rest to ggml. No host sync; on a GPU one kernel (cuda/routing.py `split_route`)."""
    ids, weights = routing.ids, routing.weights.float()
    if ids.is_cuda:
        from tandem.cuda.routing import split_route

        res_p, cpu_p, n, pcie_p = split_route(ids, weights, slot_map, pcie_slots)
        return SplitRouting(Routing(*res_p), Routing(*cpu_p), n, None if pcie_p is None else Routing(*pcie_p))
    t, a = ids.shape
    local = slot_map[ids.long()]  # [T, A]
    resident = local >= 0
    other = ~resident
    rank = torch.cumsum(other.to(torch.int32), dim=1) - other.to(torch.int32)  # among the row's others, in order
    n_other = other.sum(dim=1, dtype=torch.int32)
    n_pcie = (pcie_slots * n_other) // a
    n_cpu = n_other - n_pcie
    to_cpu = other & (rank < n_cpu[:, None])
    to_pcie = other & ~to_cpu
    zero = torch.zeros_like(weights)
    res = Routing(torch.where(resident, local, -1).to(torch.int32), torch.where(resident, weights, zero))
    # ggml's part: packed to the front, in order (a stable sort puts the CPU slots first)
    order = torch.sort((~to_cpu).to(torch.int8), dim=1, stable=True).indices
    packed_ids = ids.gather(1, order).to(torch.int32)
    packed_w = torch.where(to_cpu, weights, zero).gather(1, order)
    have = torch.arange(a, device=ids.device)[None, :] < n_cpu[:, None]
    pad = torch.where(n_cpu > 0, packed_ids[:, 0], ids[:, 0].to(torch.int32))[:, None]
    cpu = Routing(torch.where(have, packed_ids, pad), torch.where(have, packed_w, zero))
    pcie = None
    if pcie_slots:
        pcie = Routing(torch.where(to_pcie, ids.to(torch.int32), -1), torch.where(to_pcie, weights, zero))
    return SplitRouting(res, cpu, n_cpu.to(torch.int32), pcie)


def split_streamed(routing: Routing, slot_map: torch.Tensor) -> tuple[Routing, Routing]:
    """Prefill's split: (the experts cached in VRAM by slot, the others by id), -1 and weight 0 where a token's
    expert is in the other part, so that streaming copies only experts no cached slot holds."""
    ids, weights = routing.ids, routing.weights.float()
    local = slot_map[ids.long()]
    resident = local >= 0
    zero = torch.zeros_like(weights)
    res = Routing(torch.where(resident, local, -1).to(torch.int32), torch.where(resident, weights, zero))
    rest = Routing(torch.where(resident, -1, ids.to(torch.int32)), torch.where(resident, zero, weights))
    return res, rest


@dataclass(eq=False)
class RoutingCounts:
    """How often each expert of each layer was picked: [n_layers, E] int64 on the compute device, added to by
    every step's top-k (an index_add per layer, no host sync, so it runs inside captured decode graphs).
    `begin_step` weighs the step's rows: 1, or 0 for the padding rows of a pooled decode step."""

    counts: torch.Tensor
    n_active: int
    _weights: torch.Tensor | None = field(default=None, init=False, repr=False)

    @classmethod
    def zeros(cls, n_layers: int, n_experts: int, n_active: int, device: torch.device) -> RoutingCounts:
        return cls(torch.zeros(n_layers, n_experts, dtype=torch.int64, device=device), n_active)

    def begin_step(self, n_rows: int, slots: torch.Tensor | None = None) -> None:
        """The rows of the coming step: all of them count, or (a pooled decode step) those whose slot is >= 0."""
        device = self.counts.device
        if slots is None:
            self._weights = torch.ones(n_rows * self.n_active, dtype=torch.int64, device=device)
        else:
            self._weights = (slots >= 0).to(torch.int64).repeat_interleave(self.n_active)

    def count(self, layer: int, ids: torch.Tensor) -> None:
        flat = ids.reshape(-1)
        weights = self._weights
        if weights is None or weights.numel() != flat.numel():  # a step begun elsewhere (tests, a bare forward)
            weights = torch.ones(flat.numel(), dtype=torch.int64, device=self.counts.device)
        self.counts[layer].index_add_(0, flat, weights)

    def read(self) -> torch.Tensor:
        """A copy of the counts on the host (waits for the device)."""
        return self.counts.to("cpu", copy=True)


@dataclass(eq=False)
class CountedExperts:
    """Routed experts whose picks are counted (`RoutingCounts`) before they compute."""

    inner: RoutedExperts
    counts: RoutingCounts
    layer: int

    def __call__(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        self.counts.count(self.layer, routing.ids)
        return self.inner(x, routing)

    def start(self, x: torch.Tensor, routing: Routing) -> Pending:
        self.counts.count(self.layer, routing.ids)
        return start_experts(self.inner, x, routing)

    def __getattr__(self, name: str) -> object:
        """The wrapped experts' public attributes (host, pcie, ...); not their private ones: a path that computes
        them from their description (the CPU step graph reads `_graph`) would skip the counting."""
        if name.startswith("_") or name in ("inner", "counts", "layer"):
            raise AttributeError(name)
        return getattr(self.inner, name)


def _router_logits(proj: Linear, x: torch.Tensor) -> torch.Tensor:
    """Router logits [T, E] in f32, as llama.cpp computes the router. A projection with its own f32 path
    (DenseLinear.logits: one kernel at decode on the GPU, reading x as it is) takes x directly; any other
    gets x in f32."""
    logits = getattr(proj, "logits", None)
    return proj(x.float()) if logits is None else logits(x)


def _route_on_gpu(
    logits: torch.Tensor,
    n_active: int,
    softmax_first: bool,
    renormalize: bool = False,
    bias: torch.Tensor | None = None,
) -> Routing:
    """Routing of logits on the GPU in one fused kernel (tandem.cuda.routing) instead of ~6 torch kernels;
    imported here, as Triton is needed only with a GPU."""
    from tandem.cuda.routing import route

    ids, weights = route(logits, n_active, softmax_first, renormalize, bias)
    return Routing(ids=ids, weights=weights)


@dataclass
class SoftmaxTopKRouter:
    """Qwen-style router: softmax over all experts, keep the top A, optionally renormalise."""

    proj: Linear  # [E, D]
    n_active: int
    renormalize: bool

    def __call__(self, x: torch.Tensor) -> Routing:
        logits = _router_logits(self.proj, x)  # [T, E]
        if logits.is_cuda:
            return _route_on_gpu(logits, self.n_active, softmax_first=True, renormalize=self.renormalize)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.n_active, dim=-1)  # [T, A]
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(ids=ids, weights=weights)


class Router(Protocol):
    """Picks each token's experts and their mixing weights."""

    def __call__(self, x: torch.Tensor) -> Routing: ...


class RoutedExperts(Protocol):
    """The selected experts of each token, mixed by the routing weights: [T, D] -> [T, D]."""

    def __call__(self, x: torch.Tensor, routing: Routing) -> torch.Tensor: ...


def start_experts(experts: RoutedExperts, x: torch.Tensor, routing: Routing) -> Pending:
    """Begin the routed experts; the returned function gives their output [T, D]. Experts kept in host RAM
    compute on the CPU until it is called, so GPU work queued in between (a shared expert, a dense branch)
    runs at the same time; other experts compute right away."""
    start = getattr(experts, "start", None)
    if start is not None:
        return start(x, routing)
    out = experts(x, routing)
    return lambda: out


@dataclass
class MoE:
    router: Router
    experts: RoutedExperts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))

    def start(self, x: torch.Tensor) -> Pending:
        """As __call__, but the result is asked for later (see start_experts)."""
        return start_experts(self.experts, x, self.router(x))


@dataclass
class TopKSoftmaxRouter:
    """gpt-oss router: logits (+ bias), keep the top A logits, softmax over those A only."""

    proj: Linear  # [E, D]
    n_active: int
    bias: torch.Tensor | None = None  # [E]

    def __call__(self, x: torch.Tensor) -> Routing:
        logits = _router_logits(self.proj, x)  # [T, E]
        if logits.is_cuda:
            return _route_on_gpu(logits, self.n_active, softmax_first=False, bias=self.bias)
        logits = logits.float()
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
        logits = _router_logits(self.proj, rms_norm(x.float(), self.input_scale, self.eps))  # [T, E]
        if logits.is_cuda:
            return _route_on_gpu(logits, self.n_active, softmax_first=True, renormalize=True)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.n_active, dim=-1)  # [T, A]
        return Routing(ids=ids, weights=weights / weights.sum(dim=-1, keepdim=True))


@dataclass
class GLUExperts:
    """down_e(glu(gate_e(x) + bg_e, up_e(x) + bu_e)) * s_e + bd_e for each selected expert e, mixed by
    the routing weights. Gate and up are two stacks, or one fused stack [E, 2F, D] with the gate rows first
    (as llama.cpp's `ffn_gate_up_exps`); biases and the per-expert output scale are optional.

    When every stack is a ggml CPU expert stack (of one CPUKernels), the vectors are on the CPU and ggml has
    the gated unit, the whole FFN runs as one ggml graph (`CPUKernels.gated_experts`), and `bind` prepares it
    on fixed buffers; otherwise the products run one by one with torch between them.
    """

    down: Experts
    glu: GLU
    gate: Experts | None = None
    up: Experts | None = None
    gate_up: Experts | None = None
    gate_bias: torch.Tensor | None = None  # [E, F]
    up_bias: torch.Tensor | None = None  # [E, F]
    down_bias: torch.Tensor | None = None  # [E, D]
    down_scale: torch.Tensor | None = None  # [E]
    _graph: tuple[CPUKernels, ExpertFFN] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_gate_up("GLUExperts", self.gate, self.up, self.gate_up)
        self._graph = self._ggml_graph()

    def _ggml_graph(self) -> tuple[CPUKernels, ExpertFFN] | None:
        """The kernels and ggml's description of this FFN when it can run as one ggml graph, else None."""
        stacks = [s for s in (self.gate, self.up, self.gate_up, self.down) if s is not None]
        on_cpu = [s for s in stacks if isinstance(s, GGMLExperts)]
        vectors = [v for v in (self.gate_bias, self.up_bias, self.down_bias, self.down_scale) if v is not None]
        if self.glu.ggml is None or len(on_cpu) < len(stacks):
            return None
        kernels = on_cpu[0].kernels
        if any(s.kernels is not kernels for s in on_cpu) or not all(v.is_cpu for v in vectors):
            return None
        ffn = ExpertFFN(
            down=_ggml_weight(self.down),
            glu=self.glu.ggml,
            glu_params=self.glu.ggml_params,
            gate=_ggml_weight(self.gate),
            up=_ggml_weight(self.up),
            gate_up=_ggml_weight(self.gate_up),
            gate_bias=self.gate_bias,
            up_bias=self.up_bias,
            down_bias=self.down_bias,
            down_scale=self.down_scale,
        )
        return kernels, ffn

    def bind(self, x: torch.Tensor, routing: Routing, out: torch.Tensor) -> Callable[[], None] | None:
        """A prepared call computing out [T, D] from the fixed buffers x and routing (see
        CPUKernels.gated_experts_into), or None when this FFN does not run as one ggml graph."""
        if self._graph is None:
            return None
        kernels, ffn = self._graph
        return kernels.gated_experts_into(out, x, ffn, routing.ids, routing.weights)

    def __call__(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        if self._graph is not None:  # on the CPU: one ggml graph for the products, the glue and the mixing
            kernels, ffn = self._graph
            return kernels.gated_experts(x, ffn, routing.ids, routing.weights)
        ids = routing.ids  # [T, A]
        if self.gate_up is not None:
            gate_up = self.gate_up(x, ids)  # [T, A, 2F]
            f = gate_up.shape[-1] // 2
            gate, up = gate_up[..., :f], gate_up[..., f:]
        else:
            assert self.gate is not None and self.up is not None
            gate, up = self.gate(x, ids), self.up(x, ids)  # [T, A, F]
        if self.gate_bias is not None:
            gate = gate + self.gate_bias[ids]
        if self.up_bias is not None:
            up = up + self.up_bias[ids]
        return mix_expert_rows(self.down(self.glu(gate, up), ids), routing, self.down_scale, self.down_bias)


def mix_expert_rows(
    out: torch.Tensor, routing: Routing, scale: torch.Tensor | None = None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """[T, D]: the selected experts' rows out [T, A, D], each times its expert's scale [E] plus its bias [E, D]
    (both optional), mixed by the routing weights. One kernel on CUDA for float32 operands."""
    ids, weights = routing.ids, routing.weights
    vectors = [v for v in (scale, bias) if v is not None]
    if out.is_cuda and all(t.dtype == torch.float32 and t.is_cuda for t in (out, weights, *vectors)):
        from tandem.cuda.routing import mix_experts

        return mix_experts(out, ids, weights, scale, bias)
    if scale is not None:
        out = out * scale[ids].unsqueeze(-1)
    if bias is not None:
        out = out + bias[ids]
    return (out * weights.unsqueeze(-1).to(out.dtype)).sum(dim=1)


@functools.cache
def _gelu_table_on(device: torch.device) -> torch.Tensor:
    return ggml_gelu_table().to(device)


@dataclass(frozen=True)
class GGMLValuedGLU:
    """`inner` giving the values of its ggml op on any device, for experts computed on a GPU in place of ggml's
    beside ggml's own (--pcie-experts, weights/offload.py). ggml's GEGLU reads its f16 GELU table, which
    `gelu_tanh_ggml` reads on the CPU only (on a GPU it is the formula, ~1e-3 away: enough to send a token of a
    tiny Gemma 4 to other experts); ggml's other gated units are the formulas torch computes."""

    inner: GLU
    device: torch.device  # where the experts compute (the table is made there at load, before any capture)
    _table: torch.Tensor | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_table", _gelu_table_on(self.device) if self.inner.ggml == "geglu" else None)

    @property
    def ggml(self) -> str | None:
        return self.inner.ggml

    @property
    def ggml_params(self) -> tuple[float, ...]:
        return self.inner.ggml_params

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self._table is None:
            return self.inner(gate, up)
        return gelu_from_table(gate, self._table) * up  # as ggml_vec_geglu_f32


def _ggml_weight(experts: Experts | None) -> GGMLWeight | None:
    if experts is None:
        return None
    assert isinstance(experts, GGMLExperts)
    return experts.weight
