"""tandem's own CPU kernel for the routed experts of a few tokens an expert (`moe_experts.c`), compiled on first use.

ggml's `mul_mat_id` multiplies an expert's rows by each of its tokens on its own below 8 tokens an expert (its
tiled kernel takes 8 and more, padding to 16), unpacking the K-quant blocks once per token. This kernel unpacks each
row's blocks once for up to 8 of the expert's tokens and runs the whole SwiGLU expert FFN (gate, up, gated unit,
down, the mix by the routing weights) as one call over one team of threads, in long row ranges per work item. The
arithmetic is ggml's (the same Q8_K activations, the same integer dot products per sub-block, float16 scales,
float32 sums in another order): see moe_experts.c. Measured in docs/PERFORMANCE.md (`bench/moe_kernel.py`).

It takes Q4_K, Q5_K and Q6_K stacks (the experts of the Q4_K_M, Q5_K_M and Q6_K mixes) of a SwiGLU FFN without
biases or per-expert scales, not repacked, from 2 tokens (a batched step) up to 8 tokens an expert on average, on a
CPU with AVX-512BW (its portable C path is 3-4x slower than ggml: tests only); everything else stays with ggml.
Built with the machine's C compiler (`cc -O3 -march=native -fopenmp`: GCC's OpenMP runtime, the one ggml's build
runs its threads in, so both share one team) into ~/.cache/tandem/native, named by the source, the compiler and
the CPU. `TANDEM_MOE_KERNEL=ggml` keeps every expert with ggml (llama.cpp's bits); `available()` says why the
kernel is not used, where it is not.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from tandem.quant import native

SOURCE = Path(__file__).with_name("moe_experts.c")
ENV = "TANDEM_MOE_KERNEL"  # "auto" (default): where it takes an FFN; "ggml" ("off", "0"): never
TYPES = frozenset({GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K})
# Up to this many tokens an expert on average (a step's slots over the experts); past it ggml's tiled kernel comes
# close (docs/PERFORMANCE.md, sessions 37-38).
MAX_TOKENS_PER_EXPERT = 8
# One token (a single sequence's decode) stays with ggml: per layer the kernel is about as fast there, and the
# single-stream --cpu-moe figures against llama.cpp are ggml's until a decode A/B says otherwise.
MIN_TOKENS = 2


def compile_library(out: Path, march: str = "native") -> None:
    """Build moe_experts.c into out for -march=`march`. Raises OSError with the compiler's last line."""
    native.compile_library(SOURCE, out, _flags(march))


def _flags(march: str) -> list[str]:
    return ["-O3", f"-march={march}", "-fopenmp"]


def load(lib: ctypes.CDLL | Path) -> ctypes.CDLL:
    """The built library (or the one at a path), its functions typed."""
    if isinstance(lib, Path):
        lib = ctypes.CDLL(str(lib))
    pointer, number = ctypes.c_void_p, ctypes.c_int
    lib.moe_experts_scratch_bytes.restype = ctypes.c_size_t
    lib.moe_experts_scratch_bytes.argtypes = [number] * 6
    lib.moe_experts_swiglu.restype = number
    lib.moe_experts_swiglu.argtypes = [number] * 6 + [pointer, number] * 3 + [pointer] * 5 + [number]
    lib.moe_experts_simd.restype = number
    return lib


def setting() -> str:
    """TANDEM_MOE_KERNEL as "auto" or "ggml"; TandemError for a value it does not know."""
    return native.setting(ENV)


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    """The kernel built for this machine and '', or None and why not."""
    lib, why = native.library(ENV, SOURCE, _flags("native"))
    if lib is None:
        return None, why
    load(lib)
    if not lib.moe_experts_simd():
        return None, "the CPU has no AVX-512BW (the kernel's portable path is slower than ggml)"
    return lib, ""


def available() -> tuple[bool, str]:
    """Whether the kernel is built and loaded here, and if not, why. Raises TandemError for a TANDEM_MOE_KERNEL
    value it does not know."""
    lib, why = _library()
    return lib is not None, why


def takes(
    glu: str, types: tuple[GGMLQuantizationType, ...], k: int, f: int, extras: bool, repacked: bool
) -> bool:
    """Whether an expert FFN of these kinds is this kernel's (the token count is decided per call)."""
    return (
        glu == "swiglu" and not extras and not repacked and all(t in TYPES for t in types)
        and k % 256 == 0 and f % 256 == 0 and _library()[0] is not None
    )  # fmt: skip


def experts_into(
    out: torch.Tensor,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    stacks: tuple[tuple[int, GGMLQuantizationType], ...],
    down: tuple[int, GGMLQuantizationType],
    n_experts: int,
    f: int,
    n_threads: int,
    lib: ctypes.CDLL | None = None,
) -> tuple[int, Callable[[int], None]]:
    """The routed SwiGLU experts on fixed buffers: returns the scratch bytes a call needs and the function that
    computes out [T, D] from x [T, K], ids and weights [T, A] (contiguous CPU float32, int32 in [0, n_experts),
    float32; the caller vouches for them and keeps them alive), given the address of that much scratch memory
    (calls one at a time may share it). stacks: (address, type) of gate and up, or of one fused gate_up; down
    likewise. lib: another build of the kernel (tests), else this machine's."""
    if lib is None:
        lib, why = _library()
        if lib is None:
            raise RuntimeError(f"the MoE kernel is not available: {why}")
    t, a = ids.shape
    k, d = x.shape[1], out.shape[1]
    (gate, gate_type), (up, up_type) = stacks if len(stacks) == 2 else (stacks[0], (0, stacks[0][1]))
    head = (t, a, n_experts, k, f, d, gate, int(gate_type), up or None, int(up_type), down[0], int(down[1]),
            x.data_ptr(), ids.data_ptr(), weights.data_ptr(), out.data_ptr())  # fmt: skip
    call = lib.moe_experts_swiglu

    def run(scratch: int) -> None:
        if call(*head, scratch, n_threads) != 0:
            raise ValueError("an expert id out of range, or a type the MoE kernel does not take")

    return int(lib.moe_experts_scratch_bytes(t, a, n_experts, k, f, d)), run
