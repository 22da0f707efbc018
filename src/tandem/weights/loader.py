"""Turn tensors of a GGUF file into layer weights, each where the placement plan puts it.

The loader is the only place that moves weights: a tensor the plan puts on the CPU stays in the
memory map (ggml computes on it there), a tensor on a GPU is uploaded once. What was placed where is
read back from the weights themselves (`placed`), not from the flags.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tandem.errors import PlacementError, TandemError, UnsupportedModelError
from tandem.gguf import GGUFFile, TensorInfo
from tandem.layers.linear import Experts, GGMLExperts, GGMLLinear, Linear
from tandem.layers.moe import CountedExperts, GGMLValuedGLU, GLUExperts, RoutedExperts, RoutingCounts
from tandem.placement import PlacementPlan, cpu_experts_by_layer, expert_layer, staging_size, streamable
from tandem.placement.plan import STAGING_ALIGN, staging_aligned
from tandem.quant.dequant import dequantize, dequantize_rows
from tandem.quant.ggml_cpu import CPUKernels
from tandem.quant.ggml_weights import AMX_ENV, GGMLWeight, amx_notice, lookup_supported, prepare_cpu_weight
from tandem.quant.types import GPU_FLOAT_TYPES, GPU_NATIVE_TYPES
from tandem.weights.expert_cache import CacheSlots
from tandem.weights.offload import (
    HOST_CALL_ROWS,
    ExpertSource,
    ExpertStaging,
    ExpertStream,
    HostCall,
    HostExperts,
    HostLinear,
    OffloadedExperts,
    StagedMatrix,
)
from tandem.weights.repack import ExpertRepacks

if TYPE_CHECKING:
    from tandem.cuda.host_memory import HostCopies

PAGE_PROBE = 4096  # bytes copied once to check that page-locked file memory can be copied from
# Batches of more tokens than a host op holds stream CPU experts to the GPU (llama.cpp: from 32). A decode step
# has at most HOST_CALL_ROWS rows (runtime/runner.py DECODE_BUCKETS), so it never streams: streaming reads the
# routed ids on the host, which a captured step cannot.
OFFLOAD_MIN_BATCH = HOST_CALL_ROWS + 1


def _as_torch_bytes(data: np.ndarray) -> torch.Tensor:
    """A uint8 torch view of mmap'd bytes (read-only in practice; torch warns about that)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data)


@dataclass
class QuantEmbedding:
    """Token embedding rows dequantized on lookup; the table stays quantized where it is placed."""

    data: torch.Tensor  # raw bytes, on the CPU (mmap) or a GPU
    info: TensorInfo
    out_device: torch.device
    out_dtype: torch.dtype
    # In host RAM: ggml looks the rows up (llama.cpp's get_rows, one C call, an order of magnitude faster than
    # dequantizing in torch, and on the decode step's critical path). Same values bit for bit.
    kernels: CPUKernels | None = None

    def __post_init__(self) -> None:
        self._lookup = None
        if self.kernels is not None:
            table = GGMLWeight(self.info.data, self.info.qtype, self.info.shape)
            self._lookup = functools.partial(self.kernels.get_rows, table)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self._lookup is not None:
            rows = self._lookup(ids).view(*ids.shape, -1)
        else:
            rows = dequantize_rows(self.data, self.info.qtype, self.info.shape, ids.to(self.data.device))
        return rows.to(self.out_device, self.out_dtype)


