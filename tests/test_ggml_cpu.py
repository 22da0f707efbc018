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

import threading
from pathlib import Path

import ggml
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

import tandem.quant.ggml_cpu as gc
from tandem.quant.ggml_cpu import CPUKernels, GGMLWeight, mul_mat_supported

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
    monkeypatch.setattr(gc, "_MAX_CACHED_GRAPHS", 2)
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


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_fused_gated_experts_match_three_products(act: str) -> None:
    """The one-graph expert FFN gives what the three separate products and torch's glue give."""
    from qblocks import random_blocks

    from tandem.layers.activations import ACTIVATIONS
    from tandem.layers.linear import GGMLExperts
    from tandem.layers.moe import GatedExperts, Routing

    rng = np.random.default_rng(7)
    e, f, k, d = 6, 256, 256, 512
    weights = [GGMLWeight(random_blocks(Q.Q4_K, (e, f, k), rng).reshape(-1).copy(), Q.Q4_K, (e, f, k)) for _ in "gu"]
    down_shape = (e, d, f)
    down = GGMLWeight(
        random_blocks(Q.Q6_K, down_shape, rng).reshape(-1).copy(),
        Q.Q6_K,
        down_shape,
    )
    with CPUKernels(2) as kernels:
        experts = GatedExperts(*(GGMLExperts(w, kernels) for w in (*weights, down)), act=ACTIVATIONS[act])
        for t in (1, 4):
            x = torch.randn(t, k)
            ids = torch.stack([torch.randperm(e)[:3] for _ in range(t)])
            mix = torch.rand(t, 3)
            fused = experts(x, Routing(ids=ids, weights=mix))
            hidden = experts.act(experts.gate(x, ids)) * experts.up(x, ids)
            ref = (experts.down(hidden, ids) * mix.unsqueeze(-1)).sum(1)
            # ggml quantizes the hidden state to Q8_K for the down product either way; the GLU differs
            # only in rounding (ggml's GELU table), so the sums agree to a few 1e-3 of their scale.
            assert (fused - ref).abs().max() <= 5e-3 * ref.abs().max(), (act, t)
            # The prepared form on fixed buffers (decode's host op) computes exactly the same sums, call
            # after call, from whatever the buffers hold.
            out = torch.empty(t, d)
            xb, ib, wb = torch.empty(t, k), torch.empty(t, 3, dtype=torch.int32), torch.empty(t, 3)
            run = experts.bind(xb, Routing(ids=ib, weights=wb), out)
            assert run is not None
            for _ in range(2):
                xb.copy_(x)
                ib.copy_(ids)
                wb.copy_(mix)
                run()
                assert torch.equal(out, fused), (act, t)
                x, ids = torch.randn(t, k), torch.stack([torch.randperm(e)[:3] for _ in range(t)])
                fused = experts(x, Routing(ids=ids, weights=mix))
