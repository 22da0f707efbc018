"""ggml CPU products on quantized GGUF blocks against float64 references.

Two references per case:
  * exact: x @ dequant(W).T in float64. ggml converts x to the weight type's vec_dot type first
    (Q8_0/Q8_1 per 32 values, Q8_K per 256, F16, BF16), so the error is the activation rounding:
    for 8-bit blocks with scale amax/127 the error is uniform in +-d/2, rms d/sqrt(12), i.e. about
    2.1/(127*3.46) = 0.5 % of sigma for 32-value blocks of Gaussian x (amax ~ 2.1 sigma) and
    3/(127*3.46) = 0.7 % for 256-value blocks (amax ~ 3 sigma). With random weights the relative
    Frobenius error of y is the same ratio; the tolerances below are 2-3x that.
  * emulated: x rounded the way ggml rounds it (its quantize_row_q8_0 / q8_K), then the float64
    product. This must agree to float32 accumulation error, which shows the arithmetic is ggml's.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import subprocess
import sys
import threading
import weakref
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import ggml
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

import tandem.quant.ggml_cpu as gcpu
import tandem.quant.ggml_tiled as gtiled
from tandem.gguf.reader import TensorInfo
from tandem.layers.activations import ACTIVATIONS, ClampedSwiGLU, Gated, activation, swiglu_oai
from tandem.layers.linear import GGMLExperts, GGMLLinear
from tandem.layers.moe import GLUExperts, Routing
from tandem.quant.ggml_cpu import CPUKernels, GGMLWeight, mul_mat_supported, prepare_cpu_weight
from tandem.quant.ggml_tiled import TILED_ARITHMETIC, TiledQ6K, fma32, quantize_q8_k
from tandem.runtime.loader import WeightLoader
from tandem.synth.blocks import random_rows

ALL_TYPES = [
    Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4,
]  # fmt: skip

# Byte offsets of the f16 scale fields inside one block (ggml-common.h block layouts).
F16_SCALE_OFFSETS: dict[Q, tuple[int, ...]] = {
    Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
    Q.IQ4_NL: (0,), Q.IQ4_XS: (0,),
}  # fmt: skip

# The type ggml converts activations to for each weight type (ggml_type_traits_cpu.vec_dot_type).
VEC_DOT_TYPE: dict[Q, Q] = {
    Q.F32: Q.F32, Q.F16: Q.F16, Q.BF16: Q.BF16,
    Q.Q8_0: Q.Q8_0, Q.Q4_0: Q.Q8_0, Q.Q5_0: Q.Q8_0, Q.IQ4_NL: Q.Q8_0, Q.MXFP4: Q.Q8_0,
    Q.Q4_1: Q.Q8_1, Q.Q5_1: Q.Q8_1,
    Q.Q2_K: Q.Q8_K, Q.Q3_K: Q.Q8_K, Q.Q4_K: Q.Q8_K, Q.Q5_K: Q.Q8_K, Q.Q6_K: Q.Q8_K, Q.IQ4_XS: Q.Q8_K,
}  # fmt: skip

# Relative Frobenius tolerances, by vec_dot type (see the module docstring).
# F16: ggml's F16 dot product on this build also accumulates partly in f16 (measured ~7e-4).
# Q8_1: the block sum s = d * sum(q) is stored as f16, which the emulation leaves out (~3e-5).
TOL_EXACT = {Q.F32: 1e-6, Q.F16: 2e-3, Q.BF16: 5e-3, Q.Q8_0: 1.5e-2, Q.Q8_1: 1.5e-2, Q.Q8_K: 2e-2}
TOL_EMULATED = {Q.F32: 1e-6, Q.F16: 2e-3, Q.BF16: 1e-6, Q.Q8_0: 1e-5, Q.Q8_1: 1e-4, Q.Q8_K: 1e-5}


def random_weight_bytes(qtype: Q, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random raw GGUF bytes for `shape` whose scale fields are finite (random f16 / E8M0)."""
    n = int(np.prod(shape))
    if qtype == Q.F32:
        return rng.standard_normal(n).astype(np.float32).view(np.uint8)
    if qtype == Q.F16:
        return rng.standard_normal(n).astype(np.float16).view(np.uint8)
    if qtype == Q.BF16:
        bits = rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8)
    block, size = GGML_QUANT_SIZES[qtype]
    nb = n // block
    b = rng.integers(0, 256, (nb, size), dtype=np.uint8)
    if qtype == Q.MXFP4:
        b[:, 0] = rng.integers(120, 131, nb)  # E8M0 exponent: 2^-7 .. 2^3
    else:
        for off in F16_SCALE_OFFSETS[qtype]:
            scale = rng.uniform(0.5, 1.5, nb) * rng.choice([-1.0, 1.0], nb) * 0.01
            b[:, off : off + 2] = scale.astype(np.float16).view(np.uint8).reshape(nb, 2)
    return b.reshape(-1)


def dequant(w: GGMLWeight) -> torch.Tensor:
    rows = int(np.prod(w.shape[:-1]))
    return torch.from_numpy(dequantize(w.data.reshape(rows, -1), w.qtype).reshape(w.shape)).double()


