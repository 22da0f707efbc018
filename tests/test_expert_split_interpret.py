"""The expert cache's split on the CPU (issue 21): each step's routing split between the experts cached in VRAM and
the rest (the kernel against the torch form), products that skip a split's other slots, and a layer of every MoE
family computed split -- cached experts by the GPU kernels (run by Triton's interpreter on the host blocks), the
rest by ggml, in decode and in prefill -- against ggml alone. The GPU test (test_gpu_expert_cache.py) runs the
whole model on the device."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # on a GPU machine (pytest -m gpu collects this module too) the kernels compile
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from loader_builds import record_builds
from qblocks import random_blocks

pytest.importorskip("triton", reason="triton is a dev dependency (pip install -e '.[dev]')")
if os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available():
    pytest.skip(
        "the interpreter run is for machines without a GPU; see tests/test_gpu_expert_cache.py", allow_module_level=True
    )

import tandem
from tandem.convert import convert_hf
from tandem.cuda.qlinear import GPUQuantWeight, qmatmul_id
from tandem.cuda.routing import split_route
from tandem.layers.moe import GLUExperts, Routing, RoutingCounts, split_routing, split_streamed
from tandem.placement import expert_layer
from tandem.weights.loader import _PCIeSource
from tandem.weights.offload import OffloadedExperts


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


def _routing(t: int, e: int, a: int, seed: int) -> Routing:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:a] for _ in range(t)]).to(torch.int32)
    weights = torch.softmax(torch.randn(t, a, generator=g), dim=-1)
    return Routing(ids, weights)


def _slot_map(e: int, cached: list[int]) -> torch.Tensor:
    m = torch.full((e,), -1, dtype=torch.int32)
    m[cached] = torch.arange(len(cached), dtype=torch.int32)
    return m


@pytest.mark.parametrize("pcie", [0, 3])
def test_split_kernel_equals_torch_split(pcie: int) -> None:
    """split_route (one program per token) gives split_routing's torch form exactly, and the parts add up to the
    routing: every slot in exactly one part with its weight, ggml's packed in order with weight-0 fillers."""
    e, a = 64, 8
    for t, cached in ((1, [3, 7, 9]), (5, list(range(0, 64, 3))), (9, []), (4, list(range(64)))):
        r = _routing(t, e, a, seed=t + pcie)
        slot_map = _slot_map(e, cached)
        ref = split_routing(r, slot_map, pcie)
        (ri, rw), (ci, cw), n, pc = split_route(r.ids, r.weights, slot_map, pcie)
        assert torch.equal(ri, ref.resident.ids) and torch.equal(rw, ref.resident.weights)
        assert torch.equal(ci, ref.cpu.ids) and torch.equal(cw, ref.cpu.weights) and torch.equal(n, ref.cpu_counts)
        assert (pc is None) == (ref.pcie is None) == (pcie == 0)
        if pc is not None and ref.pcie is not None:
            assert torch.equal(pc[0], ref.pcie.ids) and torch.equal(pc[1], ref.pcie.weights)
        for row in range(t):
            ids, w = r.ids[row].tolist(), r.weights[row]
            in_cache = [i for i in ids if i in cached]
            n_other = a - len(in_cache)
            assert n[row].item() == n_other - pcie * n_other // a
            slots = ref.resident.ids[row]
            assert sorted(slots[slots >= 0].tolist()) == sorted(slot_map[in_cache].tolist())
            cpu_ids = ref.cpu.ids[row, : n[row]].tolist()
            others = [i for i in ids if i not in cached]
            assert cpu_ids == others[: len(cpu_ids)]  # in order, the first ones
            total = ref.resident.weights[row].sum() + ref.cpu.weights[row].sum()
            if ref.pcie is not None:
                total += ref.pcie.weights[row].sum()
            assert torch.allclose(total, w.sum())


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_K], ids=str)
def test_products_skip_the_other_parts_slots(qtype: gguf.GGMLQuantizationType) -> None:
    """ids -1 give rows of zeros (the one-row kernel of decode and the grouped one), the other rows as before."""
    rng = np.random.default_rng(3)
    e, n, k = 6, 32, 256
    w = GPUQuantWeight(torch.from_numpy(random_blocks(qtype, (e, n, k), rng).reshape(-1).copy()), qtype, (e, n, k))
    for t, a in ((1, 4), (3, 4), (12, 4)):  # 4 and 12 slots: one-row kernel; 48: grouped
        ids = torch.from_numpy(rng.integers(0, e, size=(t, a))).to(torch.int32)
        x = torch.randn(t, k)
        full = qmatmul_id(x, w, ids, ieee=True)
        holes = ids.clone()
        holes[:, ::2] = -1
        part = qmatmul_id(x, w, holes, ieee=True, skips=True)
        assert torch.equal(part[:, ::2], torch.zeros_like(part[:, ::2]))
        assert torch.allclose(part[:, 1::2], full[:, 1::2], rtol=1e-5, atol=1e-5)


