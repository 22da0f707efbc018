"""GGUF weights as ggml reads them on the CPU: `GGMLWeight` (the raw blocks, normally a view into the
file's memory map) and, where ggml's CPU backend multiplies a weight from another layout, its repacked copy.

* Repacked weights. llama.cpp loads the weights its CPU backend can repack into ggml's `CPU_REPACK` buffer
  type (on x86 with AVX2: Q4_0, Q4_K, IQ4_NL, MXFP4, and Q2_K with AVX-512, when the row count is a
  multiple of 8) and multiplies them with the interleaved gemm/gemv kernels. tandem's ggml has the same
  buffer type and kernels: such a matrix is copied into it (`RepackedTensor`; ggml decides, through the
  buffer type and `supports_op`, as llama.cpp's loader asks it) and its products run on the copy
  (`prepare_cpu_weight`). That costs the weight's bytes in RAM, as in llama.cpp (whose mmap pages of those
  weights then go cold). Expert stacks stay in the memory map, as llama.cpp keeps `--cpu-moe` experts,
  unless `--repack-experts` asks for copies (`repack_experts`).
* AMX: on a CPU with AMX, llama.cpp's default build puts the matrices its AMX kernels take (Q4_0, Q4_1, Q8_0,
  Q4_K, Q5_K, Q6_K, IQ4_XS) into ggml's AMX buffer type before CPU_REPACK (Qwen3-30B-A3B's attention: 749 MiB),
  where prefill multiplies them on tiles; tandem's ggml has the same buffer type and does the same by default
  (`TANDEM_AMX=0`: never), once a child process has run one AMX product and matched the plain one (`amx_usable`):
  some virtual machines advertise AMX and fault on its first tile instruction (`ldtilecfg`: SIGSEGV on a 2-vCPU
  dev machine), which must not take the process down. Where the build has no AMX buffer type (a CPU without AMX)
  nothing is tried. The project's llama.cpp CPU builds for the dev machine leave AMX out (scripts/build_llamacpp.sh).
* The tiled K-quant product: for 8 activation rows or more, ggml (0.25 and later, as llama.cpp runs it) multiplies
  K-quant weights that are not repacked with a tiled kernel; `ggml_mul_mat` takes it by itself.

`point_weight` / `point_tensor` aim a ggml tensor at a weight's bytes (the blocks or the copy).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache

import ggml
import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

__all__ = ["GGMLWeight", "RepackedTensor", "lookup_supported", "mul_mat_supported", "prepare_cpu_weight",
           "repack_experts", "point_weight", "point_tensor", "new_tensor"]  # fmt: skip


def mul_mat_supported(qtype: GGMLQuantizationType) -> bool:
    """Whether this ggml build has a CPU dot product for `qtype` (so `ggml_mul_mat` can use it)."""
    try:
        traits = ggml.ggml_get_type_traits_cpu(int(qtype)).contents
    except (ValueError, OSError):
        return False
    return bool(traits.vec_dot)


def lookup_supported(qtype: GGMLQuantizationType) -> bool:
    """Whether ggml's CPU row lookup (`ggml_get_rows`) decodes `qtype`: float32, or a type with a decoder."""
    if qtype == GGMLQuantizationType.F32:
        return True
    try:
        traits = ggml.ggml_get_type_traits(int(qtype)).contents
    except (ValueError, OSError):
        return False
    return bool(traits.to_float)