def _q8_0_roundtrip(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q8_0 then dequantization (float32 arithmetic, rint as on x86/ARM SIMD)."""
    b = x.reshape(-1, 32).astype(np.float32)
    amax = np.abs(b).max(axis=1, keepdims=True)
    inv = np.float32(127) / np.where(amax > 0, amax, np.float32(1))
    q = np.rint(b * inv.astype(np.float32))
    d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    return (q * d).reshape(x.shape)


def _q8_k_roundtrip(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q8_K (signed max, iscale = -127/max, float32 d) then dequantization."""
    b = x.reshape(-1, 256).astype(np.float32)
    mx = b[np.arange(len(b)), np.abs(b).argmax(axis=1)][:, None]
    iscale = np.float32(-127) / np.where(mx != 0, mx, np.float32(1))
    q = np.minimum(np.float32(127), np.rint(iscale * b))
    return (q * (np.float32(1) / iscale)).reshape(x.shape)


def activation_as_ggml_sees_it(x: torch.Tensor, qtype: Q) -> torch.Tensor:
    vdt = VEC_DOT_TYPE[qtype]
    xn = x.numpy()
    if vdt == Q.F32:
        return x.double()
    if vdt == Q.F16:
        return torch.from_numpy(xn.astype(np.float16)).double()
    if vdt == Q.BF16:
        return x.bfloat16().double()
    if vdt in (Q.Q8_0, Q.Q8_1):
        return torch.from_numpy(_q8_0_roundtrip(xn)).double()
    return torch.from_numpy(_q8_k_roundtrip(xn)).double()


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


def check(y: torch.Tensor, x_ref_exact: torch.Tensor, x_ref_emulated: torch.Tensor, qtype: Q) -> None:
    """y against both references; x_ref_* are the products computed from exact / emulated x."""
    assert y.dtype == torch.float32 and torch.isfinite(y).all()
    vdt = VEC_DOT_TYPE[qtype]
    err = rel_err(y, x_ref_exact)
    assert err < TOL_EXACT[vdt], f"{qtype.name}: relative error {err:.2e} vs float64 reference"
    err = rel_err(y, x_ref_emulated)
    assert err < TOL_EMULATED[vdt], f"{qtype.name}: relative error {err:.2e} vs emulated activations"


@pytest.fixture(scope="module")
def kernels():
    k = CPUKernels(n_threads=2)
    yield k
    k.close()


def test_every_type_supported_and_vec_dot_types() -> None:
    for qtype in ALL_TYPES:
        assert mul_mat_supported(qtype), qtype.name
        assert ggml.ggml_get_type_traits_cpu(int(qtype)).contents.vec_dot_type == int(VEC_DOT_TYPE[qtype])


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_matmul_matches_reference(kernels: CPUKernels, qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    n, k = 64, 512
    w = GGMLWeight(random_weight_bytes(qtype, (n, k), rng), qtype, (n, k))
    wd = dequant(w)
    torch.manual_seed(int(qtype))
    for t in (1, 7, 40):
        x = torch.randn(t, k)
        y = kernels.matmul(x, w)
        assert y.shape == (t, n)
        check(y, x.double() @ wd.T, activation_as_ggml_sees_it(x, qtype) @ wd.T, qtype)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0, Q.Q5_1, Q.MXFP4, Q.F32], ids=lambda q: q.name)
def test_mul_mat_id_matches_per_token_reference(kernels: CPUKernels, qtype: Q) -> None:
    rng = np.random.default_rng(100 + int(qtype))
    e, n, k = 6, 32, 256
    data = random_weight_bytes(qtype, (e, n, k), rng)
    w = GGMLWeight(data, qtype, (e, n, k))
    wd = dequant(w)
    # The last expert is never selected: NaN scales there must not leak into any output.
    if qtype != Q.F32:
        last = data.reshape(e, -1)[e - 1].reshape(-1, GGML_QUANT_SIZES[qtype][1])
        if qtype == Q.MXFP4:
            last[:, 0] = 0xFF  # E8M0 NaN
        else:
            off = F16_SCALE_OFFSETS[qtype][0]
            last[:, off : off + 2] = np.array([np.nan], dtype=np.float16).view(np.uint8)
    torch.manual_seed(int(qtype))
    cases = [
        torch.tensor([[2, 0]]),  # T=1
        torch.tensor([[1, 3, 0], [3, 1, 4], [0, 0, 3], [4, 3, 1], [1, 1, 1]]),  # repeats across/within tokens
        torch.randint(0, e - 1, (9, 2), dtype=torch.int32),
    ]
    for ids in cases:
        t, a = ids.shape
        x = torch.randn(t, k)
        xe = activation_as_ggml_sees_it(x, qtype)
        y = kernels.mul_mat_id(x, w, ids)
        assert y.shape == (t, a, n)
        sel = wd[ids.long()]  # [T, A, N, K]
        check(y, torch.einsum("tk,tank->tan", x.double(), sel), torch.einsum("tk,tank->tan", xe, sel), qtype)
        # One activation per selected expert ([T, A, K]), as for a down projection.
        x3 = torch.randn(t, a, k)
        y3 = kernels.mul_mat_id(x3, w, ids)
        xe3 = activation_as_ggml_sees_it(x3, qtype)
        check(
            y3,
            torch.einsum("tak,tank->tan", x3.double(), sel),
            torch.einsum("tak,tank->tan", xe3, sel),
            qtype,
        )


