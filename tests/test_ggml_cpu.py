"""ggml CPU products on quantized GGUF blocks against float64 references (tests/ggml_reference.py: an exact
and an emulated one per case), the fused expert FFN graph, ggml's own attention and elementwise ops."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from pathlib import Path

import ggml
import numpy as np
import pytest
import torch
from ggml_reference import TOL_EXACT, VEC_DOT_TYPE, activation_as_ggml_sees_it, check, dequant, rel_err
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from qblocks import F16_FIELDS, random_weight_bytes

import tandem.quant.ggml_cpu as gcpu
from tandem.layers.activations import ACTIVATIONS, ClampedSwiGLU, Gated, activation, swiglu_oai
from tandem.layers.linear import GGMLExperts
from tandem.layers.moe import GLUExperts, Routing
from tandem.quant.ggml_cpu import CPUKernels
from tandem.quant.ggml_weights import GGMLWeight, mul_mat_supported, prepare_cpu_weight
from tandem.synth.blocks import random_rows

ALL_TYPES = [
    Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4,
]  # fmt: skip


def test_ggml_is_built_as_llama_cpp_builds_it(kernels: CPUKernels) -> None:
    """llamafile's batched kernels are on (the Makefile's CMAKE_ARGS), as in llama.cpp's ggml: products of several
    rows by a float weight sum in their order there. For the quantized types they give the one-row kernels'
    results, bit for bit."""
    assert ggml.ggml_cpu_has_llamafile()
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.standard_normal((8, 256)).astype(np.float32))
    for qtype in (Q.Q8_0, Q.Q4_0, Q.Q5_0):
        w = GGMLWeight(random_weight_bytes(qtype, (64, 256), rng), qtype, (64, 256))
        one_by_one = torch.cat([kernels.matmul(x[i : i + 1], w) for i in range(x.shape[0])])
        assert torch.equal(kernels.matmul(x, w), one_by_one), qtype.name


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


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_get_rows_equals_tandems_own_decoding(kernels: CPUKernels, qtype: Q) -> None:
    """ggml's row lookup (the token embedding of a table in host RAM) gives tandem's dequantization of those
    rows bit for bit, repeated and out-of-order ids included; ids outside the table are refused, not fatal."""
    from tandem.quant.dequant import dequantize_rows
    from tandem.quant.ggml_weights import lookup_supported

    rng = np.random.default_rng(300 + int(qtype))
    n, k = 64, 512
    w = GGMLWeight(random_weight_bytes(qtype, (n, k), rng), qtype, (n, k))
    assert lookup_supported(qtype)
    for rows in ([5], [63, 0, 17, 17], list(range(n))):
        ids = torch.tensor(rows)
        want = dequantize_rows(torch.from_numpy(w.data), qtype, (n, k), ids)
        assert torch.equal(kernels.get_rows(w, ids), want), (qtype.name, rows)
    assert kernels.get_rows(w, torch.tensor([], dtype=torch.long)).shape == (0, k)
    with pytest.raises(ValueError, match="row ids must be in"):
        kernels.get_rows(w, torch.tensor([n]))


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
            off = F16_FIELDS[qtype][0]
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


def test_one_cached_graph_serves_buffers_bound_side_by_side() -> None:
    """Layers of one shape share a cached graph, re-pointed at each caller's buffers per call: every node must read
    the buffers of the call (a view made of an input when the graph was built would keep its first address, and
    the eager call, on the same graph, would repeat the error: the products with torch's glue are the reference)."""
    torch.manual_seed(23)
    with CPUKernels(2) as kernels:
        for name, experts in _ffn_cases(kernels).items():
            t, a = 5, 2
            bound = []
            for _ in range(2):  # two layers' buffers, alive together
                xb, out = torch.randn(t, 512) * 4, torch.empty(t, 384)
                ids = torch.stack([torch.randperm(8)[:a] for _ in range(t)]).to(torch.int32)
                routing = Routing(ids=ids, weights=torch.rand(t, a))
                run = experts.bind(xb, routing, out)
                assert run is not None, name
                bound.append((run, xb, routing, out))
            for run, xb, routing, out in bound + bound[::-1]:
                run()
                down = _Unfused(experts.down)
                ref = dataclasses.replace(experts, down=down)(xb, routing)
                assert down.seen is not None
                step = _quantization_step_effect(experts, down.seen, routing)
                assert (out - ref).abs().max() <= 1e-6 * ref.abs().max() + 2 * step, name


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
        kernels.geglu(torch.randn(0, 512), *pairs[0])


@pytest.mark.parametrize("rows", [1, 7, 40, 150])  # decoding; prefill (tinyBLAS's 16 lanes), 150: two chunks
@pytest.mark.parametrize("window", [None, 40])
# scaled queries (Gemma 3's graph; its 27B's scale is no power of two) or scaled scores (the other families)
@pytest.mark.parametrize(("scale", "scale_queries"), [(0.0625, True), (0.1, True), (0.1, False)])
@pytest.mark.parametrize("with_sinks", [False, True])  # gpt-oss: a sink logit per head
def test_attention_graph_matches_the_emulation(
    rows: int, window: int | None, scale: float, scale_queries: bool, with_sinks: bool
) -> None:
    """Query rows over an f16 cache: ggml's attention nodes (`ggml_attention`) give the lane-ordered emulation's
    results bit for bit, with grouped KV heads, a sliding window, ragged key counts and sinks, for one row (the
    decode step) and for several (prefill: the last rows of the keys' positions), also where a window leaves
    the first runs of 64 keys out of the product."""
    from tandem.layers.attention import AttentionShape, _attend_ggml, attend

    shape = AttentionShape(n_heads=4, n_kv_heads=2, head_dim=128, value_dim=64, scale=scale, sliding_window=window,
                           scale_queries=scale_queries)  # fmt: skip
    torch.manual_seed(14)
    # sinks around the scores' size, one far above them (its head's probabilities are then all tiny)
    sinks = torch.tensor([0.5, -2.0, 3.0, 40.0]) if with_sinks else None
    for n_keys in (rows, rows + 13, 64 + rows, 100 + rows, 300 + rows):  # the last: a window past 64 keys
        q = torch.randn(rows, 4, 128) * 3
        keys, values = torch.randn(n_keys, 2, 128).half(), torch.randn(n_keys, 2, 64).half()
        position = torch.arange(n_keys - rows, n_keys)
        distance = position.unsqueeze(1) - torch.arange(n_keys).unsqueeze(0)
        allowed = (distance >= 0) & (distance < (window or n_keys + 1))
        emulated = _attend_ggml(q, keys, values, allowed, shape, sinks)
        assert torch.equal(attend(q, keys, values, position, shape, sinks), emulated), n_keys
        if with_sinks:  # the sinks take part: without them the values differ
            assert not torch.equal(attend(q, keys, values, position, shape), emulated)


@pytest.mark.parametrize("rows", [1, 7, 40])
@pytest.mark.parametrize(("head_dim", "value_dim"), [(40, 24), (72, 72), (80, 64), (256, 256)])
def test_head_sizes_off_the_vector_width_match_the_emulation(rows: int, head_dim: int, value_dim: int) -> None:
    """Head sizes that are no multiple of 16 end each dot product in ggml_vec_dot_f16's scalar tail (summed in
    double) or leave tinyBLAS: llama.cpp's f16 nodes give the emulation's values there too, so the CPU step graphs
    cover these models."""
    from tandem.layers.attention import AttentionShape, _attend_ggml, attend

    shape = AttentionShape(n_heads=4, n_kv_heads=2, head_dim=head_dim, value_dim=value_dim, scale=0.1,
                           sliding_window=None)  # fmt: skip
    torch.manual_seed(3)
    for n_keys in (rows, rows + 13, 64 + rows, 300 + rows):
        q = torch.randn(rows, 4, head_dim) * 3
        keys, values = torch.randn(n_keys, 2, head_dim).half(), torch.randn(n_keys, 2, value_dim).half()
        position = torch.arange(n_keys - rows, n_keys)
        allowed = position.unsqueeze(1) >= torch.arange(n_keys).unsqueeze(0)
        emulated = _attend_ggml(q, keys, values, allowed, shape, None)
        assert torch.equal(attend(q, keys, values, position, shape), emulated), n_keys


def test_an_older_ggml_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """ggml-python's own ggml (0.15.3) lacks llama.cpp's tiled K-quant kernel: its products would not be llama.cpp's,
    so CPU kernels refuse to start on it, naming the script that builds the right one; this build is accepted."""
    from tandem.errors import InstallationError

    assert tuple(int(p) for p in ggml.ggml_version().decode().split(".")[:2]) >= gcpu.GGML_MIN_VERSION
    monkeypatch.setattr(gcpu.ggml, "ggml_version", lambda: b"0.15.3")
    with pytest.raises(InstallationError, match=r"ggml 0\.15\.3.*scripts/build_ggml_python\.sh") as refused:
        CPUKernels(1)
    assert "\n" not in str(refused.value)
