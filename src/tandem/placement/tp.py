"""Tensor parallelism in the plan (`--tp N`): each rank's slice of every tensor, and each rank's own placement plan.

A tensor's split follows from its role, read from its GGUF name and the config (`tensor_cut`): query heads, KV
heads, delta-net heads, FFN indices or experts; norms, routers, embeddings and the output head stay whole. A rank's
view of the file replaces each tensor by its slice, and the rank's plan is the ordinary `plan_placement` of that
view with a local config (H/N heads, ...) and the rank's device: every placement rule holds per rank unchanged, and
a tensor the request puts in host RAM stays there on every rank. docs/TENSOR_PARALLEL.md explains the design.

Nothing here reads a weight: the plan's view holds each slice's type, shape and size (`RankPlan.file`);
`RankPlan.load_view()` makes the slices themselves when the rank loads (views of the memory map where the slice is
contiguous in the file, copies of just its bytes where it is not).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from tandem.errors import PlacementError
from tandem.gguf import GGUFFile, TensorInfo
from tandem.placement.plan import PlacementPlan, RuntimeShape, expert_layer, plan_placement
from tandem.placement.request import PlacementRequest
from tandem.quant.types import block_geometry

if TYPE_CHECKING:  # tandem.models imports the weight loader, which imports this package
    from tandem.models.config import LayerSpec, ModelConfig

Ranges = tuple[tuple[int, int], ...]  # index ranges [start, end) along an axis, kept in this order


@dataclass(frozen=True)
class Cut:
    """How a rank holds one tensor: whole, a split along `axis` (0: rows, or experts of a stack; -1: columns)
    keeping `ranges` in order, or zeros of its shape (a bias added after a partial sum: rank 0 holds it whole, the
    others zeros, so that the sum adds it once). `what` says what the split's unit is, for people."""

    how: str  # "whole", "split", "zeros"
    axis: int = 0
    ranges: Ranges = ()
    what: str = ""

    def describe(self) -> str:
        if self.how != "split":
            return f"{self.how} ({self.what})" if self.what else self.how
        side = "columns" if self.axis == -1 else "rows"
        spans = "+".join(f"{a}..{b - 1}" for a, b in self.ranges)
        if self.what.startswith("experts"):  # a range of whole experts says it all
            return self.what
        return f"{self.what} ({side} {spans})" if self.what else f"{side} {spans}"


WHOLE = Cut("whole")
ADDED_BY_RANK0 = Cut("whole", what="added by rank 0 alone")
ZEROS = Cut("zeros", what="rank 0 adds it")


def split_range(n: int, size: int, rank: int) -> tuple[int, int]:
    """Rank `rank`'s share [lo, hi) of n units split as evenly as possible over `size` ranks."""
    return rank * n // size, (rank + 1) * n // size


@dataclass(frozen=True)
class LayerSplit:
    """What rank `rank` of `size` keeps of one layer: query heads, KV heads, delta-net key and value heads, experts.
    Checked where it is made: a model that N does not divide is a one-line error naming --tp."""

    cfg: ModelConfig
    index: int
    rank: int
    size: int

    @property
    def spec(self) -> LayerSpec:
        return self.cfg.layers[self.index]

    @cached_property
    def heads(self) -> tuple[int, int]:
        h, n = self.cfg.n_heads, self.size
        if h % n:
            raise PlacementError(f"--tp {n}: {self.cfg.arch} has {h} query heads, not a multiple of {n} ranks")
        return split_range(h, n, self.rank)

    @property
    def n_kv(self) -> int:
        return self.spec.n_kv_heads or self.cfg.n_kv_heads

    @cached_property
    def kv_heads(self) -> tuple[int, int]:
        """G/N KV heads, or with more ranks than KV heads (N a multiple of G) the one KV head its query heads read."""
        g, n = self.n_kv, self.size
        if g % n == 0:
            return split_range(g, n, self.rank)
        if n % g == 0:
            first = self.heads[0] // (self.cfg.n_heads // g)
            return first, first + 1
        raise PlacementError(
            f"--tp {n}: layer {self.index} of {self.cfg.arch} has {g} KV heads, neither a multiple nor a divisor of "
            f"{n} ranks"
        )

    @cached_property
    def key_heads(self) -> tuple[int, int]:
        net = _delta_net(self.cfg)
        if net.n_k_heads % self.size:
            raise PlacementError(
                f"--tp {self.size}: the delta-net layers of {self.cfg.arch} have {net.n_k_heads} key heads, not a "
                f"multiple of {self.size} ranks"
            )
        return split_range(net.n_k_heads, self.size, self.rank)

    @cached_property
    def value_heads(self) -> list[int]:
        """The value heads that read the rank's key heads, in the order that keeps the rank's layout the model's:
        grouped (value head j reads key head j // r) or tiled (j % Hk)."""
        net = _delta_net(self.cfg)
        lo, hi = self.key_heads
        r = net.n_v_heads // net.n_k_heads
        if net.head_layout == "tiled":
            return [m * net.n_k_heads + k for m in range(r) for k in range(lo, hi)]
        return list(range(lo * r, hi * r))

    def experts(self, n_experts: int) -> tuple[int, int]:
        if n_experts < self.size:
            raise PlacementError(
                f"--tp {self.size}: layer {self.index} has {n_experts} experts, fewer than the {self.size} ranks"
            )
        return split_range(n_experts, self.size, self.rank)