def test_weight_read_in_place_from_a_memory_map(kernels: CPUKernels, tmp_path: Path) -> None:
    """Zero copy: the ggml tensor reads the memmap's bytes (an offset view, as in a GGUF file)."""
    rng = np.random.default_rng(6)
    raw = random_weight_bytes(Q.Q4_K, (16, 256), rng)
    path = tmp_path / "w.bin"
    path.write_bytes(b"\0" * 96 + raw.tobytes())
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    w = GGMLWeight(mm[96:], Q.Q4_K, (16, 256))
    assert w.ptr == mm.__array_interface__["data"][0] + 96
    x = torch.randn(3, 256)
    assert rel_err(kernels.matmul(x, w), x.double() @ dequant(w).T) < TOL_EXACT[Q.Q8_K]


def test_inputs_converted_and_out_filled(kernels: CPUKernels) -> None:
    rng = np.random.default_rng(1)
    w = GGMLWeight(random_weight_bytes(Q.F32, (16, 64), rng), Q.F32, (16, 64))
    wd = dequant(w)
    x = torch.randn(64, 3, dtype=torch.float64).T  # non-contiguous float64
    ref = x @ wd.T
    assert rel_err(kernels.matmul(x, w), ref) < 1e-6
    out = torch.full((3, 16), float("nan"))
    assert kernels.matmul(x, w, out=out) is out
    assert rel_err(out, ref) < 1e-6
    assert kernels.matmul(torch.empty(0, 64), w).shape == (0, 16)


def test_weight_swap_and_graph_cache_eviction(kernels: CPUKernels, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gcpu, "_MAX_CACHED_GRAPHS", 2)
    rng = np.random.default_rng(2)
    ws = [GGMLWeight(random_weight_bytes(Q.Q8_0, (8, 64), rng), Q.Q8_0, (8, 64)) for _ in range(2)]
    for t in (1, 2, 3, 4, 1):
        x = torch.randn(t, 64)
        for w in ws:  # same cached graph, different weight pointers
            assert rel_err(kernels.matmul(x, w), x.double() @ dequant(w).T) < TOL_EXACT[Q.Q8_0]
    assert len(kernels._graphs) <= 2


def test_concurrent_calls_are_serialized(kernels: CPUKernels) -> None:
    rng = np.random.default_rng(3)
    w = GGMLWeight(random_weight_bytes(Q.Q4_K, (32, 256), rng), Q.Q4_K, (32, 256))
    wd = dequant(w)
    xs = [torch.randn(t, 256) for t in (1, 3)]
    errors: list[float] = []

    def work(x: torch.Tensor) -> None:
        for _ in range(20):
            errors.append(rel_err(kernels.matmul(x, w), x.double() @ wd.T))

    threads = [threading.Thread(target=work, args=(x,)) for x in xs]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(errors) == 40 and max(errors) < TOL_EXACT[Q.Q8_K]


def test_bad_inputs_raise_instead_of_aborting(kernels: CPUKernels) -> None:
    rng = np.random.default_rng(4)
    data = random_weight_bytes(Q.Q8_0, (4, 8, 64), rng)
    w = GGMLWeight(data, Q.Q8_0, (4, 8, 64))
    with pytest.raises(ValueError, match="expert ids"):
        kernels.mul_mat_id(torch.randn(1, 64), w, torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match="expert ids"):
        kernels.mul_mat_id(torch.randn(1, 64), w, torch.tensor([[-1, 0]]))
    with pytest.raises(ValueError):
        kernels.mul_mat_id(torch.randn(2, 32), w, torch.tensor([[0], [1]]))
    with pytest.raises(ValueError):
        kernels.matmul(torch.randn(2, 64), w)  # stacked experts need mul_mat_id
    w2 = GGMLWeight(data[: 8 * 68], Q.Q8_0, (8, 64))
    with pytest.raises(ValueError):
        kernels.matmul(torch.randn(2, 32), w2)
    with pytest.raises(ValueError, match="bytes"):
        GGMLWeight(data[:100], Q.Q8_0, (8, 64))
    with pytest.raises(ValueError, match="multiple"):
        GGMLWeight(np.zeros(34 * 8, np.uint8), Q.Q8_0, (16, 17))


def test_close_is_idempotent() -> None:
    k = CPUKernels(1)
    w = GGMLWeight(random_weight_bytes(Q.F32, (4, 32), np.random.default_rng(5)), Q.F32, (4, 32))
    k.matmul(torch.randn(1, 32), w)
    k.close()
    k.close()
    with pytest.raises(RuntimeError):
        k.matmul(torch.randn(2, 32), w)


@dataclass
class _Unfused:
    """Experts that are not ggml's (as a GPU stack is to GLUExperts): the FFN then runs one product at a time
    with torch between them, on the same ggml products as the inner stack. Keeps its last input."""

    inner: GGMLExperts
    seen: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        self.seen = x
        return self.inner(x, ids)


