"""The placement plan: computed once from the flags, before any weight moves, and obeyed by every
loader and execution path. `tandem inspect` prints it without touching a GPU or reading weights.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from tandem.errors import PlacementError, TandemError
from tandem.gguf import GGUFFile, TensorInfo
from tandem.placement.experts import ExpertCache, LayerExperts, layer_experts, select_experts
from tandem.placement.request import PlacementRequest
from tandem.quant.types import CUBLAS_WORKSPACE_BYTES, GPU_DEQUANT_CHUNK_BYTES, GPU_NATIVE_TYPES, STAGING_SLOT_BYTES

if TYPE_CHECKING:  # tandem.models imports the weight loader, which imports this package
    from tandem.models.config import ModelConfig

# The routed-expert tensors, as llama.cpp's --cpu-moe names them.
EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(?:up|down|gate_up|gate)_(?:ch|)exps")


def expert_layer(name: str) -> int | None:
    """The layer index of a routed-expert tensor, or None for any other tensor."""
    m = EXPERT_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class RuntimeShape:
    """What, besides weights, takes device memory: KV cache and activations."""

    n_ctx: int = 4096  # per sequence
    n_batch: int = 512
    cache_bytes_per_value: int = 2  # f16
    n_seq: int = 1  # sequences the state pool holds (-np/--parallel)

    def __post_init__(self) -> None:
        for name, value in (("n_ctx (-c/--ctx-size)", self.n_ctx), ("n_batch (-b/--batch-size)", self.n_batch),
                            ("n_seq (-np/--parallel)", self.n_seq)):  # fmt: skip
            if value <= 0:
                raise TandemError(f"{name} must be positive, got {value}")


# What the driver counts for a process on a GPU beyond the tensors the plan places: the CUDA context and its
# kernels' modules, library handles, and the blocks torch's caching allocator holds but no tensor uses (a process
# that tunes a Triton kernel also takes a 256 MiB buffer for it): the driver's peak above torch's peak allocation,
# with a margin (docs/PERFORMANCE.md). --gpu-memory is a budget for what the driver shows, so the plan counts it.
GPU_PROCESS_BYTES = 1280 << 20


@dataclass(frozen=True)
class PlacementPlan:
    """tensor name -> device ("cpu" or "cuda:N"), with the memory it implies per device."""

    devices: dict[str, str]
    request: PlacementRequest
    weight_bytes: dict[str, int]  # per device
    kv_bytes: int  # on the compute device (0 on a CPU-only plan's GPU side)
    workspace_bytes: int  # activations on the compute device
    staging_bytes: int  # bounded GPU window for streaming CPU experts during prefill (see StagingSize)
    cpu_expert_layers: tuple[int, ...]
    notes: tuple[str, ...] = field(default=())
    # Experts of CPU layers also kept in VRAM (--moe-cache, --gpu-memory): their tensors stay "cpu" above, and
    # only these experts' rows are uploaded (weights/loader.py).
    expert_cache: ExpertCache = field(default_factory=ExpertCache)
    process_bytes: int = 0  # the process's own VRAM on the compute device (GPU_PROCESS_BYTES; 0 on the CPU)

    def device_of(self, name: str) -> str:
        return self.devices[name]

    @property
    def compute_device(self) -> str:
        return self.request.device

    def gpu_bytes(self, device: str | None = None) -> int:
        """Expected VRAM on `device` (default: the compute device), as the driver counts it: weights + cached
        experts + KV + workspace + staging + the process's own (context, modules, allocator's spare blocks)."""
        device = device or self.compute_device
        if device == "cpu":
            return 0
        extra = 0
        if device == self.compute_device:
            extra = (self.kv_bytes + self.workspace_bytes + self.staging_bytes + self.expert_cache.bytes
                     + self.process_bytes)  # fmt: skip
        return self.weight_bytes.get(device, 0) + extra

    def to_dict(self) -> dict[str, object]:
        return {
            "request": {
                "device": self.request.device,
                "cpu_moe": self.request.cpu_moe,
                "n_cpu_moe": self.request.n_cpu_moe,
                "override_tensor": [f"{p}={d}" for p, d in self.request.override_tensor],
                "gpu_memory": self.request.gpu_memory,
                "moe_cache": self.request.moe_cache,
                "moe_cache_refresh": self.request.moe_cache_refresh,
                "tp": self.request.tp,
                "n_gpu_layers": self.request.n_gpu_layers,
            },
            "weight_bytes": self.weight_bytes,
            "kv_bytes": self.kv_bytes,
            "workspace_bytes": self.workspace_bytes,
            "staging_bytes": self.staging_bytes,
            "process_bytes": self.process_bytes,
            "expected_gpu_bytes": self.gpu_bytes() if self.compute_device != "cpu" else 0,
            "cpu_expert_layers": list(self.cpu_expert_layers),
            "expert_cache": self.expert_cache.to_dict(),
            "notes": list(self.notes),
            "tensors": self.devices,
        }


def kv_cache_bytes(cfg: ModelConfig, shape: RuntimeShape) -> int:
    """The GPU KV cache of every sequence of the state pool: per sequence and layer (Gemma 4's sliding and global
    layers differ in KV heads and head size), n_ctx rows, or a sliding-window layer's ring of window + n_batch - 1
    (layers/attention.py new_kv)."""
    total = 0
    for layer in cfg.layers:
        per_row = (layer.n_kv_heads or cfg.n_kv_heads) * (
            2 * layer.head_dim if layer.head_dim else cfg.head_dim + cfg.value_dim
        )
        window = layer.sliding_window
        rows = shape.n_ctx if window is None else min(shape.n_ctx, window + shape.n_batch - 1)
        total += rows * per_row
    return total * shape.cache_bytes_per_value * shape.n_seq


def workspace_bytes(cfg: ModelConfig, shape: RuntimeShape) -> int:
    """Transient GPU memory: activations of one prefill batch in float32 (residual stream and
    projections, the widest MLP, one layer's attention scores, one row of logits), the bounded slice of
    dequantized blocks a prefill product uses, and cuBLAS's workspace."""
    ffn = max(cfg.ffn_dim, cfg.moe.expert_ffn_dim * cfg.moe.n_active if cfg.moe else 0)
    qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * max(cfg.head_dim, cfg.value_dim)
    per_token = 4 * cfg.hidden + 3 * ffn + 2 * qkv
    scores = cfg.n_heads * shape.n_batch * shape.n_ctx
    activations = 4 * (shape.n_batch * per_token + scores + cfg.n_vocab)
    return activations + GPU_DEQUANT_CHUNK_BYTES + CUBLAS_WORKSPACE_BYTES


def _assign(f: GGUFFile, req: PlacementRequest, cfg: ModelConfig) -> tuple[dict[str, str], list[str]]:
    """Flags -> devices, before any budget: -ot first (first match wins), then --cpu-moe/--n-cpu-moe."""
    ngl = req.n_gpu_layers
    if ngl is not None and 0 < ngl < cfg.n_layers:
        raise PlacementError(
            f"-ngl {ngl}: tandem keeps all {cfg.n_layers} layers on one device. Use -ngl {cfg.n_layers} or more (the "
            "GPU) and move experts to the CPU to save VRAM (--cpu-moe, --n-cpu-moe N, --gpu-memory; matrices with "
            "-ot REGEX=cpu), or -ngl 0 (the CPU)"
        )
    if req.n_cpu_moe > cfg.n_layers:
        raise PlacementError(
            f"--n-cpu-moe {req.n_cpu_moe}: the model has only {cfg.n_layers} layers (use at most {cfg.n_layers}, "
            f"or --cpu-moe for all)"
        )
    has_experts = any(expert_layer(n) is not None for n in f.tensors)
    if (req.cpu_moe or req.n_cpu_moe) and not has_experts:
        flag = "--cpu-moe" if req.cpu_moe else "--n-cpu-moe"
        raise PlacementError(f"{flag}: {f.arch} has no routed-expert tensors (blk.N.ffn_*_exps); drop the flag")
    patterns = [(re.compile(p), p, d) for p, d in req.override_tensor]
    used: set[str] = set()
    devices: dict[str, str] = {}
    for name in f.tensors:
        device = None
        for regex, text, target in patterns:
            if regex.search(name):
                device = target
                used.add(text)
                break
        if device is None and name == "token_embd.weight" and "output.weight" in f.tensors:
            device = "cpu"  # as llama.cpp: an untied table is only read a row at a time, on the host
        if device is None:
            layer = expert_layer(name)
            if layer is not None and (req.cpu_moe or layer < req.n_cpu_moe):
                device = "cpu"
        devices[name] = device or req.device
    unused = [p for _, p, _ in patterns if p not in used]
    if unused:
        raise PlacementError(
            f"-ot/--override-tensor: '{unused[0]}' matches no tensor of {f.path.name} "
            f"(see the names with `tandem inspect -m MODEL --tensors`)"
        )
    return devices, [p for _, p, _ in patterns]


def _check_whole_expert_layers(devices: dict[str, str]) -> None:
    """A layer's routed experts are computed in one place (one ggml graph on the host, or one grouped kernel on a
    GPU), so -ot may move a layer's experts but not split them, as llama.cpp would allow."""
    by_layer: dict[int, dict[str, str]] = {}
    for name, device in devices.items():
        if (layer := expert_layer(name)) is not None:
            by_layer.setdefault(layer, {}).setdefault(device, name)
    for layer, where in sorted(by_layer.items()):
        if len(where) > 1:
            split = ", ".join(f"{name} on {device}" for device, name in sorted(where.items()))
            raise PlacementError(
                f"-ot/--override-tensor: the routed experts of layer {layer} would be split ({split}); tandem "
                f"computes a layer's experts in one place: move them together (e.g. 'blk\\.{layer}\\.ffn_.*_exps=cpu')"
            )


def plan_placement(
    f: GGUFFile,
    cfg: ModelConfig,
    req: PlacementRequest,
    shape: RuntimeShape | None = None,
    expert_counts: np.ndarray | None = None,
    counts_label: str = "",
) -> PlacementPlan:
    """Compute and validate the plan. Raises PlacementError (one line, naming the flag) if impossible.

    `expert_counts` [n_layers, n_experts], or its two halves [2, n_layers, n_experts] (routing statistics,
    `ExpertStats.halves`; `counts_label` naming them) decide which experts
    --moe-cache and --gpu-memory keep in VRAM; without them the choice is as for uniform routing."""
    shape = shape or RuntimeShape()
    devices, _ = _assign(f, req, cfg)
    on_gpu = req.device != "cpu"
    kv = kv_cache_bytes(cfg, shape) if on_gpu else 0
    work = workspace_bytes(cfg, shape) if on_gpu else 0
    process = GPU_PROCESS_BYTES if on_gpu else 0
    notes: list[str] = []
    _check_whole_expert_layers(devices)
    cache = ExpertCache()
    if req.moe_cache is not None:
        devices, cache, note = _fill_moe_cache(f, cfg, req, devices, expert_counts, counts_label)
        notes.append(note)
    if req.gpu_memory is not None:
        devices, more, note = _fit_budget(f, cfg, req, devices, kv + work + process + cache.bytes, expert_counts,
                                          counts_label)  # fmt: skip
        cache = cache.merged(more)
        notes.append(note)
    weight_bytes: dict[str, int] = {}
    for name, device in devices.items():
        weight_bytes[device] = weight_bytes.get(device, 0) + f.tensors[name].n_bytes
    cpu_layers = sorted({layer for n, d in devices.items() if d == "cpu" and (layer := expert_layer(n)) is not None})
    staging = _staging_bytes(f, devices) if on_gpu else 0
    return PlacementPlan(
        devices=devices,
        request=req,
        weight_bytes=weight_bytes,
        kv_bytes=kv,
        workspace_bytes=work,
        staging_bytes=staging,
        cpu_expert_layers=tuple(cpu_layers),
        notes=tuple(notes),
        expert_cache=cache,
        process_bytes=process,
    )


STAGING_ALIGN = 256  # bytes: every staged view is aligned for any element type


def check_one_gpu(plan: PlacementPlan) -> None:
    """Raise a one-line PlacementError where tensors are planned on a GPU other than --device's (one GPU per rank);
    no GPU is needed to tell, so `inspect` refuses what `run` would."""
    req = plan.request  # under --tp: one rank's plan (its device; runtime/tp.py checks the others)
    gpus = sorted({d for d in plan.devices.values() if d != "cpu"} | ({req.device} - {"cpu"}))
    if gpus and req.device == "cpu":
        raise PlacementError(
            f"-ot/--override-tensor {gpus[0]}: with --device cpu every tensor must stay on the CPU; "
            f"use --device cuda to compute on the GPU"
        )
    if len(gpus) > 1:
        raise PlacementError(
            f"-ot/--override-tensor {', '.join(g for g in gpus if g != req.device)}: tandem computes on one GPU per "
            f"rank (--device {req.device}): put tensors there or on the CPU (--tp N splits the model over N GPUs)"
        )


def staging_aligned(n_bytes: int) -> int:
    """n_bytes rounded up to STAGING_ALIGN: where the next staged tensor may start."""
    return -(-n_bytes // STAGING_ALIGN) * STAGING_ALIGN


@dataclass(frozen=True)
class StagingSize:
    """The prefill window for CPU-resident experts: two slots that chunks of whole experts stream through,
    and room for one layer's expert vectors (biases, scales)."""

    slot_bytes: int
    vector_bytes: int

    @property
    def total(self) -> int:
        return 2 * self.slot_bytes + self.vector_bytes


def streamable(infos: Sequence[TensorInfo]) -> bool:
    """Whether a layer's expert tensors can be computed on the GPU from streamed blocks: matrices of a type
    the GPU kernels read, vectors in F32."""
    return all(
        i.qtype in GPU_NATIVE_TYPES if len(i.shape) == 3 else i.qtype.name == "F32" and len(i.shape) <= 2 for i in infos
    )


def staging_size(cpu_experts_by_layer: dict[int, list[TensorInfo]]) -> StagingSize:
    """The window that streams these layers' CPU-resident experts (layers that cannot stream count nothing)."""
    slot = vectors = 0
    for infos in cpu_experts_by_layer.values():
        if not streamable(infos):
            continue
        for info in infos:
            if len(info.shape) == 3:
                expert_bytes = info.n_bytes // info.shape[0]
                per_slot = max(1, STAGING_SLOT_BYTES // expert_bytes)
                slot = max(slot, staging_aligned(min(info.shape[0], per_slot) * expert_bytes))
        vectors = max(vectors, sum(staging_aligned(i.n_bytes) for i in infos if len(i.shape) < 3))
    return StagingSize(slot_bytes=slot, vector_bytes=vectors)


def cpu_experts_by_layer(f: GGUFFile, devices: dict[str, str]) -> dict[int, list[TensorInfo]]:
    """The expert tensors the plan keeps on the CPU, by layer."""
    layers: dict[int, list[TensorInfo]] = {}
    for name, device in devices.items():
        layer = expert_layer(name)
        if layer is not None and device == "cpu":
            layers.setdefault(layer, []).append(f.tensors[name])
    return layers


def _staging_bytes(f: GGUFFile, devices: dict[str, str]) -> int:
    return staging_size(cpu_experts_by_layer(f, devices)).total


def _candidates(f: GGUFFile, layers: Sequence[int]) -> list[LayerExperts]:
    """The selection's view of these layers' routed experts."""
    by_layer: dict[int, list[TensorInfo]] = {}
    for name, info in f.tensors.items():
        if (layer := expert_layer(name)) is not None and layer in layers:
            by_layer.setdefault(layer, []).append(info)
    return [layer_experts(layer, infos, streamable(infos)) for layer, infos in sorted(by_layer.items())]


def _source(sel_partial: dict[int, tuple[int, ...]], counts: np.ndarray | None, label: str) -> str:
    if not sel_partial:
        return ""
    if counts is not None and counts.sum() > 0:
        return f"the most picked by {label or 'the routing statistics'}"
    return "no routing statistics: the lowest expert ids (give --expert-stats FILE to place by use)"


def _apply(devices: dict[str, str], full: frozenset[int], gpu: str) -> dict[str, str]:
    return {n: (gpu if (layer := expert_layer(n)) is not None and layer in full else d) for n, d in devices.items()}


def _cache_note(flag: str, full: frozenset[int], cache: ExpertCache, n_layers: int, policy: str) -> str:
    parts = []
    if full:
        parts.append(f"the experts of {len(full)} layer(s) in VRAM whole")
    if cache.layers:
        n = sum(len(ids) for ids in cache.layers.values())
        parts.append(
            f"{n} single experts of {len(cache.layers)} layer(s) cached in VRAM ({cache.bytes / 2**30:.2f} GiB; "
            f"{cache.source})"
        )
    if not parts:
        parts.append("no expert fits")
    rest = f"the rest of the {n_layers} layers' experts in host RAM"
    return f"{flag}: " + ", ".join(parts) + f" (filled {policy}); {rest}"


def _fill_moe_cache(
    f: GGUFFile, cfg: ModelConfig, req: PlacementRequest, devices: dict[str, str], counts: np.ndarray | None,
    label: str,
) -> tuple[dict[str, str], ExpertCache, str]:  # fmt: skip
    """--moe-cache SIZE: VRAM for the experts of the layers the flags keep in host RAM, filled per expert."""
    size = req.moe_cache
    assert size is not None and cfg.moe is not None or not devices
    cpu_layers = sorted({layer for n, d in devices.items() if d == "cpu" and (layer := expert_layer(n)) is not None})
    flag = f"--moe-cache {size / 2**30:.2f} GiB"
    if not cpu_layers:
        raise PlacementError(
            f"{flag}: no routed experts are in host RAM to cache; add --cpu-moe, --n-cpu-moe N or -ot, "
            "or give --gpu-memory alone"
        )
    assert cfg.moe is not None and size is not None
    cands = _candidates(f, cpu_layers)
    spare = 1 if req.moe_cache_refresh else 0
    sel = select_experts(cands, size, counts, cfg.moe.n_active, spare)
    cache = ExpertCache(sel.partial, {c.layer: c.expert_bytes for c in cands if c.layer in sel.partial},
                        _source(sel.partial, counts, label), spare)  # fmt: skip
    return _apply(devices, sel.full, req.device), cache, _cache_note(flag, sel.full, cache, len(cands), sel.policy)


def _fit_budget(
    f: GGUFFile, cfg: ModelConfig, req: PlacementRequest, devices: dict[str, str], runtime_bytes: int,
    counts: np.ndarray | None = None, label: str = "",
) -> tuple[dict[str, str], ExpertCache, str]:  # fmt: skip
    """--gpu-memory: if everything planned on the GPU fits, keep it; else the experts of the layers the flags put
    on the GPU go to host RAM, and the VRAM left after every other weight, the KV cache, the workspace, the
    staging window and the process's own (`runtime_bytes` counts it) is filled with whole layers' experts or
    single experts (placement/experts.py)."""
    budget = req.gpu_memory
    assert budget is not None
    gpu = req.device
    flag = f"--gpu-memory {budget / 2**30:.2f} GiB"

    def gpu_total(candidate: dict[str, str]) -> int:
        weights = sum(f.tensors[n].n_bytes for n, d in candidate.items() if d == gpu)
        return weights + runtime_bytes + _staging_bytes(f, candidate)

    if gpu_total(devices) <= budget:
        return devices, ExpertCache(), f"{flag}: every expert planned on the GPU fits"
    movable = sorted({layer for n, d in devices.items() if d == gpu and (layer := expert_layer(n)) is not None})
    base = {n: ("cpu" if d == gpu and expert_layer(n) is not None else d) for n, d in devices.items()}
    need = gpu_total(base)
    if need > budget or not movable:
        raise PlacementError(
            f"{flag} cannot hold even the non-expert weights, KV cache, workspace and the process's CUDA context "
            f"({need / 2**30:.2f} GiB); raise --gpu-memory, lower -c/--ctx-size, or use more GPUs"
        )
    assert cfg.moe is not None
    cands = _candidates(f, movable)
    spare = 1 if req.moe_cache_refresh else 0
    sel = select_experts(cands, budget - need, counts, cfg.moe.n_active, spare)
    out = _apply(base, sel.full, gpu)
    cache = ExpertCache(sel.partial, {c.layer: c.expert_bytes for c in cands if c.layer in sel.partial},
                        _source(sel.partial, counts, label), spare)  # fmt: skip
    assert gpu_total(out) + cache.bytes <= budget, (gpu_total(out), cache.bytes, budget)
    return out, cache, _cache_note(flag, sel.full, cache, len(cands), sel.policy)
