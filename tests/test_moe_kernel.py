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

from tandem.quant import moe_kernel
from tandem.quant.ggml_cpu import CPUKernels, ExpertFFN
from tandem.quant.ggml_weights import GGMLWeight

pytestmark = pytest.mark.skipif(not moe_kernel.available()[0], reason=f"no MoE kernel: {moe_kernel.available()[1]}")

E, K, F, D, A = 16, 512, 256, 512, 4


def random_stack(qtype: Q, shape: tuple[int, int, int], seed: int) -> GGMLWeight:
    """Random blocks with finite float16 scales of ~1/64 (the codes and the 6- and 8-bit sub-scales are any)."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    n_blocks = shape[0] * shape[1] * shape[2] // block
    data = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    scales = rng.uniform(0.5, 2.0, (n_blocks, 2)).astype(np.float16) / np.float16(64)
    if qtype == Q.Q4_K:  # d, dmin lead the block
        data[:, 0:4] = scales.view(np.uint8)
    else:  # Q6_K: d ends it
        data[:, size - 2 : size] = scales[:, :1].view(np.uint8)
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


def native(ffn: ExpertFFN, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, threads: int = 2) -> torch.Tensor:
    out = torch.full((x.shape[0], D), float("nan"))
    stacks = tuple((s.ptr, s.qtype) for s in ffn.stacks)
    moe_kernel.experts_into(out, x, ids, w, stacks, (ffn.down.ptr, ffn.down.qtype), E, F, threads)()
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


@pytest.mark.parametrize("types", [(Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q4_K, Q.Q4_K, Q.Q4_K), (Q.Q6_K, Q.Q6_K, Q.Q6_K)])
@pytest.mark.parametrize("t", [1, 3, 9, 20])
def test_the_kernel_computes_what_ggml_does(types: tuple[Q, Q, Q], t: int) -> None:
    """Tokens routed 1 to 8 a expert (20 tokens x 4 of 16 experts: 5 on average, up to 9 on one: two groups of a
    row's unpacking), every Q4_K_M expert type."""
    ffn = ffn_of(types)
    x, ids, w = routes(t, seed=t)
    with CPUKernels(2, native=False) as ggml_kernels:
        ref = ggml_kernels.gated_experts(x, ffn, ids, w)
    close_to_ggml(native(ffn, x, ids, w), ref)


def test_a_fused_gate_up_stack_is_read_as_gate_rows_then_up_rows() -> None:
    ffn = ffn_of((Q.Q4_K, Q.Q4_K, Q.Q6_K), fused=True)
    x, ids, w = routes(5, seed=5)
    with CPUKernels(2, native=False) as ggml_kernels:
        ref = ggml_kernels.gated_experts(x, ffn, ids, w)
    close_to_ggml(native(ffn, x, ids, w, threads=1), ref)


def test_the_portable_build_computes_the_same_integers(tmp_path: Path) -> None:
    """Built without AVX-512 (plain C), the kernel gives the AVX-512 build's results but for the order of float32
    sums."""
    plain = tmp_path / "plain.so"
    moe_kernel.compile_library(plain, march="x86-64")
    lib = moe_kernel.load(plain)
    assert lib.moe_experts_simd() == 0
    ffn = ffn_of((Q.Q4_K, Q.Q4_K, Q.Q6_K))
    x, ids, w = routes(6, seed=6)
    out = torch.empty(6, D)
    stacks = tuple((s.ptr, s.qtype) for s in ffn.stacks)
    moe_kernel.experts_into(out, x, ids, w, stacks, (ffn.down.ptr, ffn.down.qtype), E, F, 2, lib=lib)()
    with CPUKernels(2, native=False) as ggml_kernels:
        close_to_ggml(out, ggml_kernels.gated_experts(x, ffn, ids, w))
    close_to_ggml(out, native(ffn, x, ids, w))


def test_gated_experts_take_the_kernel_below_ggml_tiled_token_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPUKernels hands an FFN the kernel takes to it below 8 tokens an expert, and to ggml's graph from there, for
    other gated units, biases and types."""
    calls: list[int] = []
    real = moe_kernel.experts_into

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args[2].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(moe_kernel, "experts_into", counting)
    ffn = ffn_of((Q.Q4_K, Q.Q4_K, Q.Q6_K))
    with CPUKernels(2) as kernels:
        for t in (1, 31, 32, 40):  # 32 tokens x 4 slots = 8 an expert
            kernels.gated_experts(*routes(t, seed=t)[:1], ffn, *routes(t, seed=t)[1:])
        assert calls == [1, 31]
        geglu = ExpertFFN(down=ffn.down, glu="geglu", gate=ffn.gate, up=ffn.up)
        biased = ExpertFFN(down=ffn.down, glu="swiglu", gate=ffn.gate, up=ffn.up, down_bias=torch.zeros(E, D))
        q5 = ExpertFFN(down=ffn.down, glu="swiglu", gate=random_stack(Q.Q5_K, (E, F, K), 4), up=ffn.up)
        for other in (geglu, biased, q5):
            x, ids, w = routes(2, seed=2)
            kernels.gated_experts(x, other, ids, w)
        assert calls == [1, 31]


def test_an_expert_id_out_of_range_is_refused() -> None:
    ffn = ffn_of((Q.Q4_K, Q.Q4_K, Q.Q6_K))
    x, ids, w = routes(2, seed=2)
    ids[1, 0] = E
    with pytest.raises(ValueError, match="out of range"):
        native(ffn, x, ids, w)


def test_the_library_is_named_by_source_compiler_and_cpu() -> None:
    lib, why = moe_kernel._library()
    assert lib is not None and why == ""
    path = Path(lib._name)
    assert path.parent == moe_kernel._cache_dir() and path.name.startswith("moe_experts-")
    assert isinstance(ctypes.CDLL(str(path)).moe_experts_simd(), int)