@dataclass(frozen=True, eq=False)  # eq=False: identity equality/hash (ndarray fields do not compare)
class GGMLWeight:
    """A quantized weight as it lies in the GGUF file.

    `data` is the uint8, C-contiguous raw bytes (normally a view into the file's memory map); this
    object keeps it alive, so the ggml tensors that point at it stay valid while it is referenced.
    `shape` is in PyTorch order: (N, K) for a matrix, (E, N, K) for stacked experts.

    `repacked`: the copy llama.cpp's CPU backend would multiply instead of the blocks, where it repacks the matrix
    (set by `prepare_cpu_weight`; see the module docstring).
    """

    data: np.ndarray
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    # Address of data[0], read once here rather than on every call.
    ptr: int = field(init=False, repr=False)
    repacked: RepackedTensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        qtype = GGMLQuantizationType(self.qtype)
        object.__setattr__(self, "qtype", qtype)
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if len(self.shape) not in (2, 3) or min(self.shape) <= 0:
            raise ValueError(f"GGMLWeight shape must be (N, K) or (E, N, K) with positive sizes, got {self.shape}")
        if self.data.dtype != np.uint8 or not self.data.flags.c_contiguous:
            raise ValueError("GGMLWeight data must be a C-contiguous uint8 array (the raw GGUF bytes)")
        block, type_size = GGML_QUANT_SIZES[qtype]
        k = self.shape[-1]
        if k % block:
            raise ValueError(f"row length {k} is not a multiple of the {qtype.name} block size {block}")
        n_rows = int(np.prod(self.shape[:-1]))
        expected = n_rows * (k // block) * type_size
        if self.data.nbytes != expected:
            raise ValueError(
                f"{qtype.name} weight of shape {self.shape} needs {expected} bytes, got {self.data.nbytes}"
            )
        object.__setattr__(self, "ptr", int(self.data.__array_interface__["data"][0]))


@lru_cache(maxsize=1)
def _extra_buffer_types() -> dict[str, int]:
    """The CPU device's extra buffer types by name (CPU_REPACK, AMX, ...: those this build has)."""
    reg = ggml.ggml_backend_cpu_reg()
    proc = ggml.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if not proc:
        return {}
    get_extra = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(proc)
    types = get_extra(ggml.ggml_backend_reg_dev_get(reg, 0))
    found: dict[str, int] = {}
    i = 0
    while types and types[i]:
        found[ggml.ggml_backend_buft_name(types[i]).decode()] = int(types[i])
        i += 1
    return found


AMX_ENV = "TANDEM_AMX"  # 0: never ggml's AMX buffer; 1: asked for (a notice where it cannot be); unset: where it runs
_AMX_CHECK_ROWS = 64  # activation rows of the child's product: on AMX's tiles (one row takes another path)


def amx_self_check() -> bool:
    """One Q4_K product of 64 rows from ggml's AMX buffer against the plain product: whether they agree to 1e-3.
    Run in a child process (`amx_usable`): where AMX faults, this process dies."""
    buft = _extra_buffer_types().get("AMX")
    if buft is None:
        return False
    from tandem.quant.ggml_cpu import CPUKernels

    rng = np.random.default_rng(0)
    n, k = 64, 512
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q4_K]
    raw = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
    scales = (rng.uniform(0.005, 0.015, size=(n * k // block, 2))).astype(np.float16)
    raw[:, :4] = scales.view(np.uint8)  # d and dmin: finite, small
    w = GGMLWeight(raw.reshape(-1), GGMLQuantizationType.Q4_K, (n, k))
    amx = RepackedTensor.create(w, (buft,))
    if amx is None:
        return False
    import torch

    kernels = CPUKernels(1)
    try:
        x = torch.from_numpy(rng.standard_normal((_AMX_CHECK_ROWS, k)).astype(np.float32))
        plain = kernels.matmul(x, w)
        got = kernels.matmul(x, dataclasses.replace(w, repacked=amx))
    finally:
        kernels.close()
    return bool(torch.isfinite(got).all()) and float((got - plain).abs().max()) <= 1e-3 * float(plain.abs().max())


@lru_cache(maxsize=1)
def amx_usable() -> bool:
    """Whether matrices go into ggml's AMX buffer: not refused (TANDEM_AMX=0), in this build (a CPU with AMX), and
    its product ran and matched in a child process (`amx_self_check`)."""
    if os.environ.get(AMX_ENV) == "0" or "AMX" not in _extra_buffer_types():
        return False
    code = "import sys; from tandem.quant.ggml_weights import amx_self_check; sys.exit(0 if amx_self_check() else 3)"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def amx_notice() -> str:
    """One line when TANDEM_AMX=1 asked for AMX and this machine cannot give it (else empty)."""
    if os.environ.get(AMX_ENV) != "1" or amx_usable():
        return ""
    if "AMX" not in _extra_buffer_types():
        return f"{AMX_ENV}=1: this ggml build has no AMX buffer type; matrices stay as without it"
    return f"{AMX_ENV}=1: ggml's AMX product failed in a child process on this CPU; matrices stay as without it"


def _buffer_types(matrix: bool) -> tuple[int, ...]:
    """The extra buffer types a matrix (or a stack of experts) may be copied into, in llama.cpp's order of
    preference: AMX only for matrices, and only where `amx_usable`."""
    found = _extra_buffer_types()
    names = ("AMX", "CPU_REPACK") if matrix and amx_usable() else ("CPU_REPACK",)
    return tuple(found[name] for name in names if name in found)


# Activation rows of the product llama.cpp's loader asks the backend about (weight_buft_supported).
_PROBE_ROWS = 512


class RepackedTensor:
    """A matrix or a stack of experts copied into ggml's CPU_REPACK buffer, in the interleaved layout of
    ggml's gemm/gemv kernels.

    Owns a ggml context (the tensor's metadata) and a backend buffer (the repacked bytes), both freed with
    this object. `data`, `buffer` and `extra` are what a ggml tensor standing for it must carry: the
    CPU backend picks the repacked kernels from the buffer's type and runs them with `extra`.
    """

    __slots__ = ("data", "buffer", "extra", "nbytes", "kind", "__weakref__")

    def __init__(self, ctx: int, buffer: int, tensor: ggml.ggml_tensor_p, kind: str) -> None:
        self.buffer = buffer
        self.data = int(tensor.contents.data)
        self.extra = int(tensor.contents.extra)
        self.nbytes = int(ggml.ggml_nbytes(tensor))
        self.kind = kind  # the buffer type's name: CPU_REPACK or AMX
        weakref.finalize(self, _free_repacked, ctx, buffer)

    @classmethod
    def create(cls, w: GGMLWeight, bufts: tuple[int, ...] | None = None) -> RepackedTensor | None:
        """w copied into the first of `bufts` (default: `_buffer_types`) that takes its type and shape on this
        machine, or None when none does: ggml decides, as llama.cpp's loader asks it."""
        for buft in _buffer_types(len(w.shape) == 2) if bufts is None else bufts:
            made = cls._create(w, buft)
            if made is not None:
                return made
        return None

    @classmethod
    def _create(cls, w: GGMLWeight, buft: int) -> RepackedTensor | None:
        k = w.shape[-1]
        mem = ggml.ggml_tensor_overhead() * 4
        ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=mem, mem_buffer=None, no_alloc=True))
        if not ctx:
            raise MemoryError("ggml_init failed")
        buffer = None
        try:
            t = new_tensor(ctx, int(w.qtype), w.shape[::-1])
            if len(w.shape) == 2:  # the product llama.cpp's loader asks about
                probe = ggml.ggml_mul_mat(ctx, t, ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, k, _PROBE_ROWS))
            else:  # a stack of experts: one token's selected experts
                x = ggml.ggml_new_tensor_3d(ctx, ggml.GGML_TYPE_F32, k, 1, 1)
                probe = ggml.ggml_mul_mat_id(ctx, t, x, ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_I32, 1, 1))
            buffer = ggml.ggml_backend_buft_alloc_buffer(buft, ggml.ggml_backend_buft_get_alloc_size(buft, t))
            if not buffer:
                raise MemoryError(f"could not allocate {ggml.ggml_nbytes(t)} bytes for a repacked weight")
            # The buffer's init_tensor picks the repacked layout for the type and shape (extra), or none.
            if ggml.ggml_backend_tensor_alloc(buffer, t, ggml.ggml_backend_buffer_get_base(buffer)) != 0:
                raise MemoryError("ggml_backend_tensor_alloc failed")
            device = ggml.ggml_backend_buft_get_device(buft)
            if not t.contents.extra or not ggml.ggml_backend_dev_supports_op(device, probe):
                _free_repacked(ctx, buffer)
                return None
            with _without_ggml_debug_log():  # ggml announces each repacked tensor at debug level
                ggml.ggml_backend_tensor_set(t, w.ptr, 0, w.data.nbytes)  # repacks the blocks into the buffer
        except BaseException:
            _free_repacked(ctx, buffer)
            raise
        return cls(ctx, buffer, t, ggml.ggml_backend_buft_name(buft).decode())