class _Host:
    """Stands in for a HostCall without CUDA: the op's prepared function on plain buffers (or its fn)."""

    def __init__(self, fn: Callable[[list[torch.Tensor]], torch.Tensor], bind: Callable | None) -> None:  # type: ignore[type-arg]
        self.fn, self.bind, self.bound_calls = fn, bind, 0

    def start(self, inputs: list[torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype):  # type: ignore[no-untyped-def]
        xs = [x.contiguous().clone() for x in inputs]
        out = torch.zeros(xs[0].shape[0], shape[-1])
        run = self.bind(xs, out) if self.bind is not None else None
        if run is not None:
            out.fill_(float("nan"))  # the prepared run must write every value
            run()
            self.bound_calls += 1
        else:
            out = self.fn(xs).reshape(out.shape)
        return lambda: out.view(shape).to(dtype)


@pytest.mark.parametrize(
    "fixture", ["tiny_qwen3moe_gguf", "tiny_qwen35moe_gguf", "tiny_gemma4_gguf", "tiny_gpt_oss_gguf"]
)
def test_split_layer_equals_ggml_alone(
    fixture: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each layer with some experts cached (built by the loader over copies of their rows, giving ggml's values)
    and the rest left to ggml: decode batches (the packed host op, prepared and not) and prefill (cached experts
    from their copies, the others over the host blocks as streaming reads them) equal ggml alone to f32 rounding;
    with --pcie-experts the others split once more."""
    import tandem.cuda.host_memory as host_memory

    path = convert_hf(request.getfixturevalue(fixture)[0], tmp_path / "q8_0.gguf", "q8_0")
    builds = record_builds(monkeypatch)
    monkeypatch.setattr(host_memory, "device_view", lambda host, device: host)
    with tandem.LLM(path, device="cpu", n_ctx=32):
        assert builds
        for loader, layer, build in builds:
            infos = [i for n, i in loader.file.tensors.items() if expert_layer(n) == layer]
            n_experts = infos[0].shape[0]
            on_cpu = build(loader)
            assert isinstance(on_cpu, GLUExperts)
            width = on_cpu.down.weight.shape[1]  # type: ignore[attr-defined]
            cached_ids = tuple(range(1, n_experts, 2))
            resident, slot_map = loader._cached_experts(layer, build, cached_ids, infos, ggml_values=True)
            rest = loader._ggml_valued(build(_PCIeSource(loader, skips=True)))  # host blocks, read by GPU kernels
            for pcie in (0, 1):
                split = OffloadedExperts(
                    on_cpu=on_cpu, streamed=rest, stage_vectors=None, min_batch=16, resident=resident,
                    slot_map=slot_map, pcie=rest if pcie else None, pcie_slots=pcie,
                )  # fmt: skip
                for prepared in (True, False):
                    split.host = _Host(split.host.fn, split.host.bind if prepared else None)  # type: ignore[assignment]
                    for t in (1, 3, 20):  # decode, a batch, a prefill (streams from min_batch = 16 rows)
                        gen = torch.Generator().manual_seed(t + layer)
                        x = torch.randn(t, width, generator=gen)
                        r = _routing(t, n_experts, 2, seed=t * 7 + layer)
                        alone = on_cpu(x, r)
                        assert _rel(split(x, r), alone) < 1e-5, (layer, t, pcie, prepared)
                    if prepared:
                        assert split.host.bound_calls > 0  # type: ignore[attr-defined]
            cached, streamed = split_streamed(_routing(5, n_experts, 2, 1), slot_map)
            assert ((cached.ids >= 0) != (streamed.ids >= 0)).all()  # each slot on one side only


def test_a_step_of_only_cached_experts_leaves_ggml_idle(
    tiny_qwen3moe_gguf: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = convert_hf(tiny_qwen3moe_gguf[0], tmp_path / "q8_0.gguf", "q8_0")
    builds = record_builds(monkeypatch)
    with tandem.LLM(path, device="cpu", n_ctx=32):
        loader, layer, build = builds[0]
        infos = [i for n, i in loader.file.tensors.items() if expert_layer(n) == layer]
        on_cpu = build(loader)
        resident, slot_map = loader._cached_experts(layer, build, (2, 5), infos, ggml_values=True)
        split = OffloadedExperts(on_cpu=on_cpu, streamed=None, stage_vectors=None, min_batch=32, resident=resident,
                                 slot_map=slot_map)  # fmt: skip
        split.host = _Host(split.host.fn, split.host.bind)  # type: ignore[assignment]
        x = torch.randn(2, 128, generator=torch.Generator().manual_seed(11))
        r = Routing(torch.tensor([[2, 5], [5, 2]], dtype=torch.int32), torch.tensor([[0.7, 0.3], [0.6, 0.4]]))
        r2 = Routing(torch.tensor([[2, 0], [5, 2]], dtype=torch.int32), r.weights)
        want, want2 = on_cpu(x, r), on_cpu(x, r2)
        calls = []
        kernels = loader.kernels
        real = kernels.gated_experts_into

        def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
            run = real(*args, **kwargs)
            return lambda: (calls.append(1), run())[1]

        monkeypatch.setattr(kernels, "gated_experts_into", spy)
        assert _rel(split(x, r), want) < 1e-5
        assert not calls  # every pick was cached: ggml computed nothing
        assert _rel(split(x, r2), want2) < 1e-5 and calls


def test_routing_counts_skip_padding_rows() -> None:
    counts = RoutingCounts.zeros(2, 8, 2, torch.device("cpu"))
    counts.begin_step(3, torch.tensor([0, 1, -1]))
    counts.count(1, torch.tensor([[1, 2], [2, 3], [7, 7]], dtype=torch.int32))
    counts.begin_step(1)
    counts.count(0, torch.tensor([[4, 5]]))
    assert counts.read().tolist() == [[0, 0, 0, 0, 1, 1, 0, 0], [0, 1, 2, 1, 0, 0, 0, 0]]


def test_online_replacement_swaps_in_the_hot_expert_and_stays_exact(
    tiny_qwen3moe_gguf: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--moe-cache-refresh on the CPU: a layer cached with a spare slot; once an outside expert is picked far more
    than the coldest cached one, the refresher copies it into the spare, flips the slot map at a step boundary
    (the coldest's slot becomes the spare) and the split still equals ggml alone."""
    import dataclasses

    from tandem.placement import ExpertCache
    from tandem.weights.expert_cache import ExpertCacheRefresher

    path = convert_hf(tiny_qwen3moe_gguf[0], tmp_path / "q8_0.gguf", "q8_0")
    builds = record_builds(monkeypatch)
    with tandem.LLM(path, device="cpu", n_ctx=32):
        loader, layer, build = builds[1]
        loader.plan = dataclasses.replace(loader.plan, expert_cache=ExpertCache({layer: (1, 4)}, {layer: 1}, "", 1))
        infos = [i for n, i in loader.file.tensors.items() if expert_layer(n) == layer]
        on_cpu = build(loader)
        resident, slot_map = loader._cached_experts(layer, build, (1, 4), infos, ggml_values=True)
        slots = loader.cache_slots[-1]
        assert slots.experts == [1, 4, -1] and slot_map.tolist() == [-1, 0, -1, -1, 1, -1, -1, -1]
        split = OffloadedExperts(on_cpu=on_cpu, streamed=None, stage_vectors=None, min_batch=32, resident=resident,
                                 slot_map=slot_map)  # fmt: skip
        split.host = _Host(split.host.fn, split.host.bind)  # type: ignore[assignment]
        counts = RoutingCounts.zeros(2, 8, 2, torch.device("cpu"))
        counts.counts[layer] = torch.tensor([0, 3, 0, 0, 40, 0, 90, 0])  # expert 6 hot, 1 the coldest cached
        refresher = ExpertCacheRefresher([slots], counts, every=2)
        for _ in range(4):  # read the counts, decide and copy, flip
            refresher.between_steps()
        assert refresher.swaps == 1 and sorted(slots.cached) == [4, 6] and -1 in slots.experts
        assert slot_map[6].item() == 2 and slot_map[1].item() == -1 and slot_map[4].item() == 1
        gen = torch.Generator().manual_seed(12)
        x = torch.randn(3, 128, generator=gen)
        weights = torch.softmax(torch.randn(3, 2, generator=gen), -1)
        r = Routing(torch.tensor([[6, 1], [4, 6], [2, 6]], dtype=torch.int32), weights)
        assert _rel(split(x, r), on_cpu(x, r)) < 1e-5
        for _ in range(6):  # nothing hotter outside: no more swaps
            refresher.between_steps()
        assert refresher.swaps == 1


def test_online_replacement_swaps_several_per_window(
    tiny_qwen3moe_gguf: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the text moves on, several outside experts are hotter than cached ones: up to MAX_SWAPS pairs swap in
    one window (the first into the spare, the others into the slots their cold experts leave at once), and the
    split still equals ggml alone while the copies are pending and after the flip."""
    import dataclasses

    from tandem.placement import ExpertCache
    from tandem.weights.expert_cache import MAX_SWAPS, ExpertCacheRefresher

    assert MAX_SWAPS >= 3
    path = convert_hf(tiny_qwen3moe_gguf[0], tmp_path / "q8_0.gguf", "q8_0")
    builds = record_builds(monkeypatch)
    with tandem.LLM(path, device="cpu", n_ctx=32):
        loader, layer, build = builds[1]
        cache = ExpertCache({layer: (1, 4, 5)}, {layer: 1}, "", 1)
        loader.plan = dataclasses.replace(loader.plan, expert_cache=cache)
        infos = [i for n, i in loader.file.tensors.items() if expert_layer(n) == layer]
        on_cpu = build(loader)
        resident, slot_map = loader._cached_experts(layer, build, (1, 4, 5), infos, ggml_values=True)
        slots = loader.cache_slots[-1]
        assert slots.experts == [1, 4, 5, -1]
        split = OffloadedExperts(on_cpu=on_cpu, streamed=None, stage_vectors=None, min_batch=32, resident=resident,
                                 slot_map=slot_map)  # fmt: skip
        split.host = _Host(split.host.fn, split.host.bind)  # type: ignore[assignment]
        counts = RoutingCounts.zeros(2, 8, 2, torch.device("cpu"))
        # outside 6, 2, 0 hot; cached 1, 5, 4 cold to lukewarm; 0 beats 4 by the margin, 3 beats nothing
        counts.counts[layer] = torch.tensor([70, 3, 80, 1, 40, 10, 90, 0])
        refresher = ExpertCacheRefresher([slots], counts, every=2)
        gen = torch.Generator().manual_seed(13)
        x = torch.randn(4, 128, generator=gen)
        weights = torch.softmax(torch.randn(4, 2, generator=gen), -1)
        r = Routing(torch.tensor([[6, 1], [4, 2], [0, 5], [3, 7]], dtype=torch.int32), weights)
        for _ in range(4):  # read the counts, decide and copy, flip: the split stays exact at every boundary
            refresher.between_steps()
            assert _rel(split(x, r), on_cpu(x, r)) < 1e-5
        assert refresher.swaps == 3 and sorted(slots.cached) == [0, 2, 6] and slots.experts.count(-1) == 1
        assert all(slot_map[e].item() == slots.experts.index(e) for e in (0, 2, 6))
        assert all(slot_map[e].item() == -1 for e in (1, 3, 4, 5, 7))