def _delta_net(cfg: ModelConfig):  # type: ignore[no-untyped-def]  # DeltaNetShape (layers/), read by field
    net = getattr(cfg, "delta_net", None)
    assert net is not None, "delta-net tensors in a model without a delta-net shape"
    return net


def _runs(indices: list[int], width: int, offset: int = 0) -> Ranges:
    """Index `indices` (heads) as ranges of `width` elements each, from `offset`, adjacent ones merged."""
    out: list[tuple[int, int]] = []
    for i in indices:
        a, b = offset + i * width, offset + (i + 1) * width
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


def _ffn_units(f: GGUFFile, down: str, n_ffn: int, split: LayerSplit) -> tuple[int, int]:
    """The rank's FFN indices [lo, hi): whole blocks of the down projection's type (its columns are cut there)."""
    block = block_geometry(f.tensors[down].qtype)[0] if down in f.tensors else 1
    units = n_ffn // block
    if units < split.size:
        raise PlacementError(
            f"--tp {split.size}: {down} has {units} blocks of {block} along its FFN, fewer than the {split.size} ranks"
        )
    lo, hi = split_range(units, split.size, split.rank)
    return lo * block, hi * block


_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")
_WHOLE_SUFFIXES = frozenset({
    "attn_norm.weight", "ffn_norm.weight", "post_attention_norm.weight", "post_ffw_norm.weight",
    "post_ffw_norm_1.weight", "post_ffw_norm_2.weight", "pre_ffw_norm_2.weight", "attn_q_norm.weight",
    "attn_k_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp.bias", "ffn_gate_inp.scale",
    "ffn_gate_inp_shexp.weight", "layer_output_scale.weight", "ssm_norm.weight",
})  # fmt: skip
_EXPERT_STACK_RE = re.compile(r"ffn_(?:gate|up|down|gate_up)_exps\.(?:weight|bias|scale)")


def tensor_cut(f: GGUFFile, cfg: ModelConfig, name: str, rank: int, size: int) -> Cut:
    """How rank `rank` of `size` holds tensor `name`: see docs/TENSOR_PARALLEL.md's table. A tensor of a layer that
    no rule covers is an error, not a guess (a whole copy of a tensor whose output is summed would count it N
    times)."""
    m = _LAYER_RE.fullmatch(name)
    if m is None or int(m.group(1)) >= cfg.n_layers:  # model-wide tensors; blocks past the last layer are not run
        return WHOLE
    layer, suffix = int(m.group(1)), m.group(2)
    info = f.tensors[name]
    split = LayerSplit(cfg, layer, rank, size)
    if suffix in _WHOLE_SUFFIXES:
        return WHOLE
    if _EXPERT_STACK_RE.fullmatch(suffix):
        lo, hi = split.experts(info.shape[0])
        return Cut("split", 0, ((lo, hi),), f"experts {lo}..{hi - 1}")
    cut = _attention_cut(cfg, info, suffix, split) or _ffn_cut(f, cfg, layer, suffix, split)
    cut = cut or (_delta_net_cut(cfg, info, suffix, split) if getattr(cfg, "delta_net", None) else None)
    if cut is None:
        raise PlacementError(f"--tp {size}: no tensor-parallel split for {name} ({cfg.arch}); use --tp 1")
    return cut