def _experts(kernels: CPUKernels, qtype: Q, shape: tuple[int, int, int], bitgen: np.random.BitGenerator) -> GGMLExperts:
    """A stack of random valid blocks whose weights have a std of ~0.02 (so that the gated units see values
    of order 1 to 10, where they bend and clamp)."""
    return GGMLExperts(GGMLWeight(random_rows(qtype, shape[0] * shape[1], shape[2], bitgen), qtype, shape), kernels)


def _ffn_cases(kernels: CPUKernels) -> dict[str, GLUExperts]:
    """All-ggml GLUExperts of each family's shape."""
    bitgen = np.random.PCG64(21)
    e, f, k, d = 8, 256, 512, 384
    gate, up = (_experts(kernels, Q.Q4_K, (e, f, k), bitgen) for _ in "gu")
    oai_gate, oai_up = (_experts(kernels, Q.MXFP4, (e, f, k), bitgen) for _ in "gu")
    oai_down = _experts(kernels, Q.MXFP4, (e, d, f), bitgen)
    biases = {"gate_bias": torch.randn(e, f) * 2, "up_bias": torch.randn(e, f) * 2, "down_bias": torch.randn(e, d)}
    silu = Gated(ACTIVATIONS["silu"])
    return {
        # Qwen: separate gate and up stacks, SwiGLU
        "qwen": GLUExperts(gate=gate, up=up, down=_experts(kernels, Q.Q6_K, (e, d, f), bitgen), glu=silu),
        # Gemma 4 (a quantized file: ggml's table GELU): a fused gate_up stack, GEGLU, per-expert output scale
        "gemma4": GLUExperts(
            gate_up=_experts(kernels, Q.Q4_K, (e, 2 * f, k), bitgen),
            down=_experts(kernels, Q.Q8_0, (e, d, f), bitgen),
            glu=Gated(ACTIVATIONS["gelu_tanh_ggml"]),
            down_scale=torch.rand(e) + 0.5,
        ),
        # gpt-oss: gate, up and down biases, the clamped SwiGLU
        "gpt-oss": GLUExperts(gate=oai_gate, up=oai_up, down=oai_down, glu=swiglu_oai, **biases),
        # the same stacks with another clamp, or without biases: other graphs than the cached one
        "gpt-oss-limit-3": GLUExperts(gate=oai_gate, up=oai_up, down=oai_down, glu=ClampedSwiGLU(limit=3.0), **biases),
        "gpt-oss-no-bias": GLUExperts(gate=oai_gate, up=oai_up, down=oai_down, glu=swiglu_oai),
    }


def _quantization_step_effect(experts: GLUExperts, hidden: torch.Tensor, routing: Routing) -> float:
    """The most that one step of the down product's 8-bit input (amax/127 of its block) moves an output by:
    the step times the largest down weight, expert scale and mixing weight."""
    scale = 1.0 if experts.down_scale is None else float(experts.down_scale.max())
    assert isinstance(experts.down, GGMLExperts)
    w = float(dequant(experts.down.weight).abs().max())
    return float(hidden.abs().max()) / 127 * w * float(routing.weights.max()) * scale


def test_glu_names_its_ggml_op() -> None:
    """Each gated unit says which ggml op computes the same values (the tanh-formula GEGLU has none: ggml's
    reads its f16 GELU table), and still computes in torch as it did."""
    assert [Gated(activation(n)).ggml for n in ("silu", "gelu_tanh", "gelu_tanh_ggml")] == ["swiglu", None, "geglu"]
    assert Gated(torch.tanh).ggml is None and Gated(torch.tanh).ggml_params == ()
    assert (swiglu_oai.ggml, swiglu_oai.ggml_params) == ("swiglu_oai", (1.702, 7.0))
    gate, up = torch.randn(64) * 8, torch.randn(64) * 8
    torch.testing.assert_close(Gated(activation("silu"))(gate, up), torch.nn.functional.silu(gate) * up)
    g = gate.clamp(max=7.0)
    torch.testing.assert_close(swiglu_oai(gate, up), g * torch.sigmoid(1.702 * g) * (up.clamp(-7.0, 7.0) + 1))


def test_fused_expert_ffn_matches_the_products_and_torch_glue() -> None:
    """Every all-ggml GLUExperts runs as one ggml graph (products, biases, gated unit, scale, mixing) and gives
    what the separate ggml products with torch's glue give: Qwen, Gemma 4 and gpt-oss shapes, quantized
    stacks (Q4_K, Q6_K, Q8_0, MXFP4), 1 and 5 tokens, 1 and 4 active experts, the graphs of one CPUKernels
    cached side by side."""
    torch.manual_seed(21)
    rows, rows_rounded = 0, 0
    with CPUKernels(2) as kernels:
        cases = _ffn_cases(kernels)
        for t in (1, 5):
            for a in (1, 4):
                x = torch.randn(t, 512) * 4
                ids = torch.stack([torch.randperm(8)[:a] for _ in range(t)])
                routing = Routing(ids=ids, weights=torch.rand(t, a))
                for name, experts in cases.items():
                    assert experts._graph is not None, name
                    down = _Unfused(experts.down)
                    unfused = dataclasses.replace(experts, down=down)
                    assert unfused._graph is None
                    fused, ref = experts(x, routing), unfused(x, routing)
                    # Both paths run the same ggml products, so the down product quantizes (to Q8_K / Q8_0) the
                    # same hidden state, except where the gated unit's float32 exp differs from torch's in the
                    # last bit: then a hidden value, or a block's scale, moves by an ulp, which moves the outputs
                    # by ~1e-7 of their size, and exceptionally (for a value within an ulp of a rounding
                    # boundary) one quantized value by a step, amax/127 of its block, which moves its token's
                    # outputs by at most that step times the largest down weight, expert scale and mixing
                    # weight. Mixing and summing are the same float32 operations. Allowed: rounding, and two
                    # such steps in a token's outputs; and tokens off by more than rounding must be rare.
                    assert down.seen is not None
                    step = _quantization_step_effect(experts, down.seen, routing)
                    off = (fused - ref).abs().amax(dim=1)  # [T]
                    rounding = 1e-6 * ref.abs().max()
                    assert off.max() <= rounding + 2 * step, (name, t, a)
                    rows, rows_rounded = rows + t, rows_rounded + int((off <= rounding).sum())
    assert rows_rounded >= 0.9 * rows, (rows_rounded, rows)