class WeightLoader:
    """Hands out layer weights by GGUF tensor name, obeying the plan; also an ExpertSource."""

    def __init__(
        self,
        f: GGUFFile,
        plan: PlacementPlan,
        kernels: CPUKernels,
        dtype: torch.dtype = torch.float32,
        on_tensor: Callable[[TensorInfo], None] | None = None,
        repack_experts: bool | None = None,
        pcie_experts: int = 0,
        routing_counts: RoutingCounts | None = None,
        in_place: bool = False,
    ) -> None:
        self.file = f
        # every weight left in the file's memory map, nothing copied or repacked: for checking a file's tensors
        # (`tandem inspect`), not for computing with them
        self.in_place = in_place
        self.plan = plan
        self.kernels = kernels
        self.compute_device = torch.device(plan.compute_device)
        # `dtype` is what large products take (their inputs rounded to it, dense weights stored in it); the hidden
        # state between them (residual stream, norms, routers, attention softmax, delta-net state) stays float32
        # on every device, as llama.cpp keeps it (docs/NUMERICS.md).
        self.dtype = dtype if self.compute_device.type != "cpu" else torch.float32
        self.act_dtype = torch.float32
        self.ieee = self.dtype == torch.float32
        self.on_tensor = on_tensor
        self._placed: dict[str, torch.device] = {}
        # Uploads still in use, by tensor and device (weakly: a raw copy dropped after dequantizing is freed).
        self._uploads: weakref.WeakValueDictionary[tuple[str, torch.device], torch.Tensor] = (
            weakref.WeakValueDictionary()
        )
        self._dequantized: dict[str, int] = {}
        self._notices: list[str] = []
        self._amx_bytes = 0  # matrices copied into ggml's AMX buffer (a CPU with AMX, unless TANDEM_AMX=0)
        # CPU expert stacks copied for ggml's interleaved kernels, made on a pool as loading goes
        cpu_stacks = [i for infos in cpu_experts_by_layer(f, plan.devices).values() for i in infos]
        # the whole model on the CPU: by default, and what llama.cpp's CPU backend repacks (MXFP4 too); beside a GPU
        # with --repack-experts only, Q4_K only
        cpu_only = self.compute_device.type == "cpu"
        enabled = not in_place and (cpu_only if repack_experts is None else repack_experts)
        self._repacks = ExpertRepacks(cpu_stacks, enabled, kernels.n_threads, cpu_only)
        self.host_boundaries: list[HostCall] = []  # the host ops of a GPU step
        self.pcie_experts = pcie_experts  # of each token's CPU experts in decode, read by the GPU (--pcie-experts)
        self._pcie_layers = 0
        self._cached: dict[int, tuple[tuple[int, ...], int]] = {}  # layer -> (cached expert ids, VRAM bytes)
        self.cache_slots: list[CacheSlots] = []  # the cached layers' slots, for online re-placement
        self.routing_counts = routing_counts  # every layer's expert picks, counted on the device (--expert-stats)
        self._stream: ExpertStream | None = None
        self._copies: HostCopies | None = None  # the staging copies of --pcie-experts batches (one stream)
        if self.compute_device.type != "cpu" and plan.staging_bytes:
            self._start_streaming()

    # -- bookkeeping ------------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self.file.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.file.tensors[name]
        except KeyError:
            raise UnsupportedModelError(f"{self.file.path.name}: required tensor '{name}' is missing") from None

    def _device(self, name: str) -> torch.device:
        return torch.device(self.plan.device_of(name))

    def _record(self, info: TensorInfo, storage: torch.Tensor | np.ndarray) -> None:
        self._placed[info.name] = storage.device if isinstance(storage, torch.Tensor) else torch.device("cpu")
        if self.on_tensor is not None:
            self.on_tensor(info)

    def placed(self) -> dict[str, str]:
        """tensor name -> device, read from the storage of every weight handed out."""
        return {name: str(device) for name, device in self._placed.items()}

    def notices(self) -> list[str]:
        """One line per quant type that has no GPU kernel and was dequantized at load, one per fallback, and one per
        option of tandem's own that changed how experts compute (--repack-experts, --pcie-experts)."""
        own = [self._repacks.notice] if self._repacks.notice else []  # what tandem's own options did
        if self._amx_bytes:
            own.append(f"{self._amx_bytes / 2**20:,.0f} MiB of matrices in ggml's AMX buffer, as llama.cpp's build "
                       f"holds them on this CPU ({AMX_ENV}=0: not)")
        elif notice := amx_notice():
            own.append(notice)
        if self._cached:
            n = sum(len(ids) for ids, _ in self._cached.values())
            mib = sum(b for _, b in self._cached.values()) / 2**20
            own.append(
                f"expert cache: {n} experts of {len(self._cached)} layer(s) in VRAM ({mib:,.1f} MiB) beside their "
                "layers' experts in host RAM; each step splits a layer's picks between the two"
            )
        if self._pcie_layers:
            own.append(
                f"--pcie-experts {self.pcie_experts}: in decode, the GPU computes {self.pcie_experts} of each token's "
                f"experts in host RAM ({self._pcie_layers} layers), reading their blocks there over PCIe (no copy, "
                "no VRAM); the CPU computes the others"
            )
        return (
            [
                f"{qtype}: no GPU kernel yet; {n} tensor(s) dequantized to {str(self.dtype).removeprefix('torch.')} "
                "at load"
                for qtype, n in sorted(self._dequantized.items())
            ]
            + self._notices
            + own
        )

    def cpu_experts(self, info: TensorInfo) -> GGMLExperts:
        """A stack of experts computed by ggml on the CPU, straight on the file's blocks, or on a repacked copy
        of them with --repack-experts (Q4_K, where ggml repacks it on this CPU; weights/repack.py)."""
        self._record(info, info.data)
        return GGMLExperts(self._repacks.weight(info), self.kernels)

    def _start_streaming(self) -> None:
        """The prefill window for CPU-resident experts, and their file bytes page-locked in place (no copy,
        no VRAM) so that streaming them runs at PCIe speed."""
        from tandem.cuda.host_memory import register_host

        layers = cpu_experts_by_layer(self.file, self.plan.devices)
        size = staging_size(layers)
        if size.total == 0:
            return
        # The whole mapping, not just the experts' span: a copy from a range that is partly page-locked
        # (a small tensor sharing a page with the span's edge) fails with an invalid-argument error.
        first = next(i for infos in layers.values() for i in infos)
        start = _address(first) - first.offset  # the file's first byte
        end = start + self.file.file_size
        owner = first.data  # a view of the file mapping: keeps it mapped while registered
        pinned = register_host(start, end - start, read_only=True, owner=owner, device=self.compute_device)
        if not isinstance(pinned, str):
            try:  # some platforms accept the registration and then refuse copies from it
                _as_torch_bytes(first.data[:PAGE_PROBE]).to(self.compute_device)
            except RuntimeError as e:
                pinned.close()
                pinned = f"copies from it fail: {str(e).splitlines()[0]}"
        if isinstance(pinned, str):
            self._notices.append(
                f"prefill copies CPU experts through page-locked bounce buffers: the file ({(end - start) >> 20} MiB) "
                f"could not be page-locked in place ({pinned})"
            )
        self._stream = ExpertStream(
            size.slot_bytes, size.vector_bytes, self.compute_device, None if isinstance(pinned, str) else pinned
        )

    def _upload(self, info: TensorInfo, device: torch.device) -> torch.Tensor:
        """The tensor's bytes on `device`, copied once: a tied table (no `output.weight`) is both the embedding
        and the output head, and the plan counts it once (Gemma 4 26B-A4B's is 578 MiB)."""
        key = (info.name, device)
        data = self._uploads.get(key)
        if data is None:
            data = _as_torch_bytes(info.data).to(device)
            self._uploads[key] = data
            self._record(info, data)
        return data

    # -- weights ----------------------------------------------------------------------------------
    def vector(self, name: str) -> torch.Tensor:
        """A small tensor (norm weights, biases, scales) as float32 where the plan puts it."""
        info = self.info(name)
        device = self._device(name)
        if device != self.compute_device and expert_layer(name) is None:
            raise PlacementError(
                f"-ot/--override-tensor: '{name}' is not a matrix; only matrices and expert tensors can be "
                f"placed apart from --device {self.plan.compute_device}"
            )
        data = _as_torch_bytes(info.data) if device.type == "cpu" else self._upload(info, device)
        if device.type == "cpu":
            self._record(info, data)
        return dequantize(data, info.qtype, info.shape)

    def linear(self, name: str) -> Linear:
        """A matrix where the plan puts it. On the CPU of a CPU model it is held as llama.cpp's CPU backend
        holds it (`prepare_cpu_weight`: a copy repacked for ggml's interleaved kernels where ggml repacks it,
        else the memory map); a CPU matrix of a GPU model stays in the memory map."""
        info = self.info(name)
        device = self._device(name)
        if device.type == "cpu":
            self._record(info, info.data)
            weight = GGMLWeight(data=info.data, qtype=info.qtype, shape=info.shape)
            if self.compute_device.type == "cpu" and not self.in_place:  # llama.cpp's CPU backend: repacked copies
                prepared = prepare_cpu_weight(weight)
                if prepared.repacked is not None and prepared.repacked.kind == "AMX":
                    self._amx_bytes += prepared.repacked.nbytes
                return GGMLLinear(prepared, self.kernels)
            return self._boundary(HostLinear(GGMLLinear(weight, self.kernels)))
        from tandem.cuda.qlinear import GPUQuantWeight
        from tandem.cuda.weights import DenseLinear, GPUQuantLinear

        if info.qtype in GPU_NATIVE_TYPES:
            return GPUQuantLinear(GPUQuantWeight(self._upload(info, device), info.qtype, info.shape), self.ieee)
        return DenseLinear(self._dense(info, device))

    def experts(self, name: str) -> Experts:
        info = self.info(name)
        device = self._device(name)
        if device.type == "cpu":
            experts = self.cpu_experts(info)
            return experts if self.compute_device.type == "cpu" else self._boundary(HostExperts(experts))
        from tandem.cuda.qlinear import GPUQuantWeight
        from tandem.cuda.weights import DenseExperts, GPUQuantExperts

        if info.qtype in GPU_NATIVE_TYPES:
            return GPUQuantExperts(GPUQuantWeight(self._upload(info, device), info.qtype, info.shape), self.ieee)
        return DenseExperts(self._dense(info, device))

    def _dense(self, info: TensorInfo, device: torch.device) -> torch.Tensor:
        """A float weight on the GPU: float types as they are, other types dequantized (with a notice)."""
        raw = self._upload(info, device)
        if info.qtype in GPU_FLOAT_TYPES:
            return dequantize(raw, info.qtype, info.shape).to(torch.float32 if info.qtype.name == "F32" else self.dtype)
        self._dequantized[info.qtype.name] = self._dequantized.get(info.qtype.name, 0) + 1
        dense = dequantize(raw, info.qtype, info.shape).to(self.dtype)
        del raw
        return dense

    def embedding(self, name: str) -> QuantEmbedding:
        info = self.info(name)
        device = self._device(name)
        data = _as_torch_bytes(info.data) if device.type == "cpu" else self._upload(info, device)
        kernels = None
        if device.type == "cpu":
            self._record(info, info.data)
            kernels = self.kernels if lookup_supported(info.qtype) else None
        return QuantEmbedding(data, info, out_device=self.compute_device, out_dtype=self.act_dtype, kernels=kernels)

    def _boundary(self, op: HostLinear | HostExperts) -> HostLinear | HostExperts:
        self.host_boundaries.append(op.host)
        return op

    # -- routed experts -------------------------------------------------------------------------------
    def routed_experts(self, layer: int, build: Callable[[ExpertSource], RoutedExperts]) -> RoutedExperts:
        """The routed experts of `layer`, built by `build` from wherever the plan put their tensors.

        All on the compute device: built directly. All on the CPU under a GPU model: an OffloadedExperts
        that computes decode batches on the CPU and streams the blocks to the GPU for prefill batches.
        """
        experts = self._routed_experts(layer, build)
        if self.routing_counts is not None:
            return CountedExperts(experts, self.routing_counts, layer)
        return experts

    def _routed_experts(self, layer: int, build: Callable[[ExpertSource], RoutedExperts]) -> RoutedExperts:
        infos = [info for name, info in self.file.tensors.items() if expert_layer(name) == layer]
        devices = {self.plan.device_of(info.name) for info in infos}  # one: the plan keeps layers whole
        if self.compute_device.type == "cpu" or devices != {"cpu"}:
            return build(self)
        on_cpu = build(_HostSource(self))
        cached = self.plan.expert_cache.resident(layer)
        in_cache = layer in self.plan.expert_cache.layers  # (with a spare slot, possibly none cached yet)
        streamed, stage_vectors = None, None
        stream = self._stream
        if stream is not None and streamable(infos):
            vectors = [i for i in infos if len(i.shape) < 3]
            offsets = dict(zip((i.name for i in vectors), _offsets(vectors), strict=True))
            streamed = build(_StreamedSource(self, stream, offsets, skips=in_cache))

            def stage_vectors() -> None:
                for info in vectors:
                    view = stream.vectors(offsets[info.name] + info.n_bytes)[offsets[info.name] :]
                    view.copy_(_as_torch_bytes(info.data), non_blocking=True)

        pcie = staged = staging = None
        if self.pcie_experts:
            if stream is None or stream.source_pin is None or not streamable(infos):
                raise TandemError(  # check_pcie_experts vetted the types; this is the registration
                    f"--pcie-experts: {self.file.path.name} could not be page-locked for the GPU to read "
                    f"({'; '.join(self._notices) or 'no CPU experts to stream'}); run without --pcie-experts"
                )
            pcie = self._ggml_valued(build(_PCIeSource(self, skips=in_cache)))
            self._pcie_layers += 1
            if not in_cache:
                staged, staging = self._staged_experts(build, infos, stream) or (None, None)
        resident, slot_map = None, None
        if in_cache:
            if streamed is None:
                raise TandemError(  # the plan caches only layers whose types the GPU kernels read
                    f"--moe-cache/--gpu-memory: layer {layer}'s experts cannot be cached in VRAM: "
                    f"{'; '.join(self._notices) or 'no GPU kernel for their type'}"
                )
            resident, slot_map = self._cached_experts(layer, build, cached, infos)
        offloaded = OffloadedExperts(
            on_cpu=on_cpu, streamed=streamed, stage_vectors=stage_vectors, min_batch=OFFLOAD_MIN_BATCH,
            pcie=pcie, pcie_slots=self.pcie_experts, resident=resident, slot_map=slot_map, staged=staged,
            staging=staging,
        )  # fmt: skip
        self.host_boundaries.extend(offloaded.hosts)
        return offloaded

    def _ggml_valued(self, experts: RoutedExperts) -> RoutedExperts:
        """GPU experts that compute some of a step's experts in place of ggml (--pcie-experts), whose values the
        split must keep: their inputs are rounded as ggml rounds them before its products (the source's
        `ggml_inputs`) and their gated unit gives ggml's values (on random inputs the GPU's own are ~1% away,
        and tiny models then route tokens elsewhere)."""
        assert isinstance(experts, GLUExperts)  # every model's routed experts
        return dataclasses.replace(experts, glu=GGMLValuedGLU(experts.glu, self.compute_device))

    def _staged_experts(
        self, build: Callable[[ExpertSource], RoutedExperts], infos: list[TensorInfo], stream: ExpertStream
    ) -> tuple[RoutedExperts, ExpertStaging] | None:
        """--pcie-experts in batched decode: the layer's experts built over slots of the prefill window that the
        host op stages the step's most-used experts in, matrices and expert vectors (biases, scales) alike
        (weights/offload.py ExpertStaging); no VRAM of their own. None for a layer whose expert does not fit the
        window: its batches split by expert over PCIe in place."""
        n_experts = infos[0].shape[0]
        vectors = [i for i in infos if len(i.shape) < 3]
        per_expert = sum(i.n_bytes // n_experts for i in infos)
        map_bytes = staging_aligned(4 * n_experts)  # the slot map, at the end of the window's slots
        zero_rows = sum(i.n_bytes // n_experts for i in vectors)
        room = 2 * stream.slot_bytes - map_bytes - len(infos) * STAGING_ALIGN - zero_rows
        capacity = min(n_experts, room // per_expert)
        if capacity < 1:
            return None
        if self._copies is None:
            from tandem.cuda.host_memory import HostCopies

            self._copies = HostCopies(stream.copy_stream)
        regions: dict[str, StagedMatrix] = {}
        at = 0
        for info in infos:
            eb = info.n_bytes // n_experts
            rows = capacity + 1 if len(info.shape) < 3 else capacity  # a vector's extra row: the unstaged slots'
            window = stream.window[at : at + rows * eb]
            regions[info.name] = StagedMatrix(_as_torch_bytes(info.data), window, eb, vector=len(info.shape) < 3)
            at = staging_aligned(at + rows * eb)
        map_at = 2 * stream.slot_bytes - map_bytes
        slot_map = stream.window[map_at : map_at + 4 * n_experts].view(torch.int32)
        staged = self._ggml_valued(build(_StagedSource(self, regions, capacity)))
        staging = ExpertStaging(list(regions.values()), capacity, slot_map, self.pcie_experts, self._copies)
        return staged, staging

    def _cached_experts(
        self, layer: int, build: Callable[[ExpertSource], RoutedExperts], ids: tuple[int, ...],
        infos: list[TensorInfo], ggml_values: bool = False,
    ) -> tuple[RoutedExperts, torch.Tensor]:  # fmt: skip
        """The experts of `layer` the plan caches in VRAM: built over copies of their rows alone (slot i holds
        expert ids[i]), and the slot map [E] int32 (-1: not cached) on the compute device. With `ggml_values`
        they give ggml's values as the --pcie-experts ones do (tests compare the split with ggml alone); by
        default they compute as experts in VRAM do."""
        spare = self.plan.expert_cache.spare
        source = _CachedSource(self, ids, ggml_inputs=ggml_values, spare=spare)
        cached = build(source)
        if ggml_values:
            assert isinstance(cached, GLUExperts)
            cached = dataclasses.replace(cached, glu=GGMLValuedGLU(cached.glu, self.compute_device))
        slot_map = torch.full((infos[0].shape[0],), -1, dtype=torch.int32)
        slot_map[list(ids)] = torch.arange(len(ids), dtype=torch.int32)
        slot_map = slot_map.to(self.compute_device)
        self._cached[layer] = (ids, source.uploaded)
        self.cache_slots.append(
            CacheSlots(layer, slot_map, [*ids, *([-1] * spare)], source.matrices, source.vectors)
        )
        return cached, slot_map

    def cached_experts(self) -> dict[int, tuple[tuple[int, ...], int]]:
        """layer -> (the expert ids cached in VRAM, their bytes there), read back from the uploads made."""
        return dict(self._cached)


def _address(info: TensorInfo) -> int:
    return int(info.data.__array_interface__["data"][0])


def _offsets(infos: list[TensorInfo]) -> list[int]:
    """Byte offsets of tensors laid out one after another, each aligned."""
    offsets, at = [], 0
    for info in infos:
        offsets.append(at)
        at += staging_aligned(info.n_bytes)
    return offsets


class _HostSource:
    """CPU experts (ggml on the mmap) and CPU vectors, for the CPU side of OffloadedExperts."""

    def __init__(self, loader: WeightLoader) -> None:
        self.loader = loader

    def experts(self, name: str) -> Experts:
        return self.loader.cpu_experts(self.loader.info(name))

    def vector(self, name: str) -> torch.Tensor:
        info = self.loader.info(name)
        self.loader._record(info, info.data)
        return dequantize(_as_torch_bytes(info.data), info.qtype, info.shape)


class _CachedSource:
    """The experts of a layer the plan caches in VRAM: each matrix's rows of those experts alone (their GGUF
    blocks, in slot order) and each expert vector's entries, uploaded once; the rest of the tensors stays in
    host RAM. Their products skip the slots of a split's other parts (ids -1)."""

    def __init__(self, loader: WeightLoader, ids: tuple[int, ...], ggml_inputs: bool = False, spare: int = 0) -> None:
        self.loader, self.ids, self.ggml_inputs, self.spare = loader, ids, ggml_inputs, spare
        self.uploaded = 0  # bytes of the GPU's slots (the spare ones included)
        self.matrices: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (slots, host blocks, bytes per expert)
        self.vectors: list[tuple[torch.Tensor, torch.Tensor]] = []  # (slots, host values)

    @property
    def n_slots(self) -> int:
        return len(self.ids) + self.spare

    def _rows(self, info: TensorInfo) -> torch.Tensor:
        per = info.n_bytes // info.shape[0]
        data = torch.zeros(self.n_slots * per, dtype=torch.uint8, device=self.loader.compute_device)
        if self.ids:
            rows = np.concatenate([info.data[e * per : (e + 1) * per] for e in self.ids])
            data[: len(self.ids) * per].copy_(torch.from_numpy(rows))
        self.uploaded += data.numel()
        self.matrices.append((data, _as_torch_bytes(info.data), per))
        return data

    def experts(self, name: str) -> Experts:
        from tandem.cuda.qlinear import GPUQuantWeight
        from tandem.cuda.weights import GPUQuantExperts

        info = self.loader.info(name)
        if info.qtype not in GPU_NATIVE_TYPES:
            raise TandemError(f"{name}: {info.qtype.name} experts have no GPU kernel to cache them with")
        weight = GPUQuantWeight(self._rows(info), info.qtype, (self.n_slots, *info.shape[1:]))
        return GPUQuantExperts(weight, self.loader.ieee, ggml_inputs=self.ggml_inputs, skips=True)

    def vector(self, name: str) -> torch.Tensor:
        info = self.loader.info(name)
        host = dequantize(_as_torch_bytes(info.data), info.qtype, info.shape)
        values = torch.zeros((self.n_slots, *host.shape[1:]), dtype=host.dtype)
        values[: len(self.ids)] = host[list(self.ids)]
        values = values.to(self.loader.compute_device)
        self.uploaded += values.numel() * values.element_size()
        self.vectors.append((values, host))
        return values


class _PCIeSource:
    """Experts and vectors read by the GPU in place, over PCIe, from the page-locked file (--pcie-experts):
    device views of host memory, so nothing is copied and no VRAM is taken (the plan's CPU tensors stay there)."""

    def __init__(self, loader: WeightLoader, skips: bool = False) -> None:
        self.loader = loader
        self.skips = skips  # the layer's cached experts compute from VRAM: their slots are -1 here

    def _view(self, info: TensorInfo) -> torch.Tensor:
        from tandem.cuda.host_memory import device_view

        return device_view(_as_torch_bytes(info.data), self.loader.compute_device)

    def experts(self, name: str) -> Experts:
        from tandem.cuda.qlinear import GPUQuantWeight
        from tandem.cuda.weights import GPUQuantExperts

        info = self.loader.info(name)
        weight = GPUQuantWeight(self._view(info), info.qtype, info.shape, host_mapped=True)
        return GPUQuantExperts(weight, self.loader.ieee, ggml_inputs=True, skips=self.skips)

    def vector(self, name: str) -> torch.Tensor:
        info = self.loader.info(name)
        return self._view(info).view(torch.float32).view(info.shape)  # F32 (streamable)


class _StagedSource:
    """A layer's experts (matrices and vectors) as slots of the prefill window that ExpertStaging copies a batch's
    most-used experts into (--pcie-experts in batched decode); the slots of the step's other experts are -1."""

    def __init__(self, loader: WeightLoader, regions: dict[str, StagedMatrix], capacity: int) -> None:
        self.loader, self.regions, self.capacity = loader, regions, capacity

    def experts(self, name: str) -> Experts:
        from tandem.cuda.qlinear import GPUQuantWeight
        from tandem.cuda.weights import GPUQuantExperts

        info = self.loader.info(name)
        weight = GPUQuantWeight(self.regions[name].window, info.qtype, (self.capacity, *info.shape[1:]))
        return GPUQuantExperts(weight, self.loader.ieee, ggml_inputs=True, skips=True)

    def vector(self, name: str) -> torch.Tensor:
        info = self.loader.info(name)  # F32 (streamable): one row per expert, and the zero row of slot -1
        return self.regions[name].window.view(torch.float32).view(self.capacity + 1, *info.shape[1:])


class _StreamedSource:
    """Experts whose blocks stay in host RAM and stream to the GPU when a prefill batch uses them; vectors
    are views of the window's vector region, valid once `stage_vectors` copied them (each prefill step)."""

    def __init__(
        self, loader: WeightLoader, stream: ExpertStream, offsets: dict[str, int], skips: bool = False
    ) -> None:
        self.loader = loader
        self.stream = stream
        self.offsets = offsets
        self.skips = skips  # the layer's cached experts compute from VRAM: their slots are -1 here

    def experts(self, name: str) -> Experts:
        from tandem.cuda.qlinear import GPUQuantWeight
        from tandem.cuda.weights import GPUQuantExperts

        info = self.loader.info(name)
        blocks = GPUQuantWeight(_as_torch_bytes(info.data), info.qtype, info.shape, stream=self.stream)
        return GPUQuantExperts(blocks, self.loader.ieee, skips=self.skips)

    def vector(self, name: str) -> torch.Tensor:
        info = self.loader.info(name)
        at = self.offsets[name]
        return self.stream.vectors(at + info.n_bytes)[at:].view(torch.float32).view(info.shape)