def _attention_cut(cfg: ModelConfig, info: TensorInfo, suffix: str, split: LayerSplit) -> Cut | None:
    if suffix == "attn_output.bias":
        return ADDED_BY_RANK0 if split.rank == 0 else ZEROS
    if suffix in ("attn_q.weight", "attn_q.bias", "attn_sinks.weight", "attn_output.weight"):
        lo, hi = split.heads
        axis = -1 if suffix == "attn_output.weight" else 0
        per = info.shape[axis] // cfg.n_heads  # a head's rows: D, or 2D with the output gate (Qwen3.5/3.6)
        return Cut("split", axis, ((lo * per, hi * per),), f"heads {lo}..{hi - 1}")
    if suffix in ("attn_k.weight", "attn_k.bias", "attn_v.weight", "attn_v.bias"):
        lo, hi = split.kv_heads
        per = info.shape[0] // split.n_kv
        return Cut("split", 0, ((lo * per, hi * per),), f"KV heads {lo}..{hi - 1}")
    return None


def _ffn_cut(f: GGUFFile, cfg: ModelConfig, layer: int, suffix: str, split: LayerSplit) -> Cut | None:
    for part in ("", "_shexp"):
        names = {f"ffn_gate{part}.weight": 0, f"ffn_up{part}.weight": 0, f"ffn_down{part}.weight": -1}
        if suffix in names:
            down = f"blk.{layer}.ffn_down{part}.weight"
            n_ffn = f.tensors[f"blk.{layer}.{suffix}"].shape[0 if names[suffix] == 0 else -1]
            lo, hi = _ffn_units(f, down, n_ffn, split)
            return Cut("split", names[suffix], ((lo, hi),), f"FFN {lo}..{hi - 1}")
    return None


def _delta_net_cut(cfg: ModelConfig, info: TensorInfo, suffix: str, split: LayerSplit) -> Cut | None:
    net = _delta_net(cfg)
    values = split.value_heads
    lo, hi = split.key_heads
    heads = f"key heads {lo}..{hi - 1}"
    if suffix in ("attn_qkv.weight", "ssm_conv1d.weight"):  # q, k (key heads), v (value heads) channels
        dk, keys = net.head_k_dim, net.n_k_heads * net.head_k_dim
        ranges = ((lo * dk, hi * dk), (keys + lo * dk, keys + hi * dk), *_runs(values, net.head_v_dim, 2 * keys))
        return Cut("split", 0, ranges, heads)
    if suffix == "attn_gate.weight":
        return Cut("split", 0, _runs(values, net.head_v_dim), heads)
    if suffix in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_dt.bias", "ssm_a"):
        return Cut("split", 0, _runs(values, 1), heads)
    if suffix == "ssm_ba.weight":  # per key head: its value heads' betas, then their alphas
        per = info.shape[0] // net.n_k_heads
        return Cut("split", 0, ((lo * per, hi * per),), heads)
    if suffix == "ssm_out.weight":
        return Cut("split", -1, _runs(values, net.head_v_dim), heads)
    return None


def local_config(cfg: ModelConfig, split_of: LayerSplit) -> ModelConfig:
    """The config of one rank's layers: its query heads, KV heads and delta-net heads (the rest is the model's)."""
    size = split_of.size
    specs = []
    kv_counts = []
    for i, spec in enumerate(cfg.layers):
        s = LayerSplit(cfg, i, split_of.rank, size)
        lo, hi = s.kv_heads
        kv_counts.append(hi - lo)
        specs.append(dataclasses.replace(spec, n_kv_heads=hi - lo) if spec.n_kv_heads else spec)
    lo, hi = split_of.heads
    kv = max(kv_counts) if any(spec.n_kv_heads for spec in cfg.layers) else kv_counts[0]
    changes: dict[str, object] = {"n_heads": hi - lo, "n_kv_heads": kv, "layers": tuple(specs)}
    net = getattr(cfg, "delta_net", None)
    if net is not None:
        k_lo, k_hi = split_of.key_heads
        r = net.n_v_heads // net.n_k_heads
        changes["delta_net"] = dataclasses.replace(net, n_k_heads=k_hi - k_lo, n_v_heads=(k_hi - k_lo) * r)
    return dataclasses.replace(cfg, **changes)  # type: ignore[arg-type]


# -- a rank's view of the file ------------------------------------------------------------------------------------