class _DebugLogFilter:
    """ggml's debug-level messages dropped while some thread is inside `hold()` (ggml-python's default logger
    prints every level to stderr; llama.cpp's hides debug); the others go to the logger in place. Repacks run on
    a pool of threads: the first one in installs the filter, the last one out restores the logger."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._saved: tuple[object, object, object] | None = None  # previous logger, its user data, the filter

    def _install(self) -> None:
        previous = ggml.ggml_log_callback()
        user_data = ctypes.c_void_p()
        ggml.ggml_log_get(ctypes.byref(previous), ctypes.byref(user_data))

        def log(level: int, text: bytes, _: int | None) -> None:
            if level != ggml.GGML_LOG_LEVEL_DEBUG:
                previous(level, text, user_data)

        callback = ggml.ggml_log_callback(log)  # kept referenced in _saved while installed
        ggml.ggml_log_set(callback, None)
        self._saved = (previous, user_data, callback)

    @contextmanager
    def hold(self) -> Iterator[None]:
        with self._lock:
            if self._depth == 0:
                self._install()
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0 and self._saved is not None:
                    previous, user_data, _ = self._saved
                    ggml.ggml_log_set(previous, user_data)
                    self._saved = None


_without_ggml_debug_log = _DebugLogFilter().hold


def _free_repacked(ctx: int, buffer: int | None) -> None:
    if buffer:
        ggml.ggml_backend_buffer_free(buffer)
    ggml.ggml_free(ctx)


def prepare_cpu_weight(w: GGMLWeight) -> GGMLWeight:
    """w held as llama.cpp's CPU backend holds a matrix that it multiplies: copied into the AMX (a CPU with AMX,
    unless TANDEM_AMX=0) or CPU_REPACK buffer when ggml takes it there, else left in the memory map. Stacked
    experts (mul_mat_id) are left as they are."""
    if len(w.shape) != 2 or w.repacked is not None:
        return w
    repacked = RepackedTensor.create(w)
    return w if repacked is None else dataclasses.replace(w, repacked=repacked)


# Expert types repacked beside a GPU (--repack-experts): those whose repacked product equals the plain one to
# float32 rounding (tests/test_synth.py). ggml also repacks MXFP4 on x86, but its repacked gemv quantizes the
# activations otherwise: ~1e-4 relative away from the plain product, which llama.cpp's --cpu-moe computes. With the
# whole model on the CPU llama.cpp repacks MXFP4 too, and so does tandem (`cpu_only`).
_REPACKED_EXPERT_TYPES = frozenset({GGMLQuantizationType.Q4_K})
_CPU_ONLY_REPACKED_EXPERT_TYPES = _REPACKED_EXPERT_TYPES | {GGMLQuantizationType.MXFP4}


def repackable_experts(w: GGMLWeight, cpu_only: bool = False) -> bool:
    """Whether `repack_experts` may copy this stack (ggml has the last word, by its type and shape here)."""
    types = _CPU_ONLY_REPACKED_EXPERT_TYPES if cpu_only else _REPACKED_EXPERT_TYPES
    return len(w.shape) == 3 and w.repacked is None and w.qtype in types


def repack_experts(w: GGMLWeight, cpu_only: bool = False) -> GGMLWeight:
    """A Q4_K (or, `cpu_only`, MXFP4) stack of experts (E, N, K) with a copy in ggml's CPU_REPACK buffer where
    ggml repacks it on this CPU (x86 with AVX2), which the fused expert graph then multiplies with ggml's
    interleaved gemv; else w as it is. Its cost is host RAM equal to the stack. Beside a GPU llama.cpp leaves
    `--cpu-moe` experts in the file mapping, and the copies bought no decode speed on the GPU machine
    (weights/repack.py), where the blocks in the file stay what prefill streams to the GPU."""
    if not repackable_experts(w, cpu_only):
        return w
    repacked = RepackedTensor.create(w)
    return w if repacked is None else dataclasses.replace(w, repacked=repacked)


def point_weight(tensor: ggml.ggml_tensor, w: GGMLWeight) -> None:
    """Point a weight's ggml tensor at w's bytes: the mapped blocks, or the repacked copy."""
    point_tensor(tensor, w.ptr, w.repacked)


def point_tensor(tensor: ggml.ggml_tensor, ptr: int, repacked: RepackedTensor | None) -> None:
    """Point a ggml tensor at `ptr`, or at a repacked copy, whose buffer type selects ggml's repacked kernels
    and whose extra is their layout."""
    if repacked is None:
        tensor.data = ptr
    else:
        tensor.data = repacked.data
        tensor.buffer = repacked.buffer
        tensor.extra = repacked.extra


def new_tensor(ctx: int, gtype: int, ne: tuple[int, ...]) -> ggml.ggml_tensor_p:
    if len(ne) == 2:
        return ggml.ggml_new_tensor_2d(ctx, gtype, ne[0], ne[1])
    return ggml.ggml_new_tensor_3d(ctx, gtype, ne[0], ne[1], ne[2])