def test_fused_expert_ffn_bind_matches_the_eager_call() -> None:
    """`bind` (decode's host op, see OffloadedExperts) prepares the graph on fixed buffers: each call computes
    exactly the eager call's sums from whatever the buffers hold. Experts that are not all ggml's, or whose
    gated unit ggml lacks, have nothing to bind (and run one product at a time)."""
    torch.manual_seed(22)
    with CPUKernels(2) as kernels:
        for name, experts in _ffn_cases(kernels).items():
            for t, a in ((1, 4), (5, 2)):
                xb, out = torch.empty(t, 512), torch.empty(t, 384)
                ib, wb = torch.empty(t, a, dtype=torch.int32), torch.empty(t, a)
                run = experts.bind(xb, Routing(ids=ib, weights=wb), out)
                assert run is not None, name
                for _ in range(3):
                    x, ids = torch.randn(t, 512) * 4, torch.stack([torch.randperm(8)[:a] for _ in range(t)])
                    mix = torch.rand(t, a)
                    xb.copy_(x)
                    ib.copy_(ids)
                    wb.copy_(mix)
                    run()
                    assert torch.equal(out, experts(x, Routing(ids=ids, weights=mix))), (name, t, a)
            unfused = dataclasses.replace(experts, down=_Unfused(experts.down))
            no_ggml_op = dataclasses.replace(experts, glu=Gated(ACTIVATIONS["gelu_tanh"]))
            assert unfused.bind(xb, Routing(ids=ib, weights=wb), out) is None
            assert no_ggml_op.bind(xb, Routing(ids=ib, weights=wb), out) is None


def test_glu_experts_need_gate_and_up_or_gate_up() -> None:
    """Two stacks or one fused stack, never both nor half of them; and vectors of the experts' sizes."""
    with CPUKernels(1) as kernels:
        cases = _ffn_cases(kernels)
        qwen, gemma = cases["qwen"], cases["gemma4"]
        with pytest.raises(ValueError, match="gate and up"):
            GLUExperts(down=qwen.down, glu=qwen.glu, gate=qwen.gate)
        with pytest.raises(ValueError, match="gate and up"):
            GLUExperts(down=gemma.down, glu=gemma.glu, gate=qwen.gate, up=qwen.up, gate_up=gemma.gate_up)
        with pytest.raises(ValueError, match="down_scale"):
            dataclasses.replace(gemma, down_scale=torch.ones(7))


# -- llama.cpp's CPU products: repacked weights and the tiled Q6_K kernel ---------------------------------

# The types ggml repacks on x86 with AVX2 (rows a multiple of 8); Q2_K needs AVX-512.
REPACKED_X86 = [Q.Q4_K, Q.Q4_0, Q.IQ4_NL, Q.MXFP4]


def repacked_or_skip(w: GGMLWeight) -> GGMLWeight:
    prepared = prepare_cpu_weight(w)
    if prepared.repacked is None:
        assert not ggml.ggml_cpu_has_avx2() or w.shape[0] % 8, f"ggml should repack {w.qtype.name} with AVX2"
        pytest.skip(f"ggml does not repack {w.qtype.name} on this CPU")
    return prepared


@pytest.mark.parametrize("qtype", REPACKED_X86, ids=lambda q: q.name)
def test_repacked_matmul_matches_plain_product(kernels: CPUKernels, qtype: Q) -> None:
    """ggml's interleaved gemm/gemv kernels on the repacked copy: the plain product up to float32 rounding
    (the same activation quantization, added in another order), for 1 row (gemv), 4 and 8 (gemm) and
    ragged counts (gemm, then gemv for the rest)."""
    rng = np.random.default_rng(200 + int(qtype))
    n, k = 64, 512
    w = GGMLWeight(random_weight_bytes(qtype, (n, k), rng), qtype, (n, k))
    prepared = repacked_or_skip(w)
    assert prepared.tiled is None and prepared.repacked.nbytes == w.data.nbytes
    wd = dequant(w)
    torch.manual_seed(int(qtype))
    for t in (1, 3, 4, 8, 13):
        x = torch.randn(t, k)
        y = kernels.matmul(x, prepared)
        assert rel_err(y, kernels.matmul(x, w).double()) < 1e-6, (qtype.name, t)
        check(y, x.double() @ wd.T, activation_as_ggml_sees_it(x, qtype) @ wd.T, qtype)


