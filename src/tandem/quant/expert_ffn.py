"""A routed-expert FFN as ggml computes it: its stacks and vectors (`ExpertFFN`) and its graph nodes
(`expert_ffn_nodes`), shared by the fused host calls of `CPUKernels` and the CPU step graphs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import ggml
import torch

from tandem.quant import moe_kernel
from tandem.quant.ggml_weights import GGMLWeight, RepackedTensor

__all__ = ["GLU_OPS", "ExpertFFN", "as_f32", "check_gate_up", "expert_ffn_nodes"]


# ggml's gated units of two tensors (gate, up) -> hidden: the op and its number of float arguments.
GLU_OPS: dict[str, tuple[Callable[..., ggml.ggml_tensor_p], int]] = {
    "swiglu": (ggml.ggml_swiglu_split, 0),  # silu(gate) * up
    "geglu": (ggml.ggml_geglu_split, 0),  # gelu(gate) * up, ggml's f16 GELU table on the CPU
    "swiglu_oai": (ggml.ggml_swiglu_oai, 2),  # gpt-oss's clamped SwiGLU: alpha, limit
}


@dataclass(frozen=True, eq=False)  # eq=False: identity equality/hash (tensor fields do not compare)
class ExpertFFN:
    """Routed experts as one ggml graph computes them (`CPUKernels.gated_experts`): for each selected expert e,
    (down_e(glu(gate_e(x) + bg_e, up_e(x) + bu_e)) * s_e + bd_e) * w, summed over the A selected experts.

    Gate and up are two stacks (E, F, K), or one fused stack `gate_up` (E, 2F, K) with the gate rows first
    (llama.cpp's `ffn_gate_up_exps`); down is (E, D, F). `glu` names ggml's gated unit of two tensors
    ("swiglu", "geglu", "swiglu_oai") and `glu_params` its float arguments (swiglu_oai: alpha, limit). The
    optional vectors are gate/up biases [E, F], a down bias [E, D] and a per-expert output scale [E], kept
    here as contiguous float32 CPU tensors whose memory the graph reads.
    """

    down: GGMLWeight
    glu: str
    glu_params: tuple[float, ...] = ()
    gate: GGMLWeight | None = None
    up: GGMLWeight | None = None
    gate_up: GGMLWeight | None = None
    gate_bias: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None
    # What tells one graph from another, besides the token and slot counts (the cache key).
    structure: tuple[object, ...] = field(init=False, repr=False)
    # ggml type, shape (ggml order), address and repacked copy (or None) of each weight and vector, in the
    # graph's input order.
    inputs: dict[str, tuple[int, tuple[int, ...], int, RepackedTensor | None]] = field(init=False, repr=False)
    # Whether tandem's MoE kernel multiplies these stacks (tandem.quant.moe_kernel; the step's token count aside).
    kernel_takes: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        op = GLU_OPS.get(self.glu)
        if op is None or len(self.glu_params) != op[1]:
            raise ValueError(f"no ggml gated unit {self.glu!r} taking {len(self.glu_params)} parameters")
        check_gate_up("ExpertFFN", self.gate, self.up, self.gate_up)
        fused = self.gate_up is not None
        if len(self.down.shape) != 3:
            raise ValueError(f"down must be an (E, D, F) stack, got shape {self.down.shape}")
        e, d, f = self.down.shape
        k = self.stacks[0].shape[-1]
        shapes = {"gate_up": (e, 2 * f, k)} if fused else {"gate": (e, f, k), "up": (e, f, k)}
        shapes |= {"down": (e, d, f), "gate_bias": (e, f), "up_bias": (e, f), "down_bias": (e, d), "down_scale": (e,)}
        inputs = {}
        for name, shape in shapes.items():
            value = getattr(self, name)
            if value is None:
                continue
            if tuple(value.shape) != shape:
                raise ValueError(f"{name} must have shape {shape} for down {self.down.shape}, got {tuple(value.shape)}")
            ne = shape[::-1] if len(shape) > 1 else (1, e)
            if isinstance(value, GGMLWeight):
                inputs[name] = (int(value.qtype), ne, value.ptr, value.repacked)
            else:
                value = as_f32(value)
                object.__setattr__(self, name, value)
                inputs[name] = (ggml.GGML_TYPE_F32, ne, value.data_ptr(), None)
        object.__setattr__(self, "inputs", inputs)
        kinds = tuple((name, gtype, repacked is not None) for name, (gtype, _, _, repacked) in inputs.items())
        object.__setattr__(self, "structure", (self.glu, self.glu_params, kinds, e, f, k, d))
        vectors = any(getattr(self, name) is not None for name in ("gate_bias", "up_bias", "down_bias", "down_scale"))
        stacks = (*self.stacks, self.down)
        repacked = any(w.repacked is not None for w in stacks)
        takes = moe_kernel.takes(self.glu, tuple(w.qtype for w in stacks), k, f, vectors, repacked)
        object.__setattr__(self, "kernel_takes", takes)

    @property
    def stacks(self) -> tuple[GGMLWeight, ...]:
        """The input-side stacks: (gate_up,) or (gate, up)."""
        if self.gate_up is not None:
            return (self.gate_up,)
        assert self.gate is not None and self.up is not None
        return (self.gate, self.up)


def check_gate_up(owner: str, gate: object | None, up: object | None, gate_up: object | None) -> None:
    """Experts have gate and up stacks, or one fused gate_up stack: exactly one of the two forms."""
    fused_ok = gate_up is not None and gate is None and up is None
    split_ok = gate_up is None and gate is not None and up is not None
    if not (fused_ok or split_ok):
        raise ValueError(f"{owner} needs gate and up, or gate_up alone")


def expert_ffn_nodes(
    ctx: int,
    ffn: ExpertFFN,
    w: dict[str, ggml.ggml_tensor_p],
    x_t: ggml.ggml_tensor_p,
    ids_t: ggml.ggml_tensor_p,
    mix_t: ggml.ggml_tensor_p,
) -> ggml.ggml_tensor_p:
    """The nodes of a routed-expert FFN (the order of operations is llama.cpp's `build_moe_ffn`): w holds a tensor per
    entry of `ffn.inputs`, x_t is [K, 1, T], ids_t [A, T] (int32), mix_t [1, A, T] (the routing weights). Returns the
    mixed output [D, 1, T] (laid out as [T, D])."""
    f = ffn.down.shape[2]
    e = ffn.down.shape[0]
    a, t = int(ids_t.contents.ne[0]), int(ids_t.contents.ne[1])
    if "gate_up" in w:  # one product, then the gate and up halves of each row
        gate_up = ggml.ggml_mul_mat_id(ctx, w["gate_up"], x_t, ids_t)  # [2F, A, T]
        nb1, nb2 = gate_up.contents.nb[1], gate_up.contents.nb[2]
        gate = ggml.ggml_view_3d(ctx, gate_up, f, a, t, nb1, nb2, 0)
        up = ggml.ggml_view_3d(ctx, gate_up, f, a, t, nb1, nb2, f * gate_up.contents.nb[0])
    else:
        gate = ggml.ggml_mul_mat_id(ctx, w["gate"], x_t, ids_t)  # [F, A, T]
        up = ggml.ggml_mul_mat_id(ctx, w["up"], x_t, ids_t)
    if "gate_bias" in w:  # row ids[a, t] of the bias added to slot (a, t)
        gate = ggml.ggml_add_id(ctx, gate, w["gate_bias"], ids_t)
    if "up_bias" in w:
        up = ggml.ggml_add_id(ctx, up, w["up_bias"], ids_t)
    op, _ = GLU_OPS[ffn.glu]
    hidden = op(ctx, gate, up, *ffn.glu_params)  # [F, A, T]
    experts = ggml.ggml_mul_mat_id(ctx, w["down"], hidden, ids_t)  # [D, A, T]
    if "down_scale" in w:  # the selected experts' scales [1, A, T], as llama.cpp gathers them
        scales = ggml.ggml_repeat_4d(ctx, w["down_scale"], 1, e, t, 1)  # [1, E, T]
        experts = ggml.ggml_mul(ctx, experts, ggml.ggml_get_rows(ctx, scales, ids_t))
    if "down_bias" in w:
        experts = ggml.ggml_add_id(ctx, experts, w["down_bias"], ids_t)
    # The mix sum_a w[a, t] * experts[:, a, t] as one outer product per token ([D, A] by [1, A]): one node of A
    # contiguous multiply-adds of D values per token, where llama.cpp has a multiply and A - 1 adds (each node ends
    # in a barrier of all threads) and a product over the slots would need them first ([A, D, T]: a strided copy).
    # [D, 1, T], laid out as out [T, D]: no reshape, since a node pointed at the caller's buffer must be the one
    # that computes.
    return ggml.ggml_out_prod(ctx, experts, mix_t)


def as_f32(x: torch.Tensor) -> torch.Tensor:
    """x as a contiguous float32 CPU tensor (no copy when it already is one)."""
    # `is`/`is_cpu` rather than `==`/`device.type`: these run per call and the latter cost ~1 us.
    if x.dtype is not torch.float32 or not x.is_cpu or not x.is_contiguous():
        x = x.to(device="cpu", dtype=torch.float32).contiguous()
    return x
