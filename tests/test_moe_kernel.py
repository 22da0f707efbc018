"""tandem's CPU kernel for the routed experts of a few tokens (tandem.quant.moe_kernel): the same results as ggml's
graph on random Q4_K and Q6_K stacks, in its AVX-512 and its portable build, and the cases it leaves to ggml."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from tandem.errors import TandemError
from tandem.quant import moe_kernel
from tandem.quant import native as native_build
from tandem.quant.expert_ffn import ExpertFFN
from tandem.quant.ggml_cpu import CPUKernels
from tandem.quant.ggml_weights import GGMLWeight

# The kernel is used on CPUs with AVX-512BW; its portable build is tested wherever there is a C compiler.
native_kernel = pytest.mark.skipif(not moe_kernel.available()[0], reason=f"not used here: {moe_kernel.available()[1]}")

E, K, F, D, A = 16, 512, 256, 512, 4


def random_stack(qtype: Q, shape: tuple[int, int, int], seed: int) -> GGMLWeight:
    """Random blocks with finite float16 scales of ~1/64 (the codes and the 6- and 8-bit sub-scales are any)."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    n_blocks = shape[0] * shape[1] * shape[2] // block
    data = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    scales = rng.uniform(0.5, 2.0, (n_blocks, 2)).astype(np.float16) / np.float16(64)
    if qtype == Q.Q6_K:  # d ends the block
        data[:, size - 2 : size] = scales[:, :1].view(np.uint8)
    elif qtype == Q.Q8_0:  # d leads it
        data[:, 0:2] = scales[:, :1].view(np.uint8)
    else:  # Q4_K, Q5_K: d, dmin lead it
        data[:, 0:4] = scales.view(np.uint8)
    return GGMLWeight(data.reshape(-1), qtype, shape)


def ffn_of(types: tuple[Q, Q, Q], fused: bool = False) -> ExpertFFN:
    if fused:
        return ExpertFFN(down=random_stack(types[2], (E, D, F), 3), glu="swiglu",
                         gate_up=random_stack(types[0], (E, 2 * F, K), 1))  # fmt: skip
    return ExpertFFN(down=random_stack(types[2], (E, D, F), 3), glu="swiglu",
                     gate=random_stack(types[0], (E, F, K), 1), up=random_stack(types[1], (E, F, K), 2))  # fmt: skip


def routes(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, K, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(t)]).to(torch.int32)
    return x, ids, torch.rand(t, A, generator=g)