def test_ggml_decides_what_is_repacked() -> None:
    rng = np.random.default_rng(11)
    ragged = GGMLWeight(random_weight_bytes(Q.Q4_K, (60, 256), rng), Q.Q4_K, (60, 256))
    assert prepare_cpu_weight(ragged).repacked is None  # rows not a multiple of 8
    q8 = GGMLWeight(random_weight_bytes(Q.Q8_0, (64, 256), rng), Q.Q8_0, (64, 256))
    assert prepare_cpu_weight(q8) is q8  # no x86 repacking for Q8_0, no tiled kernel
    experts = GGMLWeight(random_weight_bytes(Q.Q4_K, (2, 64, 256), rng), Q.Q4_K, (2, 64, 256))
    assert prepare_cpu_weight(experts) is experts  # mul_mat_id weights stay in the memory map


def test_graph_cache_keeps_repacked_and_plain_apart(kernels: CPUKernels) -> None:
    rng = np.random.default_rng(12)
    w = GGMLWeight(random_weight_bytes(Q.Q4_K, (32, 512), rng), Q.Q4_K, (32, 512))
    prepared = repacked_or_skip(w)
    other = repacked_or_skip(GGMLWeight(random_weight_bytes(Q.Q4_K, (32, 512), rng), Q.Q4_K, (32, 512)))
    x = torch.randn(5, 512)
    first = {name: kernels.matmul(x, v) for name, v in (("plain", w), ("repacked", prepared), ("other", other))}
    for _ in range(2):  # alternating calls on the same shapes: each weight keeps its own result, bit for bit
        for name, v in (("repacked", prepared), ("plain", w), ("other", other)):
            assert torch.equal(kernels.matmul(x, v), first[name]), name
    assert not torch.equal(first["plain"], first["repacked"])  # the repacked kernels did run
    keys = [key for key in kernels._graphs if key[:5] == (0, int(Q.Q4_K), 32, 512, 5)]
    assert sorted(key[5] for key in keys) == [False, True]


def test_repacked_copy_lives_and_dies_with_its_weight(kernels: CPUKernels) -> None:
    rng = np.random.default_rng(13)
    prepared = repacked_or_skip(GGMLWeight(random_weight_bytes(Q.Q4_0, (16, 64), rng), Q.Q4_0, (16, 64)))
    copy = weakref.ref(prepared.repacked)
    linear = GGMLLinear(prepared, kernels)
    del prepared
    gc.collect()
    assert copy() is not None
    assert linear(torch.randn(2, 64)).shape == (2, 16)
    del linear
    gc.collect()
    assert copy() is None  # its finalizer freed the buffer and the context


def _loader(info: TensorInfo, compute_device: str) -> WeightLoader:
    plan = SimpleNamespace(device_of=lambda name: "cpu", compute_device=compute_device, staging_bytes=0)
    return WeightLoader(SimpleNamespace(tensors={info.name: info}), plan, CPUKernels(1))  # type: ignore[arg-type]


def test_loader_prepares_the_matrices_of_cpu_models_only() -> None:
    """A CPU model's matrices are held as llama.cpp's CPU backend holds them; a GPU model's CPU matrices
    (host linears) stay plain."""
    rng = np.random.default_rng(14)
    info = TensorInfo("blk.0.attn_output.weight", Q.Q4_K, (64, 256), random_weight_bytes(Q.Q4_K, (64, 256), rng), 0)
    on_cpu = _loader(info, "cpu").linear(info.name)
    assert isinstance(on_cpu, GGMLLinear)
    if ggml.ggml_cpu_has_avx2():
        assert on_cpu.weight.repacked is not None
    host = _loader(info, "cuda:0").linear(info.name)
    assert host.inner.weight.repacked is None and host.inner.weight.tiled is None  # type: ignore[attr-defined]


def q6_k_weight(shape: tuple[int, int], seed: int) -> GGMLWeight:
    from qblocks import random_blocks

    raw = random_blocks(Q.Q6_K, shape, np.random.default_rng(seed)).reshape(-1).copy()
    return GGMLWeight(raw, Q.Q6_K, shape)


def test_q6_k_unpacking_matches_gguf() -> None:
    w = q6_k_weight((24, 512), 15)
    codes, scales, d = gtiled._unpack_q6_k(torch.from_numpy(w.data).view(24, 2, 210))
    assert codes.shape == (2, 24, 256) and int(codes.min()) >= -32 and int(codes.max()) <= 31
    # gguf's dequantization: (d * scale) * (q - 32) in float32
    ours = (d[..., None] * scales.float()).repeat_interleave(16, -1) * codes.float()
    assert torch.equal(ours.transpose(0, 1).reshape(24, 512), dequant(w).float())


