"""The placement plan: flags -> devices, validated before any weight moves; dry-run on any machine."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import tandem
from tandem.cli.main import main
from tandem.errors import PlacementError
from tandem.gguf import open_gguf
from tandem.models import read_config
from tandem.placement import PlacementRequest, RuntimeShape, expert_layer, plan_placement
from tandem.placement.plan import GPU_PROCESS_BYTES
from tandem.placement.request import parse_size
from tandem.runtime.devices import resolve_device

HOST_TABLE = "token_embd.weight"  # untied: read a row at a time, so it stays in host RAM (as in llama.cpp)


def test_untied_embedding_table_stays_on_host_tied_one_on_gpu(
    tiny_qwen3moe_gguf: tuple[Path, Path], tiny_gemma3_gguf: tuple[Path, Path]
) -> None:
    f, plan = _plan(tiny_qwen3moe_gguf[1], device="cuda")
    assert "output.weight" in f.tensors and plan.devices[HOST_TABLE] == "cpu"
    f, plan = _plan(tiny_gemma3_gguf[1], device="cuda")
    assert "output.weight" not in f.tensors and plan.devices[HOST_TABLE] == "cuda:0"
    _, plan = _plan(tiny_qwen3moe_gguf[1], device="cuda", override_tensor=["token_embd=cuda"])
    assert plan.devices[HOST_TABLE] == "cuda:0"


def _plan(path: Path, **flags: object):
    f = open_gguf(path)
    return f, plan_placement(f, read_config(f), PlacementRequest.from_flags(**flags), RuntimeShape(n_ctx=256))


def test_cpu_moe_puts_every_expert_on_cpu_and_nothing_else(tiny_qwen3moe_gguf: tuple[Path, Path]) -> None:
    f, plan = _plan(tiny_qwen3moe_gguf[1], device="cuda", cpu_moe=True)
    experts = [n for n in f.tensors if expert_layer(n) is not None]
    assert experts
    for name, device in plan.devices.items():
        assert device == ("cpu" if name in experts or name == HOST_TABLE else "cuda:0"), name
    assert "blk.0.ffn_gate_inp.weight" in plan.devices and plan.devices["blk.0.ffn_gate_inp.weight"] == "cuda:0"
    assert plan.cpu_expert_layers == tuple(range(read_config(f).n_layers))
    cpu_bytes = sum(f.tensors[n].n_bytes for n in [*experts, HOST_TABLE])
    assert plan.weight_bytes["cpu"] == cpu_bytes
    assert plan.gpu_bytes() == (plan.weight_bytes["cuda:0"] + plan.kv_bytes + plan.workspace_bytes + plan.staging_bytes
                                + GPU_PROCESS_BYTES)  # fmt: skip


def test_n_cpu_moe_takes_the_first_layers(tiny_qwen3moe_gguf: tuple[Path, Path]) -> None:
    f, plan = _plan(tiny_qwen3moe_gguf[1], device="cuda", n_cpu_moe=1)
    for name, device in plan.devices.items():
        layer = expert_layer(name)
        assert device == ("cpu" if layer == 0 or name == HOST_TABLE else "cuda:0"), name
    assert plan.cpu_expert_layers == (0,)


def test_override_first_match_wins_and_beats_cpu_moe(tiny_qwen3moe_gguf: tuple[Path, Path]) -> None:
    overrides = [r"blk\.1\.ffn_.*_exps=cuda", r"blk\.1\..*=cpu", r"attn_q=cpu"]
    _, plan = _plan(tiny_qwen3moe_gguf[1], device="cuda", cpu_moe=True, override_tensor=overrides)
    assert plan.devices["blk.1.ffn_up_exps.weight"] == "cuda:0"
    assert plan.devices["blk.1.ffn_down_exps.weight"] == "cuda:0"
    assert plan.devices["blk.0.ffn_down_exps.weight"] == "cpu"
    assert plan.cpu_expert_layers == (0,)
    assert plan.devices["blk.1.attn_k.weight"] == "cpu"
    assert plan.devices["blk.0.attn_q.weight"] == "cpu"
    assert plan.devices["blk.0.attn_k.weight"] == "cuda:0"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"device": "cuda", "n_cpu_moe": 99}, "--n-cpu-moe 99"),
        ({"device": "cuda", "override_tensor": [r"nothing_like_this=cpu"]}, "matches no tensor"),
        ({"device": "cuda", "override_tensor": [r"attn_q"]}, "REGEX=DEVICE"),
        ({"device": "cuda", "override_tensor": [r"attn_q=tpu"]}, "unknown device 'tpu'"),
        ({"device": "cuda", "override_tensor": [r"attn_q[=cpu"]}, "bad regex"),
        ({"device": "npu"}, "--device: unknown device"),
        ({"device": "cuda", "gpu_memory": "1KiB"}, "cannot hold even the non-expert weights"),
        ({"device": "cuda", "gpu_memory": "lots"}, "cannot read 'lots'"),
        ({"device": "cpu", "gpu_memory": "8GiB"}, "needs a GPU device"),
        ({"device": "cuda", "cpu_moe": True, "n_cpu_moe": 1}, "exclusive"),
        ({"device": "cuda", "override_tensor": [r"ffn_down_exps=cpu"]}, "routed experts of layer 0 would be split"),
        ({"device": "cuda", "n_gpu_layers": 1}, "-ngl 1: tandem keeps all 2 layers on one device"),
        ({"device": "cuda", "n_gpu_layers": 0}, "-ngl 0 keeps every layer on the CPU"),
        ({"device": "cpu", "n_gpu_layers": 99}, "-ngl 99 asks for the layers on a GPU"),
    ],
)
def test_impossible_requests_fail_fast(tiny_qwen3moe_gguf: tuple[Path, Path], flags: dict, message: str) -> None:
    with pytest.raises(PlacementError, match=message):
        _plan(tiny_qwen3moe_gguf[1], **flags)


def test_cpu_moe_on_a_dense_model_is_an_error(tiny_qwen3_gguf: tuple[Path, Path]) -> None:
    with pytest.raises(PlacementError, match="--cpu-moe: qwen3 has no routed-expert tensors"):
        _plan(tiny_qwen3_gguf[1], device="cuda", cpu_moe=True)


def test_budget_moves_whole_layers_of_experts_to_cpu(tiny_qwen3moe_gguf: tuple[Path, Path]) -> None:
    f, everything = _plan(tiny_qwen3moe_gguf[1], device="cuda")
    n_layers = read_config(f).n_layers
    _, all_off = _plan(tiny_qwen3moe_gguf[1], device="cuda", cpu_moe=True)
    # Offloading costs a staging window of one layer's experts, so the budget that excludes
    # every expert but the staging window forces all layers to the CPU.
    budget = all_off.gpu_bytes()
    assert budget < everything.gpu_bytes()
    _, fitted = _plan(tiny_qwen3moe_gguf[1], device="cuda", gpu_memory=budget)
    assert fitted.cpu_expert_layers == tuple(range(n_layers))
    assert fitted.gpu_bytes() <= budget
    _, roomy = _plan(tiny_qwen3moe_gguf[1], device="cuda", gpu_memory=everything.gpu_bytes())
    assert roomy.cpu_expert_layers == ()


def test_budget_works_with_other_flags(tiny_qwen3moe_gguf: tuple[Path, Path]) -> None:
    _, plan = _plan(
        tiny_qwen3moe_gguf[1], device="cuda", gpu_memory="64GiB", override_tensor=[r"blk\.1\.ffn_.*_exps=cpu"]
    )
    assert plan.devices["blk.1.ffn_up_exps.weight"] == "cpu"
    assert plan.devices["blk.0.ffn_down_exps.weight"] == "cuda:0"
    assert plan.cpu_expert_layers == (1,)


@pytest.mark.parametrize("n_gpu_layers", [2, 99, -1])
def test_llama_cpp_ngl_for_every_layer_is_the_gpu_plan(
    tiny_qwen3moe_gguf: tuple[Path, Path], n_gpu_layers: int
) -> None:
    """-ngl at least the layer count (llama.cpp's `-ngl 99 --cpu-moe` recipe) plans exactly what tandem plans alone."""
    _, plain = _plan(tiny_qwen3moe_gguf[1], device="cuda", cpu_moe=True)
    _, with_ngl = _plan(tiny_qwen3moe_gguf[1], device="cuda", cpu_moe=True, n_gpu_layers=n_gpu_layers)
    assert with_ngl.devices == plain.devices
    assert with_ngl.gpu_bytes() == plain.gpu_bytes()


def test_llama_cpp_ngl_0_is_the_cpu(tiny_qwen3moe_gguf: tuple[Path, Path]) -> None:
    assert resolve_device(None, 0) == "cpu"
    assert resolve_device("cuda", 0) == "cuda"  # kept, so that the request can refuse the contradiction
    llm = tandem.LLM(tiny_qwen3moe_gguf[1], n_gpu_layers=0)
    try:
        assert set(llm.placed.values()) == {"cpu"}
    finally:
        llm.close()


def test_sizes() -> None:
    assert parse_size("24GiB") == 24 * 2**30
    assert parse_size("20GB") == 20 * 10**9
    assert parse_size("1.5g") == 1_500_000_000
    assert parse_size("4096") == 4096


def test_paths_not_built_fail_before_loading(tiny_qwen3moe_gguf: tuple[Path, Path]) -> None:
    with pytest.raises(PlacementError, match="--pcie-experts 1: not built under --tp 2"):
        tandem.LLM(tiny_qwen3moe_gguf[1], device="cuda", tp=2, pcie_experts=1)


def test_inspect_is_a_dry_run_of_a_gpu_plan(
    tiny_qwen3moe_gguf: tuple[Path, Path], capsys: pytest.CaptureFixture
) -> None:
    path = str(tiny_qwen3moe_gguf[1])
    assert main(["inspect", "-m", path, "--device", "cuda", "--cpu-moe", "--gpu-memory", "24GiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    plan = out["plan"]
    assert plan["request"]["cpu_moe"] and plan["request"]["device"] == "cuda:0"
    devices = {t["name"]: t["device"] for t in out["tensors"]}
    assert devices["blk.0.ffn_down_exps.weight"] == "cpu" and devices["blk.0.attn_q.weight"] == "cuda:0"
    assert plan["process_bytes"] == GPU_PROCESS_BYTES
    assert plan["expected_gpu_bytes"] == (
        plan["weight_bytes"]["cuda:0"] + plan["kv_bytes"] + plan["workspace_bytes"] + plan["staging_bytes"]
        + plan["process_bytes"]
    )
    assert main(["inspect", "-m", path, "--device", "cuda", "--n-cpu-moe", "1", "--tensors"]) == 0
    text = capsys.readouterr().out
    assert "expected VRAM" in text and "experts on the CPU: 1 layers (0..0)" in text


def test_cli_takes_llama_cpp_ngl(tiny_qwen3moe_gguf: tuple[Path, Path], capsys: pytest.CaptureFixture) -> None:
    """llama.cpp's `-ngl 99 --cpu-moe` command line plans as `--cpu-moe`; a split of the layers is one line, exit 2."""
    path = str(tiny_qwen3moe_gguf[1])
    assert main(["inspect", "-m", path, "--device", "cuda", "-ngl", "99", "--cpu-moe", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["request"]["n_gpu_layers"] == 99 and plan["cpu_expert_layers"] == [0, 1]
    assert main(["inspect", "-m", path, "--device", "cuda", "--n-gpu-layers", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: -ngl 1: tandem keeps all 2 layers on one device")


def test_pcie_experts_is_checked_before_loading(
    tiny_qwen3moe_gguf: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """--pcie-experts K (the GPU reads K of each token's host-RAM experts over PCIe): every plan it cannot run is a
    one-line error naming the flag, before a weight is read; a plan it can run passes. The tiny model selects 2 of
    4 experts per token; its F32 experts have no GPU kernel, its Q8_0 conversion has."""
    from tandem.convert import convert_hf
    from tandem.runtime.devices import check_pcie_experts

    q8 = convert_hf(tiny_qwen3moe_gguf[0], tmp_path / "tiny-q8_0.gguf", "q8_0")
    f, plan = _plan(q8, device="cuda", cpu_moe=True)
    check_pcie_experts(plan, f, read_config(f), 0)  # off
    check_pcie_experts(plan, f, read_config(f), 1)  # runs: 1 on the GPU, 1 on the CPU
    cases = [
        (_plan(q8, device="cuda", cpu_moe=True), 2, "must be below|leave the CPU some"),
        (_plan(q8, device="cuda", cpu_moe=True), -1, "must be 0"),
        (_plan(q8, device="cpu"), 1, "--device is cpu"),
        (_plan(q8, device="cuda"), 1, "no routed experts are in host RAM; add --cpu-moe"),
        (_plan(tiny_qwen3moe_gguf[1], device="cuda", cpu_moe=True), 1, r"experts \(F32\) have no GPU kernel"),
    ]
    for (f, plan), k, message in cases:
        with pytest.raises(tandem.TandemError, match=message) as e:
            check_pcie_experts(plan, f, read_config(f), k)
        assert str(e.value).startswith(f"--pcie-experts {k}: ") and "\n" not in str(e.value)
    assert main(["run", "-m", str(q8), "-p", "hi", "-n", "2", "--device", "cpu", "--pcie-experts", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --pcie-experts 1: the GPU reads the experts, and --device is cpu; drop the flag"]
    # inspect, a dry run, checks it too and says what the GPU would compute
    assert main(["inspect", "-m", str(q8), "--device", "cuda", "--cpu-moe", "--pcie-experts", "1"]) == 0
    assert "the GPU computes 1 of each token's 2 experts in host RAM" in capsys.readouterr().out
    assert main(["inspect", "-m", str(q8), "--device", "cuda", "--pcie-experts", "1"]) == 2
    assert capsys.readouterr().err.startswith("error: --pcie-experts 1: no routed experts are in host RAM")


def test_expandable_segments_unless_the_user_set_the_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU run gives torch's allocator expandable segments; a user's own allocator settings, or a process that
    started CUDA already, keep theirs."""
    from tandem.runtime import devices

    for name in devices.ALLOCATOR_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(devices.torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "")  # set, but to nothing: no setting of the user's
    devices.prefer_expandable_segments()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:64")
    devices.prefer_expandable_segments()
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and os.environ["PYTORCH_ALLOC_CONF"] == "max_split_size_mb:64"
    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    monkeypatch.setattr(devices.torch.cuda, "is_initialized", lambda: True)
    devices.prefer_expandable_segments()
    assert not any(name in os.environ for name in devices.ALLOCATOR_ENV)