def native(
    ffn: ExpertFFN, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, threads: int = 2,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:  # fmt: skip
    out = torch.full((x.shape[0], D), float("nan"))
    stacks = tuple((s.ptr, s.qtype) for s in ffn.stacks)
    nbytes, run = moe_kernel.experts_into(out, x, ids, w, stacks, (ffn.down.ptr, ffn.down.qtype), E, F, threads, lib)
    scratch = torch.full((nbytes,), 0xAB, dtype=torch.uint8)  # not zeroed: the kernel must not read it before writing
    run(scratch.data_ptr())
    return out


def close_to_ggml(out: torch.Tensor, ref: torch.Tensor) -> None:
    """The products are ggml's integers; the float32 sums differ in order (~1e-7 of a value: the median bound).
    Where that moves a gated unit's value across a rounding boundary of its Q8_K code, that token's down product
    moves by the code's step (1/127 of its 256-value block's largest value) times a down row: 1.4e-3 of the
    output's largest value in one of these cases, all of that token's outputs (the max bound: a few such steps)."""
    scale = ref.abs().max().item()
    diff = (out - ref).abs()
    assert torch.isfinite(out).all()
    assert diff.max().item() <= 5e-3 * scale
    assert diff.median().item() <= 1e-5 * scale


@native_kernel
@pytest.mark.parametrize(
    "types", [(Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q4_K, Q.Q4_K, Q.Q4_K), (Q.Q5_K, Q.Q5_K, Q.Q6_K), (Q.Q6_K, Q.Q6_K, Q.Q6_K)]
)
@pytest.mark.parametrize("t", [1, 3, 9, 20])
def test_the_kernel_computes_what_ggml_does(types: tuple[Q, Q, Q], t: int) -> None:
    """Tokens routed 1 to 9 an expert (20 tokens x 4 of 16 experts: 5 on average; 9 on one takes two groups of a
    row's unpacking), the expert types of the Q4_K_M, Q5_K_M and Q6_K mixes."""
    ffn = ffn_of(types)
    x, ids, w = routes(t, seed=t)
    with CPUKernels(2, native=False) as ggml_kernels:
        ref = ggml_kernels.gated_experts(x, ffn, ids, w)
    close_to_ggml(native(ffn, x, ids, w), ref)


@native_kernel
def test_a_fused_gate_up_stack_is_read_as_gate_rows_then_up_rows() -> None:
    ffn = ffn_of((Q.Q4_K, Q.Q4_K, Q.Q6_K), fused=True)
    x, ids, w = routes(5, seed=5)
    with CPUKernels(2, native=False) as ggml_kernels:
        ref = ggml_kernels.gated_experts(x, ffn, ids, w)
    close_to_ggml(native(ffn, x, ids, w, threads=1), ref)


@pytest.mark.skipif(native_build.compiler() is None, reason="no C compiler")
@pytest.mark.parametrize("types", [(Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q5_K, Q.Q5_K, Q.Q4_K)])
def test_the_portable_build_computes_the_same_integers(tmp_path: Path, types: tuple[Q, Q, Q]) -> None:
    """Built without AVX-512 (plain C: the integers written out one by one, the reference the vector code is checked
    against on any machine), the kernel gives ggml's results, and the AVX-512 build's where that runs."""
    plain = tmp_path / "plain.so"
    moe_kernel.compile_library(plain, march="x86-64")
    lib = moe_kernel.load(plain)
    assert lib.moe_experts_simd() == 0
    ffn = ffn_of(types)
    for t in (1, 11):
        x, ids, w = routes(t, seed=t)
        out = native(ffn, x, ids, w, lib=lib)
        with CPUKernels(2, native=False) as ggml_kernels:
            close_to_ggml(out, ggml_kernels.gated_experts(x, ffn, ids, w))
        if moe_kernel.available()[0]:
            close_to_ggml(out, native(ffn, x, ids, w))


@native_kernel
def test_gated_experts_take_the_kernel_from_2_tokens_up_to_8_an_expert(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPUKernels hands an FFN the kernel takes to it from 2 tokens up to 8 tokens an expert on average, and to
    ggml's graph for one token, past 8 an expert, and for other gated units, biases and types."""
    calls: list[int] = []
    real = moe_kernel.experts_into

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args[2].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(moe_kernel, "experts_into", counting)
    ffn = ffn_of((Q.Q4_K, Q.Q4_K, Q.Q6_K))
    with CPUKernels(2) as kernels:
        for t in (1, 2, 32, 33, 40):  # 32 tokens x 4 slots = 8 an expert
            x, ids, w = routes(t, seed=t)
            kernels.gated_experts(x, ffn, ids, w)
        assert calls == [2, 32]
        geglu = ExpertFFN(down=ffn.down, glu="geglu", gate=ffn.gate, up=ffn.up)
        biased = ExpertFFN(down=ffn.down, glu="swiglu", gate=ffn.gate, up=ffn.up, down_bias=torch.zeros(E, D))
        q8 = ExpertFFN(down=ffn.down, glu="swiglu", gate=random_stack(Q.Q8_0, (E, F, K), 4), up=ffn.up)
        for other in (geglu, biased, q8):
            x, ids, w = routes(2, seed=2)
            kernels.gated_experts(x, other, ids, w)
        assert calls == [2, 32]
    with CPUKernels(2, native=False) as kernels:
        kernels.gated_experts(*routes(3, seed=3)[:1], ffn, *routes(3, seed=3)[1:])
    assert calls == [2, 32]


@native_kernel
def test_an_expert_id_out_of_range_is_refused() -> None:
    ffn = ffn_of((Q.Q4_K, Q.Q4_K, Q.Q6_K))
    x, ids, w = routes(2, seed=2)
    ids[1, 0] = E
    with pytest.raises(ValueError, match="out of range"):
        native(ffn, x, ids, w)


@native_kernel
def test_the_library_is_built_once_into_the_cache() -> None:
    lib, why = moe_kernel._library()
    assert lib is not None and why == ""
    path = Path(lib._name)
    assert path.parent == native_build.cache_dir() and path.name.startswith("moe_experts-")
    assert moe_kernel.load(path).moe_experts_simd() == 1


@pytest.mark.parametrize("value", ["ggml", "off", "0", "OFF "])
def test_ggml_by_request(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """TANDEM_MOE_KERNEL=ggml (off, 0): no kernel, and why; an unknown value is a one-line error."""
    moe_kernel._library.cache_clear()
    monkeypatch.setenv(moe_kernel.ENV, value)
    try:
        assert moe_kernel.available() == (False, f"{moe_kernel.ENV}={value.strip().lower()}")
        monkeypatch.setenv(moe_kernel.ENV, "fast")
        moe_kernel._library.cache_clear()  # read once per process
        with pytest.raises(TandemError, match="TANDEM_MOE_KERNEL='fast': expected auto"):
            moe_kernel.available()
    finally:
        monkeypatch.delenv(moe_kernel.ENV)
        moe_kernel._library.cache_clear()