def test_quantize_q8_k_is_ggmls() -> None:
    torch.manual_seed(16)
    x = torch.randn(6, 1024) * torch.rand(6, 1) * 10
    x[0, :256] = 0  # an all-zero block: codes 0, d 0
    x[1, 3] = x[1, 7] = -x[1].abs().max() * 2  # equal magnitudes: the first one sets the sign
    x[1, 5] = -x[1, 3]
    codes, d = quantize_q8_k(x)
    assert torch.equal(codes.reshape(6, 1024) * d.repeat_interleave(256, -1),
                       torch.from_numpy(_q8_k_roundtrip(x.numpy())).reshape(6, 1024))  # fmt: skip
    assert float(d[0, 0]) == 0 and int(codes[1, 0, 3]) == -127 and int(codes[1, 0, 5]) == 127


def fma32_reference(a: float, b: float, c: float) -> np.float32:
    """a * b + c rounded once to float32 (nearest, ties to even), with exact rational arithmetic."""
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    near = np.float32(float(exact))
    candidates = [near, np.nextafter(near, np.float32(np.inf)), np.nextafter(near, np.float32(-np.inf))]
    return min(candidates, key=lambda v: (abs(Fraction(float(v)) - exact), int(np.array(v).view(np.int32)) & 1))


def test_fma32_rounds_once() -> None:
    """On sums whose float64 rounding lands halfway between two float32 values (where rounding twice
    goes wrong), on random ones, and on float32-subnormal ones."""
    torch.manual_seed(17)
    n = 400
    c = torch.randn(n)
    ulp = (torch.nextafter(c.abs(), torch.full_like(c, torch.inf)) - c.abs()).double()
    sign = torch.where(torch.rand(n) < 0.5, -1.0, 1.0).double()
    a = torch.cat([(ulp / 2 * (1 + 2.0**-23) * sign).float(), torch.randn(n), torch.randn(n) * 1e-20])
    b = torch.cat([(1 + sign * 2.0**-23).float(), torch.randn(n), torch.randn(n)])
    c = torch.cat([c, torch.randn(n), torch.randn(n) * 1e-38])
    ours = fma32(a, b, c)
    ref = [fma32_reference(float(x), float(y), float(z)) for x, y, z in zip(a, b, c, strict=True)]
    assert [np.float32(v) for v in ours.tolist()] == ref
    twice = (a.double() * b.double() + c.double()).float()
    assert sum(np.float32(v) != r for v, r in zip(twice.tolist(), ref, strict=True)) > n // 10  # the test bites


def tiled_reference(x: torch.Tensor, w: GGMLWeight, arithmetic: str) -> np.ndarray:
    """The tiled kernel's Q6_K arithmetic, step by step: exact integer block sums (int64), float(sum) * d_w
    in float32, then acc = fma(that, d_x, acc) block after block (or a float32 multiply and add)."""
    n, k = w.shape
    nb = k // 256
    blocks = w.data.reshape(n, nb, 210)
    unit = blocks.copy()  # the same blocks with d = 1 and every scale 1: dequantizing gives q - 32
    unit[:, :, 192:208] = 1
    unit[:, :, 208:210] = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
    q = dequantize(unit.reshape(-1), Q.Q6_K).reshape(n, nb, 16, 16).astype(np.int64)
    scales = blocks[:, :, 192:208].copy().view(np.int8).astype(np.int64)
    d_w = blocks[:, :, 208:210].copy().view(np.float16).astype(np.float32)[..., 0]
    weights = (q * scales[..., None]).reshape(n, nb, 256)
    xb = x.numpy().reshape(x.shape[0], nb, 256)
    peak = np.take_along_axis(xb, np.abs(xb).argmax(-1)[..., None], -1)
    iscale = np.float32(-127) / peak
    codes = np.minimum(127, np.rint(iscale * xb)).astype(np.int64)
    d_x = (np.float32(1) / iscale)[..., 0]
    sums = np.einsum("tbe,nbe->tnb", codes, weights)
    out = np.zeros((x.shape[0], n), dtype=np.float32)
    for t in range(x.shape[0]):
        for j in range(n):
            acc = np.float32(0)
            for b in range(nb):
                r = np.float32(np.float32(sums[t, j, b]) * d_w[j, b])
                if arithmetic == "fma":
                    acc = fma32_reference(float(r), float(d_x[t, b]), float(acc))
                else:
                    acc = np.float32(acc + np.float32(r * d_x[t, b]))
            out[t, j] = acc
    return out


@pytest.mark.parametrize("arithmetic", ["fma", "mul_add"])
def test_tiled_q6_k_product_is_the_kernels_arithmetic(arithmetic: str) -> None:
    """Bit for bit the step-by-step reference, and within the Q8_K activation rounding of the float64
    product (the kernel's only approximation)."""
    w = q6_k_weight((16, 768), 18)
    tiled = TiledQ6K(w.data, w.shape, arithmetic)
    torch.manual_seed(19)
    for t in (8, 11):
        x = torch.randn(t, 768)
        y = tiled.matmul(x)
        assert np.array_equal(y.numpy(), tiled_reference(x, w, arithmetic)), t
        check(y, x.double() @ dequant(w).T, activation_as_ggml_sees_it(x, Q.Q6_K) @ dequant(w).T, Q.Q6_K)


