"""How tandem holds a CPU model's matrices as llama.cpp's CPU backend does (tandem.quant.ggml_weights):
copies repacked where ggml repacks the type, and their products against the plain ones, emulations and llama.cpp's
own ggml; ggml's tiled K-quant product for 8 rows or more against its arithmetic, step by step."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import weakref
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import ggml
import numpy as np
import pytest
import torch
from ggml_reference import activation_as_ggml_sees_it, check, dequant, rel_err
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from qblocks import random_weight_bytes

from tandem.gguf.reader import TensorInfo
from tandem.layers.linear import GGMLLinear
from tandem.quant.ggml_cpu import CPUKernels
from tandem.quant.ggml_weights import GGMLWeight, prepare_cpu_weight
from tandem.weights.loader import WeightLoader

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
    assert prepared.repacked.nbytes == w.data.nbytes
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


def test_amx_by_default_where_it_runs(kernels: CPUKernels, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Q4_K matrix goes into ggml's AMX buffer, as llama.cpp's build holds it, only where this build has the buffer
    type (a CPU with AMX) and a child process's AMX product ran and matched (a machine that advertises AMX and
    faults on its first tile instruction: the child dies, this process goes on with CPU_REPACK); TANDEM_AMX=0 never
    takes it, TANDEM_AMX=1 says in a notice when it cannot."""
    import tandem.quant.ggml_weights as gw

    rng = np.random.default_rng(14)
    w = GGMLWeight(random_weight_bytes(Q.Q4_K, (64, 512), rng), Q.Q4_K, (64, 512))
    x = torch.randn(64, 512)
    plain = kernels.matmul(x, w).double()
    try:
        monkeypatch.setenv(gw.AMX_ENV, "0")
        gw.amx_usable.cache_clear()
        assert not gw.amx_usable() and gw.amx_notice() == ""
        assert repacked_or_skip(w).repacked.kind == "CPU_REPACK"
        found = []
        for setting in (None, "1"):
            if setting is None:
                monkeypatch.delenv(gw.AMX_ENV)
            else:
                monkeypatch.setenv(gw.AMX_ENV, setting)
            gw.amx_usable.cache_clear()
            found.append(usable := gw.amx_usable())
            prepared = repacked_or_skip(w)
            err = rel_err(kernels.matmul(x, prepared), plain)
            if usable:  # AMX's own rounding of the activations: within the child's acceptance bound
                assert prepared.repacked.kind == "AMX" and gw.amx_notice() == "" and err < 1e-3
                continue
            assert prepared.repacked.kind == "CPU_REPACK" and err < 1e-6
            if setting is None:
                assert gw.amx_notice() == ""  # not asked for: nothing to say
            else:
                assert gw.AMX_ENV in gw.amx_notice()
                if "AMX" in gw._extra_buffer_types():  # the child ran (and died or disagreed), not this process
                    assert "child process" in gw.amx_notice()
        assert found[0] == found[1]  # the default takes it wherever asking for it would
        assert found[0] or "AMX" not in gw._extra_buffer_types() or "child process" in gw.amx_notice()
    finally:
        monkeypatch.delenv(gw.AMX_ENV, raising=False)
        gw.amx_usable.cache_clear()


def _loader(info: TensorInfo, compute_device: str) -> WeightLoader:
    plan = SimpleNamespace(
        device_of=lambda name: "cpu", compute_device=compute_device, staging_bytes=0, devices={info.name: "cpu"}
    )
    return WeightLoader(SimpleNamespace(tensors={info.name: info}), plan, CPUKernels(1))  # type: ignore[arg-type]


def test_an_embedding_table_in_host_ram_is_looked_up_by_ggml() -> None:
    """The token embedding of a table the plan keeps in host RAM (always on the CPU; llama.cpp's choice with a
    GPU too) is ggml's row lookup, with tandem's decoding's values."""
    from tandem.quant.dequant import dequantize_rows

    rng = np.random.default_rng(15)
    data = random_weight_bytes(Q.Q4_K, (32, 256), rng)
    info = TensorInfo("token_embd.weight", Q.Q4_K, (32, 256), data, 0)
    embedding = _loader(info, "cpu").embedding(info.name)
    assert embedding.kernels is not None
    ids = torch.tensor([[3, 31], [0, 3]])
    want = dequantize_rows(torch.from_numpy(data), Q.Q4_K, (32, 256), ids)
    assert torch.equal(embedding(ids), want)


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
    assert host.inner.weight.repacked is None  # type: ignore[attr-defined]


def q6_k_weight(shape: tuple[int, int], seed: int) -> GGMLWeight:
    from qblocks import random_blocks

    raw = random_blocks(Q.Q6_K, shape, np.random.default_rng(seed)).reshape(-1).copy()
    return GGMLWeight(raw, Q.Q6_K, shape)


def fma32_reference(a: float, b: float, c: float) -> np.float32:
    """a * b + c rounded once to float32 (nearest, ties to even), with exact rational arithmetic."""
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    near = np.float32(float(exact))
    candidates = [near, np.nextafter(near, np.float32(np.inf)), np.nextafter(near, np.float32(-np.inf))]
    return min(candidates, key=lambda v: (abs(Fraction(float(v)) - exact), int(np.array(v).view(np.int32)) & 1))


# How llama.cpp's x86 build runs the tiled kernel's float steps (tiled.cpp: on with AVX unless GGML_CPU_TILED_MM=0).
TILED_ARITHMETIC = None if not ggml.ggml_cpu_has_avx() else "fma" if ggml.ggml_cpu_has_fma() else "mul_add"


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
    zero = peak == 0  # quantize_row_q8_K: a block of zeros gets codes 0 and d 0
    iscale = np.float32(-127) / np.where(zero, np.float32(1), peak)
    codes = np.where(zero, 0, np.minimum(127, np.rint(iscale * xb))).astype(np.int64)
    d_x = np.where(zero, np.float32(0), np.float32(1) / iscale)[..., 0]
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


@pytest.mark.skipif(TILED_ARITHMETIC is None, reason="llama.cpp's build on this CPU has no tiled kernel")
def test_q6_k_products_from_8_rows_are_the_tiled_kernels(kernels: CPUKernels) -> None:
    """tandem's ggml is llama.cpp's: a Q6_K product of 8 rows or more is its tiled kernel's arithmetic bit for bit
    (and within the Q8_K activation rounding of the float64 product), fewer rows its dot product's, within float32
    rounding of the tiled one."""
    w = q6_k_weight((32, 768), 18)
    prepared = prepare_cpu_weight(w)
    assert prepared.repacked is None  # no x86 repacking for Q6_K
    torch.manual_seed(19)
    x = torch.randn(30, 768) * torch.logspace(-2, 2, 768)
    x[9] = 0.0  # a row of zeros, and a block of zeros in another
    x[12, 256:512] = 0.0
    for t in (8, 11, 30):
        y = kernels.matmul(x[:t], prepared)
        assert np.array_equal(y.numpy(), tiled_reference(x[:t], w, TILED_ARITHMETIC)), t
        check(y, x[:t].double() @ dequant(w).T, activation_as_ggml_sees_it(x[:t], Q.Q6_K) @ dequant(w).T, Q.Q6_K)
    for t in (1, 7):
        y = kernels.matmul(x[:t], prepared)
        assert rel_err(y, torch.from_numpy(tiled_reference(x[:t], w, TILED_ARITHMETIC)).double()) < 1e-6
    out = torch.empty(8, 32)
    assert kernels.matmul(x[:8], prepared, out=out) is out


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