def _axis_bytes(info: TensorInfo, axis: int) -> tuple[int, int, int]:
    """(outer count, bytes per index along `axis`, the ggml block along it) of a tensor whose bytes lie in
    PyTorch order: along axis 0 an index is a contiguous run; along the last axis it is a part of every row."""
    block, type_size = block_geometry(info.qtype)
    if axis == 0 and len(info.shape) > 1:
        return 1, info.n_bytes // info.shape[0], 1
    rows = math.prod(info.shape[:-1])
    return rows, type_size, block  # along the last axis: type_size bytes per `block` elements


def _sliced_shape(info: TensorInfo, cut: Cut) -> tuple[int, ...]:
    kept = sum(b - a for a, b in cut.ranges)
    shape = list(info.shape)
    shape[cut.axis] = kept
    return tuple(shape)


def _check_alignment(info: TensorInfo, cut: Cut, size: int) -> None:
    """Along the last axis (columns, or a vector) a quantized tensor can only be cut at its blocks' edges."""
    if cut.axis != -1 and len(info.shape) > 1:
        return
    block = block_geometry(info.qtype)[0]
    for a, b in cut.ranges:
        for edge in (a, b):
            if edge % block:
                raise PlacementError(
                    f"--tp {size}: {info.name} ({info.qtype.name}, blocks of {block}) cannot be cut at column {edge} "
                    f"({cut.describe()}); use a --tp that splits it at block edges, or --tp 1"
                )