def test_tiled_q6_k_chunked_and_uncached_give_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    w = q6_k_weight((40, 1024), 20)
    x = torch.randn(9, 1024)
    cached = TiledQ6K(w.data, w.shape)
    y = cached.matmul(x)
    assert cached._parts is not None
    monkeypatch.setattr(gtiled, "CACHE_MAX_BYTES", 3000)  # rows unpacked per call, 2 at a time
    monkeypatch.setattr(gtiled, "CHUNK_BYTES", 20000)  # and one block per step
    uncached = TiledQ6K(w.data, w.shape)
    assert torch.equal(uncached.matmul(x), y)
    assert uncached._parts is None


@pytest.mark.skipif(TILED_ARITHMETIC is None, reason="llama.cpp's build on this CPU has no tiled kernel")
def test_tiled_product_from_8_rows_on_prepared_q6_k(kernels: CPUKernels) -> None:
    """A prepared Q6_K weight: ggml's plain product below 8 rows, the tiled kernel's from 8; both within
    float32 rounding of each other."""
    w = q6_k_weight((32, 512), 21)
    prepared = prepare_cpu_weight(w)
    assert prepared.tiled is not None and prepared.repacked is None
    torch.manual_seed(22)
    for t in (1, 7, 8, 30):
        x = torch.randn(t, 512)
        y = kernels.matmul(x, prepared)
        plain = kernels.matmul(x, w)
        if t < 8:
            assert torch.equal(y, plain)
        else:
            assert torch.equal(y, prepared.tiled.matmul(x))
            assert rel_err(y, plain.double()) < 1e-6
    out = torch.empty(8, 32)
    assert kernels.matmul(torch.randn(8, 512), prepared, out=out) is out


LLAMACPP_CPU = Path.home() / ".cache" / "tandem" / "peers" / "llama_cpp_cpu"


@pytest.mark.skipif(
    not (LLAMACPP_CPU / "llama_cpp" / "lib" / "libggml-cpu.so").exists(),
    reason="no llama.cpp CPU build to compare with (scripts/build_llamacpp.sh)",
)
def test_products_are_llamacpps_bit_for_bit(tmp_path: Path) -> None:
    """Against llama.cpp's own ggml on this machine (scripts/llamacpp_cpu_matmul.py): tandem repacks what
    llama.cpp repacks, and its repacked, tiled Q6_K and plain products give llama.cpp's bits."""
    report = tmp_path / "cases.json"
    script = Path(__file__).parent.parent / "scripts" / "llamacpp_cpu_matmul.py"
    run = subprocess.run([sys.executable, str(script), "--lib", str(LLAMACPP_CPU), "--json", str(report)],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    cases = json.loads(report.read_text())
    same = [case for case in cases if case["differing"] == 0]
    assert all(case["repacked"] == case["llamacpp_repacked"] for case in cases)
    if TILED_ARITHMETIC is not None:
        assert sum(case["tiled"] for case in same) >= 8
    if ggml.ggml_cpu_has_avx2():
        assert sum(case["repacked"] for case in same) >= 15


def test_fused_geglu_matches_two_products_and_the_gelu_table(kernels: CPUKernels) -> None:
    """`geglu`: the two products and ggml's GEGLU in one graph, bit for bit the separate products times the
    f16-table GELU; plain (Q5_0) and repacked (Q4_K) weights, the cached graph serving both pairs in turn."""
    rng = np.random.default_rng(13)
    gelu = ACTIVATIONS["gelu_tanh_ggml"]
    pairs = []
    for qtype in (Q.Q5_0, Q.Q4_K):
        ws = [prepare_cpu_weight(GGMLWeight(random_weight_bytes(qtype, (64, 512), rng), qtype, (64, 512)))
              for _ in range(2)]  # fmt: skip
        pairs += [ws, ws[::-1]]
    torch.manual_seed(13)
    for t in (1, 3):
        x = torch.randn(t, 512) * 4
        for gate, up in pairs * 2:
            assert torch.equal(kernels.geglu(x, gate, up), gelu(kernels.matmul(x, gate)) * kernels.matmul(x, up))
    with pytest.raises(ValueError):
        kernels.geglu(torch.randn(gtiled.TILED_MIN_ROWS, 512), *pairs[0])


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("scale", [0.0625, 0.1])  # scaled queries (a power of two) or scaled scores
def test_decode_attention_graph_matches_the_emulation(window: int | None, scale: float) -> None:
    """One query row over an f16 cache: ggml's attention nodes (`ggml_attention_row`) give the lane-ordered
    emulation's results bit for bit, with grouped KV heads, a sliding window and ragged key counts."""
    from tandem.layers.attention import AttentionShape, _attend_ggml, attend

    shape = AttentionShape(n_heads=4, n_kv_heads=2, head_dim=128, value_dim=64, scale=scale, sliding_window=window)
    torch.manual_seed(14)
    for n_keys in (1, 13, 64, 100):
        q = torch.randn(1, 4, 128) * 3
        keys, values = torch.randn(n_keys, 2, 128).half(), torch.randn(n_keys, 2, 64).half()
        position = torch.tensor([n_keys - 1])
        distance = position.unsqueeze(1) - torch.arange(n_keys).unsqueeze(0)
        allowed = (distance >= 0) & (distance < (window or n_keys + 1))
        emulated = _attend_ggml(q, keys, values, allowed, shape, None)
        assert torch.equal(attend(q, keys, values, position, shape), emulated), n_keys
