"""--tp N (docs/TENSOR_PARALLEL.md): each rank's slices and plan, checked without loading anything; then the ranks run
on the CPU (gloo, 2 ranks) and give --tp 1's greedy tokens on the tiny model of every family."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import tandem
from tandem.cli.main import main
from tandem.errors import PlacementError, TandemError
from tandem.gguf import open_gguf
from tandem.layers.moe import Routing
from tandem.layers.parallel import ExpertSubset, local_routing
from tandem.models import read_config
from tandem.placement import PlacementRequest, RuntimeShape, expert_layer, plan_placement
from tandem.placement.tp import check_tp_flags, plan_tensor_parallel
from tandem.runtime.tp import SlotStep, decode_step, encode_step, follow
from tandem.runtime.tp_cores import CPU, rank_cores

FAMILIES = ["tiny_qwen3_gguf", "tiny_gemma3_gguf", "tiny_qwen3moe_gguf", "tiny_qwen35moe_gguf", "tiny_qwen3next_gguf",
            "tiny_gpt_oss_gguf", "tiny_gemma4_gguf"]  # fmt: skip
SHAPE = RuntimeShape(n_ctx=128)


def _tp(path: Path, tp: int = 2, **flags: object):  # type: ignore[no-untyped-def]
    f = open_gguf(path)
    cfg = read_config(f)
    return f, cfg, plan_tensor_parallel(f, cfg, PlacementRequest.from_flags(tp=tp, **flags), SHAPE)


def _floats(info) -> np.ndarray:  # type: ignore[no-untyped-def]
    return np.frombuffer(info.data.tobytes(), dtype=np.float32).reshape(info.shape)


# -- the plan ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", FAMILIES)
def test_each_rank_holds_its_slices(fixture: str, request: pytest.FixtureRequest) -> None:
    """Every tensor of every family has a split; a rank's loaded slice is exactly the cut of the file's tensor (F32:
    compared as numbers), views of the memory map where contiguous; the ranks' slices of a split tensor add up to it
    (a KV head is copied where ranks outnumber KV heads: Gemma 4's global layers)."""
    f, cfg, tp = _tp(request.getfixturevalue(fixture)[1], device="cpu")
    views = [r.load_view() for r in tp.ranks]
    for name, info in f.tensors.items():
        full = _floats(info)
        cuts = [r.cuts[name] for r in tp.ranks]
        for rank, view, cut in zip(tp.ranks, views, cuts, strict=True):
            got = view.tensors[name]
            assert got.shape == rank.file.tensors[name].shape and got.n_bytes == rank.file.tensors[name].n_bytes
            if cut.how == "whole":
                assert got is info
            elif cut.how == "zeros":
                assert not _floats(got).any()
            else:
                want = np.concatenate([np.take(full, range(a, b), axis=cut.axis) for a, b in cut.ranges], cut.axis)
                assert np.array_equal(_floats(got), want), (name, rank.rank)
                if cut.axis == 0 and len(cut.ranges) == 1 and len(info.shape) > 1:
                    assert np.shares_memory(got.data, info.data), f"{name}: a contiguous slice was copied"
        if cuts[0].how == "split" and "KV" not in cuts[0].what:
            assert sum(v.tensors[name].n_bytes for v in views) == info.n_bytes, name
    if cfg.moe is not None:
        layer = next(i for i, s in enumerate(cfg.layers) if s.moe)
        assert [r.expert_ranges[layer] for r in tp.ranks] == [(0, cfg.moe.n_experts // 2),
                                                              (cfg.moe.n_experts // 2, cfg.moe.n_experts)]  # fmt: skip


def test_a_rank_has_its_share_of_the_heads(
    tiny_qwen35moe_gguf: tuple[Path, Path], tiny_gemma4_gguf: tuple[Path, Path]
) -> None:
    _, cfg, tp = _tp(tiny_qwen35moe_gguf[1], device="cpu")
    local = tp.ranks[1].config
    assert (local.n_heads, local.n_kv_heads) == (cfg.n_heads // 2, cfg.n_kv_heads // 2)
    net = local.delta_net  # type: ignore[attr-defined]
    assert (net.n_k_heads, net.n_v_heads) == (1, 2) and net.head_layout == "tiled"
    # tiled: value head j reads key head j % Hk, so rank 1 (key head 1) holds value heads 1 and 3
    assert tp.ranks[1].cuts["blk.0.ssm_a"].ranges == ((1, 2), (3, 4))
    _, cfg, tp = _tp(tiny_gemma4_gguf[1], device="cpu")
    assert [s.n_kv_heads for s in tp.ranks[0].config.layers] == [1, 1, 1, 1]  # 2 split, 1 copied
    assert tp.ranks[1].cuts["blk.1.attn_k.weight"].ranges == ((0, cfg.layers[1].head_dim),)


FLAGS = {
    "cpu-moe": {"cpu_moe": True},
    "n-cpu-moe": {"n_cpu_moe": 1},
    "ot": {"override_tensor": [r"blk\.1\.ffn_.*_exps=cpu"]},
}


@pytest.mark.parametrize("flags", FLAGS.values(), ids=FLAGS.keys())
@pytest.mark.parametrize("fixture", ["tiny_qwen3moe_gguf", "tiny_qwen35moe_gguf", "tiny_gemma4_gguf"])
def test_no_cpu_planned_expert_on_any_rank_gpu(fixture: str, flags: dict, request: pytest.FixtureRequest) -> None:
    """The promise: what the flags keep in host RAM stays there on every rank (each rank its own experts of it), and
    each rank's GPU holds exactly its slices of the rest."""
    path = request.getfixturevalue(fixture)[1]
    f, cfg, tp = _tp(path, device="cuda", **flags)
    base = plan_placement(f, cfg, PlacementRequest.from_flags(device="cuda", **flags), SHAPE)
    on_cpu = {n for n, d in base.devices.items() if d == "cpu" and expert_layer(n) is not None}
    assert on_cpu
    for rank in tp.ranks:
        gpu = f"cuda:{rank.rank}"
        assert rank.device == gpu
        devices = rank.plan.devices
        assert all(devices[n] == "cpu" for n in on_cpu), rank.rank
        assert {n for n, d in devices.items() if d == gpu} == {n for n, d in base.devices.items() if d == "cuda:0"}
        assert rank.plan.weight_bytes[gpu] == sum(rank.file.tensors[n].n_bytes for n, d in devices.items() if d == gpu)
        assert rank.plan.cpu_expert_layers == base.cpu_expert_layers


def test_gpu_memory_is_a_budget_per_rank(tiny_qwen3moe_gguf: tuple[Path, Path]) -> None:
    """Each rank fits --gpu-memory on its own GPU: a budget below the whole model's needs but above a rank's keeps
    every expert in VRAM."""
    f, cfg, tp = _tp(tiny_qwen3moe_gguf[1], device="cuda")
    whole = plan_placement(f, cfg, PlacementRequest.from_flags(device="cuda"), SHAPE)
    need = max(r.plan.gpu_bytes() for r in tp.ranks)
    assert need < whole.gpu_bytes()
    _, _, fitted = _tp(tiny_qwen3moe_gguf[1], device="cuda", gpu_memory=need)
    assert all(r.plan.cpu_expert_layers == () and r.plan.gpu_bytes() <= need for r in fitted.ranks)


def test_ranks_take_the_gpus_from_the_device(tiny_qwen3_gguf: tuple[Path, Path]) -> None:
    _, _, tp = _tp(tiny_qwen3_gguf[1], device="cuda:1")
    assert [r.device for r in tp.ranks] == ["cuda:1", "cuda:2"] and tp.backend == "nccl"
    assert _tp(tiny_qwen3_gguf[1], device="cpu")[2].backend == "gloo"


@pytest.mark.parametrize(
    ("fixture", "tp", "flags", "message"),
    [
        ("tiny_qwen3moe_gguf", 3, {"device": "cpu"}, r"--tp 3: .*(query heads|KV heads).* 3 ranks"),
        ("tiny_qwen35moe_gguf", 3, {"device": "cpu"}, r"--tp 3: .* not a multiple of 3 ranks"),
        ("tiny_gemma4_q8_0_gguf", 4, {"device": "cpu"}, r"--tp 4: blk\.\d+\.ffn_down\.weight has 2 blocks of 32"),
        ("tiny_qwen3moe_gguf", 2, {"device": "cuda", "override_tensor": ["attn_q=cuda:1"]}, "not to another GPU"),
    ],
)
def test_splits_the_model_does_not_allow_fail_before_loading(
    fixture: str, tp: int, flags: dict, message: str, request: pytest.FixtureRequest
) -> None:
    with pytest.raises(PlacementError, match=message):
        _tp(request.getfixturevalue(fixture)[1], tp=tp, **flags)


def test_a_column_cut_inside_a_block_is_refused(tiny_gemma4_q8_0_gguf: tuple[Path, Path]) -> None:
    from tandem.placement.tp import Cut, _check_alignment

    info = open_gguf(tiny_gemma4_q8_0_gguf[1]).tensors["blk.0.attn_output.weight"]  # Q8_0: blocks of 32
    _check_alignment(info, Cut("split", -1, ((0, 32),)), 2)
    with pytest.raises(PlacementError, match=r"attn_output\.weight \(Q8_0, blocks of 32\) cannot be cut at column 16"):
        _check_alignment(info, Cut("split", -1, ((0, 16),)), 4)


def test_pcie_experts_is_refused_under_tp() -> None:
    with pytest.raises(PlacementError, match="--pcie-experts 1: not built under --tp 2"):
        check_tp_flags(PlacementRequest.from_flags(device="cuda", tp=2), 1)


def test_inspect_shows_each_rank(tiny_qwen3moe_gguf: tuple[Path, Path], capsys: pytest.CaptureFixture) -> None:
    path = str(tiny_qwen3moe_gguf[1])
    assert main(["inspect", "-m", path, "--device", "cuda", "--tp", "2", "--cpu-moe", "-c", "128", "--json"]) == 0
    tp = json.loads(capsys.readouterr().out)["tp"]
    assert tp["tp"] == 2 and tp["backend"] == "nccl"
    for r in tp["ranks"]:
        gpu = f"cuda:{r['rank']}"
        assert r["device"] == gpu
        assert r["expected_gpu_bytes"] == (r["weight_bytes"][gpu] + r["kv_bytes"] + r["workspace_bytes"]
                                           + r["staging_bytes"] + r["expert_cache"]["bytes"]
                                           + r["process_bytes"])  # fmt: skip
        experts = r["tensors"]["blk.0.ffn_up_exps.weight"]
        assert experts["device"] == "cpu" and experts["split"] == f"experts {4 * r['rank']}..{4 * r['rank'] + 3}"
        assert r["tensors"]["blk.0.attn_q.weight"]["device"] == gpu
    assert main(["inspect", "-m", path, "--device", "cuda", "--tp", "2", "-c", "128", "--tensors"]) == 0
    text = capsys.readouterr().out
    assert "tensor parallel: 2 ranks (nccl)" in text and "rank 1 (cuda:1)" in text


# -- pieces of the execution ------------------------------------------------------------------------------------------


def test_rank_cores_are_disjoint_and_follow_the_nodes() -> None:
    two_nodes = [CPU(node=c // 8, core=c % 4, package=c // 8, cpu=c) for c in range(16)]  # 2 x 4 cores x 2 threads
    assert rank_cores(two_nodes, 2) == [[0, 1, 2, 3], [8, 9, 10, 11]]  # a node each, one thread per core
    one_node = [CPU(node=0, core=c, package=0, cpu=c) for c in range(8)]
    assert rank_cores(one_node, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert rank_cores(one_node[:2], 2) == [[0], [1]]
    assert rank_cores(one_node[:1], 2) == [[0], [0]]  # fewer CPUs than ranks: shared


def test_a_rank_computes_only_its_experts() -> None:
    ids = torch.tensor([[0, 5], [6, 7], [1, 2]])
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    local = local_routing(Routing(ids, weights), first=4, count=4)  # experts 4..7
    assert local.ids.tolist() == [[1, 1], [2, 3], [3, 3]]  # others' slots: the token's own (else the step's) expert
    assert torch.equal(local.weights, torch.tensor([[0.0, 0.4], [0.7, 0.3], [0.0, 0.0]]))

    calls = []

    def experts(x: torch.Tensor, routing: Routing) -> torch.Tensor:
        calls.append(routing)
        return torch.ones(x.shape[0], x.shape[1])

    subset = ExpertSubset(experts, first=4, count=4)
    x = torch.zeros(3, 8)
    assert subset(x, Routing(ids, weights)).sum() == 24 and calls[-1].ids.tolist() == [[1, 1], [2, 3], [3, 3]]
    none = subset(x, Routing(torch.tensor([[0, 1]] * 3), weights))
    assert len(calls) == 1 and not none.any()  # no token selects this rank's experts: none is read


def test_steps_travel_as_rank_0_runs_them() -> None:
    steps = [SlotStep(0, 5, (4,), (7, 8, 9)), SlotStep(2, 0, (), (3,))]
    assert decode_step(encode_step(steps, True)) == (steps, True)

    class Cache:
        def __init__(self) -> None:
            self.length, self.checkpoints = 9, [(4, None)]

        def truncate(self, n: int) -> None:
            self.length = min(self.length, n)

        def checkpoint(self) -> None:
            self.checkpoints.append((self.length, None))

    class Pool:
        caches = [Cache()]

    pool = Pool()
    follow(pool, SlotStep(0, 5, (4, 5), (1,)))  # type: ignore[arg-type]
    assert pool.caches[0].length == 5 and [at for at, _ in pool.caches[0].checkpoints] == [4, 5]
    with pytest.raises(TandemError, match="out of step with rank 0"):
        follow(pool, SlotStep(0, 6, (4, 5), (1,)))  # type: ignore[arg-type]


# -- the ranks, on the CPU (gloo) ----------------------------------------------------------------------------------

OPTS = {"device": "cpu", "n_ctx": 128, "threads": 1, "cache_type": "f32"}  # f32 throughout
PROMPT = list(range(5, 25))


@pytest.mark.parametrize("fixture", [*FAMILIES, "tiny_gemma4_q8_0_gguf"])
def test_greedy_tokens_with_tp_2_equal_tp_1(fixture: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(fixture)[1]
    with tandem.LLM(path, **OPTS) as llm:
        want = llm.generate_ids(PROMPT, max_tokens=8, temperature=0)
        want_logits = llm.logits(PROMPT[:6])
    with tandem.LLM(path, tp=2, **OPTS) as llm:
        assert llm.tp is not None and [r["device"] for r in llm.tp.reports()] == ["cpu", "cpu"]
        assert llm.generate_ids(PROMPT, max_tokens=8, temperature=0) == want
        logits = llm.logits(PROMPT[:6])
    assert np.abs(logits - want_logits).max() <= 1e-4 * max(1.0, float(np.abs(want_logits).max()))


def _serve(llm: tandem.LLM) -> tuple[list[list[int]], str, str]:
    """Four requests over two slots (chunked prefill beside decode, one prompt sharing another's prefix), then two
    chat turns (the second resumes the first's slot, from a recurrent checkpoint)."""
    from tandem.runtime.sampling import Sampler, SamplingParams

    prompts = [list(range(5, 30)), list(range(40, 47)), [*range(5, 20), 99, 100], list(range(60, 90))]
    seqs = [llm.engine.add_request(p, Sampler(SamplingParams(temperature=0)), 6 + i, frozenset())
            for i, p in enumerate(prompts)]  # fmt: skip
    while llm.engine.has_work:
        llm.engine.step()
    messages = [{"role": "user", "content": "The harbour was quiet"}]
    first = llm.chat(messages, max_tokens=5, temperature=0)
    assert isinstance(first, str)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "and then?"}]
    second = llm.chat(messages, max_tokens=5, temperature=0)
    assert isinstance(second, str)
    return [s.tokens[len(s.prompt) :] for s in seqs], first, second


def test_the_batched_engine_under_tp(tiny_qwen35moe_gguf: tuple[Path, Path]) -> None:
    opts = {**OPTS, "n_parallel": 2, "n_batch": 16}
    with tandem.LLM(tiny_qwen35moe_gguf[1], **opts) as llm:
        want = _serve(llm)
    with tandem.LLM(tiny_qwen35moe_gguf[1], tp=2, **opts) as llm:
        assert _serve(llm) == want


def test_a_rank_that_dies_is_one_line_and_the_model_refuses_after(tiny_qwen3moe_gguf: tuple[Path, Path]) -> None:
    with tandem.LLM(tiny_qwen3moe_gguf[1], tp=2, **OPTS) as llm:
        assert llm.tp is not None
        process = llm.tp.ranks.processes[0]
        process.kill()
        process.wait()
        with pytest.raises(TandemError, match="--tp 2: rank 1: exited with code -9"):
            llm.generate_ids(PROMPT, max_tokens=2, temperature=0)
        with pytest.raises(TandemError, match="out of step since an earlier error"):
            llm.generate_ids(PROMPT, max_tokens=2, temperature=0)


def test_cli_run_with_tp(tiny_qwen3moe_gguf: tuple[Path, Path], capsys: pytest.CaptureFixture) -> None:
    argv = ["run", "-m", str(tiny_qwen3moe_gguf[1]), "--device", "cpu", "-c", "128", "-t", "1", "-p", "The harbour",
            "-n", "6", "--temp", "0"]  # fmt: skip
    assert main(argv) == 0
    want = capsys.readouterr().out
    assert main([*argv, "--tp", "2"]) == 0
    assert capsys.readouterr().out == want


def test_serve_under_tp(tiny_qwen3moe_gguf: tuple[Path, Path]) -> None:
    """tandem serve's engine worker thread drives rank 0: two concurrent completions over HTTP equal --tp 1's."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    httpx = pytest.importorskip("httpx")
    uvicorn = pytest.importorskip("uvicorn")
    from tandem.server import EngineWorker, create_app, listen

    path = tiny_qwen3moe_gguf[1]
    prompts = ["The harbour was", "Computers follow"]
    with tandem.LLM(path, **OPTS) as llm:
        want = [llm.generate(p, max_tokens=6, temperature=0) for p in prompts]
    worker = EngineWorker(lambda: tandem.LLM(path, tp=2, n_parallel=2, **OPTS), max_waiting=4)
    llm = worker.start()
    sock = listen("127.0.0.1", 0)
    http = uvicorn.Server(uvicorn.Config(create_app(worker, llm), log_level="warning"))
    thread = threading.Thread(target=http.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not http.started:
            assert thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/completions"

        def complete(prompt: str) -> str:
            body = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
            return httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"]

        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(complete, prompts)) == want
    finally:
        http.should_exit = True
        thread.join(30)
        worker.stop()
        sock.close()