def _slice_bytes(info: TensorInfo, cut: Cut) -> int:
    rows, per, block = _axis_bytes(info, cut.axis)
    kept = sum(b - a for a, b in cut.ranges)
    return rows * (kept // block) * per


def _placeholder(info: TensorInfo, shape: tuple[int, ...], n_bytes: int) -> TensorInfo:
    """The slice as the plan sees it: type, shape and size, with data that is never read (a broadcast zero byte,
    no memory) — what plan_placement and inspect need, before anything is copied."""
    data = np.broadcast_to(np.zeros((), dtype=np.uint8), (n_bytes,))
    return TensorInfo(name=info.name, qtype=info.qtype, shape=shape, data=data, offset=info.offset)


def slice_tensor(info: TensorInfo, cut: Cut) -> TensorInfo:
    """The rank's slice of `info` with its bytes: a view of the memory map where the slice is contiguous (rows,
    experts), else a copy of just its bytes in host RAM (columns, gathered heads, a zero bias)."""
    if cut.how == "whole":
        return info
    if cut.how == "zeros":  # of the same type and shape (zero blocks are zeros)
        return dataclasses.replace(info, data=np.zeros(info.n_bytes, dtype=np.uint8))
    rows, per, block = _axis_bytes(info, cut.axis)
    shape = _sliced_shape(info, cut)
    if rows == 1:  # contiguous runs of the file's bytes
        runs = [info.data[a // block * per : b // block * per] for a, b in cut.ranges]
        if len(runs) == 1:
            start = cut.ranges[0][0] // block * per
            return TensorInfo(name=info.name, qtype=info.qtype, shape=shape, data=runs[0], offset=info.offset + start)
        return dataclasses.replace(info, shape=shape, data=np.concatenate(runs))
    table = info.data.reshape(rows, -1)
    parts = [table[:, a // block * per : b // block * per] for a, b in cut.ranges]
    data = np.ascontiguousarray(np.concatenate(parts, axis=1)).reshape(-1)
    return dataclasses.replace(info, shape=shape, data=data)


# -- the plans ------------------------------------------------------------------------------------------------------


def rank_device(device: str, rank: int) -> str:
    """Rank r computes on cuda:(k + r) for --device cuda:k, or on the CPU."""
    if device == "cpu":
        return "cpu"
    return f"cuda:{int(device.split(':')[1]) + rank}"


@dataclass(frozen=True)
class RankPlan:
    """One rank's part: its view of the file (each tensor its slice: type, shape, size), its local config, its
    placement plan on its device, and how it cut each tensor."""

    rank: int
    source: GGUFFile  # the whole file
    file: GGUFFile  # the plan's view: the slices' sizes, not their data (see load_view)
    config: ModelConfig
    plan: PlacementPlan
    cuts: dict[str, Cut]
    expert_ranges: dict[int, tuple[int, int]] = field(default_factory=dict)  # MoE layer -> the rank's experts

    @property
    def device(self) -> str:
        return self.plan.compute_device

    def load_view(self) -> GGUFFile:
        """The rank's view with the slices' bytes, for its loader: views of the memory map, copies where a slice is
        not contiguous in the file. Only what the rank holds is read."""
        tensors = {name: slice_tensor(info, self.cuts[name]) for name, info in self.source.tensors.items()}
        return dataclasses.replace(self.source, tensors=tensors)

    def to_dict(self) -> dict[str, object]:
        plan = self.plan.to_dict()
        tensors = plan.pop("tensors")
        assert isinstance(tensors, dict)
        plan["tensors"] = {
            name: {"device": device, "split": self.cuts[name].describe(), "shape": list(self.file.tensors[name].shape),
                   "bytes": self.file.tensors[name].n_bytes}
            for name, device in tensors.items()
        }  # fmt: skip
        return {"rank": self.rank, "device": self.device, **plan}


@dataclass(frozen=True)
class TensorParallelPlan:
    """The plan of `--tp N`: one RankPlan per rank, all from the one request."""

    request: PlacementRequest
    ranks: tuple[RankPlan, ...]

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def backend(self) -> str:
        """The data group's backend: NCCL between GPUs, gloo between CPU ranks."""
        return "gloo" if self.request.device == "cpu" else "nccl"

    def to_dict(self) -> dict[str, object]:
        return {"tp": self.size, "backend": self.backend, "ranks": [r.to_dict() for r in self.ranks]}


def check_tp_flags(req: PlacementRequest, pcie_experts: int = 0) -> None:
    """The options --tp N does not take (yet), refused before anything loads (inspect too)."""
    if pcie_experts and req.tp > 1:
        raise PlacementError(f"--pcie-experts {pcie_experts}: not built under --tp {req.tp}; drop one of the two")


def _check_tp_overrides(req: PlacementRequest) -> None:
    for pattern, device in req.override_tensor:
        if device not in ("cpu", req.device):
            raise PlacementError(
                f"-ot/--override-tensor {pattern}={device}: under --tp {req.tp} each rank's GPU holds its own slice "
                f"of every GPU tensor; -ot may move tensors to the CPU (or name --device {req.device}), not to "
                "another GPU"
            )


def _rank_request(req: PlacementRequest, rank: int) -> PlacementRequest:
    device = rank_device(req.device, rank)
    overrides = tuple((p, device if d == req.device else d) for p, d in req.override_tensor)
    return dataclasses.replace(req, device=device, override_tensor=overrides)


def plan_rank(f: GGUFFile, cfg: ModelConfig, req: PlacementRequest, rank: int, shape: RuntimeShape) -> RankPlan:
    """Rank `rank`'s plan of `--tp req.tp` (PlacementError, one line naming the flag, if the split cannot be)."""
    size = req.tp
    cuts = {name: tensor_cut(f, cfg, name, rank, size) for name in f.tensors}
    sized = {}
    for name, info in f.tensors.items():
        cut = cuts[name]
        if cut.how != "split":
            sized[name] = info
            continue
        _check_alignment(info, cut, size)
        sized[name] = _placeholder(info, _sliced_shape(info, cut), _slice_bytes(info, cut))
    view = dataclasses.replace(f, tensors=sized)
    local = local_config(cfg, LayerSplit(cfg, 0, rank, size))
    plan = plan_placement(view, local, _rank_request(req, rank), shape)
    experts = {}
    for name, cut in cuts.items():
        if (layer := expert_layer(name)) is not None:
            experts[layer] = cut.ranges[0]
    return RankPlan(rank=rank, source=f, file=view, config=local, plan=plan, cuts=cuts, expert_ranges=experts)


def plan_tensor_parallel(
    f: GGUFFile, cfg: ModelConfig, req: PlacementRequest, shape: RuntimeShape | None = None
) -> TensorParallelPlan:
    """Every rank's plan of `--tp req.tp`, computed before any weight is read. Raises a one-line PlacementError for a
    split the model does not allow or a flag the ranks cannot honour."""
    if req.tp < 2:
        raise PlacementError(f"--tp {req.tp}: a tensor-parallel plan needs at least 2 ranks")
    _check_tp_overrides(req)
    shape = shape or RuntimeShape()
    ranks = tuple(plan_rank(f, cfg, req, rank, shape) for rank in range(req.tp))
    return TensorParallelPlan(request=req, ranks=ranks)
