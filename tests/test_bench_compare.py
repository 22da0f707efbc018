"""`tandem bench --compare llamacpp --report DIR`: placement translation, failure rows, files, exit codes.

The failure tests force each failure the report must survive: the peer missing (--peer-lib at an empty
directory), a worker crash and a bad result line (TANDEM_BENCH_INJECT, see tandem/bench/protocol.py), a crash
after the first repetition (its repetition kept), and a timeout (a hanging worker under a tiny --timeout);
report.png through its subprocess and through both fallbacks. The side-by-side test runs only where the
llama-cpp-python CPU build (scripts/build_llamacpp.sh) is importable.
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.bench import plot
from tandem.bench.compare import _stop, default_peer_lib, run_worker, split_result
from tandem.bench.protocol import INJECT_ENV, REP_MARKER, RepClock, parse_rep, parse_reps, parse_result, prompt_ids
from tandem.bench.report import Row, render_markdown
from tandem.bench.spec import LLAMA_ALL_EXPERTS, LLAMA_LAYER_EXPERTS, Placement, parse_matrix, to_llama
from tandem.cli.main import main
from tandem.errors import TandemError
from tandem.gguf import open_gguf
from tandem.models import read_config
from tandem.placement import PlacementRequest, RuntimeShape, plan_placement

FAST = ["--pp", "4,8", "--tg", "2", "-t", "1", "-c", "64"]


def _llama_devices(names: list[str], placement: dict) -> dict[str, str]:
    """Where llama.cpp puts each tensor, given the translated placement: first matching override, else default."""
    default = "cuda:0" if placement["n_gpu_layers"] != 0 else "cpu"
    out = {}
    for name in names:
        out[name] = next((d for p, d in placement["overrides"] if re.search(p, name)), default)
    return out


@pytest.mark.parametrize(
    "flags",
    [
        {},
        {"cpu_moe": True},
        {"n_cpu_moe": 1},
        {"override_tensor": ["blk\\.1\\.ffn_.*_exps=cpu"], "n_cpu_moe": 1},
        {"gpu_memory": -1},  # one byte short of the all-GPU plan: --gpu-memory must move layer 0's experts
    ],
)
def test_translation_places_the_same_tensors(tiny_qwen3moe_gguf: tuple[Path, Path], flags: dict) -> None:
    f = open_gguf(tiny_qwen3moe_gguf[1])
    cfg = read_config(f)
    shape = RuntimeShape(n_ctx=64, n_batch=8)
    if flags.get("gpu_memory") == -1:
        full = plan_placement(f, cfg, PlacementRequest.from_flags(device="cuda"), shape)
        flags = {"gpu_memory": full.gpu_bytes() - 1}
    req = PlacementRequest.from_flags(device="cuda", **flags)
    plan = plan_placement(f, cfg, req, shape)
    assert plan.cpu_expert_layers or not (flags.get("gpu_memory") or flags.get("cpu_moe") or flags.get("n_cpu_moe"))
    llama = to_llama(req, plan).as_dict()
    assert llama["n_gpu_layers"] == -1
    # token_embd stays on the CPU in llama.cpp whatever the flags (its input layer): compare the rest.
    names = [n for n in f.tensors if n != "token_embd.weight"]
    assert _llama_devices(names, llama) == {n: plan.devices[n] for n in names}


def test_translation_patterns_and_order() -> None:
    assert to_llama(PlacementRequest.from_flags(device="cpu")).as_dict() == {
        "n_gpu_layers": 0,
        "main_gpu": 0,
        "overrides": [],
    }
    cpu_moe = to_llama(PlacementRequest.from_flags(device="cuda:1", cpu_moe=True))
    assert (cpu_moe.n_gpu_layers, cpu_moe.main_gpu, cpu_moe.overrides) == (-1, 1, ((LLAMA_ALL_EXPERTS, "cpu"),))
    mixed = to_llama(PlacementRequest.from_flags(device="cuda", n_cpu_moe=2, override_tensor=["output=cuda"]))
    assert mixed.overrides == (
        ("output", "cuda:0"),  # -ot first, as in tandem's plan and llama.cpp's flag order
        (LLAMA_LAYER_EXPERTS.format(layer=0), "cpu"),
        (LLAMA_LAYER_EXPERTS.format(layer=1), "cpu"),
    )
    assert LLAMA_LAYER_EXPERTS.format(layer=7) == r"blk\.7\.ffn_(up|down|gate_up|gate)_(ch|)exps"
    with pytest.raises(TandemError, match="--tp 2"):
        to_llama(PlacementRequest.from_flags(device="cuda", tp=2))


def test_matrix_and_labels() -> None:
    base = Placement(device="cuda", override_tensor=("x=cpu",))
    got = parse_matrix("all, cpu-moe, n-cpu-moe=half, n-cpu-moe=3", base, n_layers=48)
    assert [(p.cpu_moe, p.n_cpu_moe, p.override_tensor) for p in got] == [
        (False, 0, ("x=cpu",)),
        (True, 0, ("x=cpu",)),
        (False, 24, ("x=cpu",)),
        (False, 3, ("x=cpu",)),
    ]
    assert got[1].label == "cuda --cpu-moe --override-tensor=x=cpu"
    assert Placement(device="cuda").label == "cuda (all)"
    with pytest.raises(TandemError, match="--matrix"):
        parse_matrix("cpu-moe,bogus", base, 48)


def test_protocol_prompt_and_result_line() -> None:
    assert prompt_ids(100, 5, seed=3) == prompt_ids(100, 5, seed=3) != prompt_ids(100, 5, seed=4)
    assert all(0 <= t < 100 for t in prompt_ids(100, 50, 0))
    out = 'noise\nTANDEM_BENCH_RESULT {"ok": true}\nmore noise\n'
    assert parse_result(out) == {"ok": True}
    assert parse_result("nothing") is None
    reps = f'{REP_MARKER}{{"rep": 0}}\nnoise\n{REP_MARKER}{{"rep": 1}}\n{REP_MARKER}{{"rep": 2, "cut'
    assert parse_reps(reps) == [{"rep": 0}, {"rep": 1}]  # a line cut short by a kill is dropped
    assert parse_rep("noise") is None
    whole = {"load_s": 1.0, "pp_s": {"4": [0.1, 0.2]}, "tg_s": [0.3, 0.4]}
    assert split_result(whole) == [
        {"load_s": 1.0, "pp_s": {"4": [0.1]}, "tg_s": [0.3]},
        {"load_s": 1.0, "pp_s": {"4": [0.2]}, "tg_s": [0.4]},
    ]
    clock = RepClock(deadline=None)
    assert clock.may_start(0) and clock.may_start(5)
    import time

    clock = RepClock(deadline=time.time() + 5)
    clock.last_s = 10.0
    assert clock.may_start(0) and not clock.may_start(1)  # the first repetition always runs
    clock.last_s = 1.0
    assert clock.may_start(1)


def _report(d: Path) -> dict:
    assert (d / "report.md").is_file() and (d / "report.png").stat().st_size > 1000
    return json.loads((d / "report.json").read_text())


def test_peer_missing_still_reports(tiny_qwen3moe_gguf: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    empty = tmp_path / "no_peer"
    empty.mkdir()
    out = tmp_path / "rep"
    argv = ["bench", "-m", str(tiny_qwen3moe_gguf[1]), *FAST, "--reps", "1"]
    rc = main([*argv, "--compare", "llamacpp", "--peer-lib", str(empty), "--report", str(out)])
    assert rc == 1
    rep = _report(out)
    tandem, llama = rep["rows"]
    assert (tandem["engine"], tandem["status"], llama["engine"], llama["status"]) == (
        "tandem",
        "ok",
        "llamacpp",
        "peer missing",
    )
    assert tandem["pp_tok_s"]["4"] > 0 and tandem["pp_tok_s"]["8"] > 0 and tandem["tg_tok_s"] > 0
    assert tandem["vram_used_bytes"] is None and rep["machine"]["gpu_note"] == "no GPU"  # this CPU machine
    assert "no llama_cpp package" in llama["error"]
    assert rep["exit_code"] == 1 and rep["finished"]
    md = (out / "report.md").read_text()
    assert "| tandem | `cpu` | ok |" in md and "peer missing" in md and "no GPU" in md
    if Path("/proc/cpuinfo").exists():  # the CPU's generation and features, which tell machines apart
        assert rep["machine"]["cpu_id"].count("/") == 2 and "family/model/stepping" in md
    assert "| tandem | `cpu` | ok |" in capsys.readouterr().out


def test_timeout_and_crash_rows(
    tiny_qwen3moe_gguf: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(INJECT_ENV, "hang:tandem,crash:llamacpp")
    out = tmp_path / "rep"
    argv = ["bench", "-m", str(tiny_qwen3moe_gguf[1]), *FAST, "--reps", "3", "--timeout", "1"]
    assert main([*argv, "--compare", "llamacpp", "--peer-lib", str(tmp_path), "--report", str(out)]) == 1
    rep = _report(out)
    tandem, llama = rep["rows"]
    assert tandem["status"] == "timeout" and tandem["error"].startswith("timed out after 1 s")
    assert llama["status"] == "failed" and "exit status 3" in llama["error"] and "injected crash" in llama["error"]
    assert tandem["reps_done"] == llama["reps_done"] == 0 and rep["exit_code"] == 1
    md = (out / "report.md").read_text()
    assert "| tandem | `cpu` | timeout |" in md and "| llama.cpp | `cpu` | failed |" in md and "injected crash" in md


def test_run_worker_outcomes() -> None:
    ok = run_worker([sys.executable, "-c", "print('x'); print('TANDEM_BENCH_RESULT {\"a\": 1}')"], 30)
    assert (ok.status, ok.result) == ("ok", {"a": 1})
    garbage = run_worker([sys.executable, "-c", "print('no result')"], 30)
    assert garbage.status == "failed" and "no result line" in (garbage.error or "")
    crash = run_worker([sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(5)"], 30)
    assert crash.status == "failed" and crash.error == "exit status 5\nboom"
    missing = run_worker([sys.executable, "-c", "import sys; sys.exit(4)"], 30, peer=True)
    assert missing.status == "peer missing"
    slow = run_worker([sys.executable, "-c", "import time; time.sleep(30)"], 0.3)
    assert slow.status == "timeout" and slow.wall_s < 10


def _fake_worker(reps: int, then: str, every_s: float = 0.0) -> list[str]:
    """A worker that prints `reps` repetition lines (one every `every_s`), then does `then`."""
    code = f"""
import json, sys, time
for r in range({reps}):
    time.sleep({every_s})
    print({REP_MARKER!r} + json.dumps({{"rep": r, "pp_s": {{"4": [0.1]}}, "tg_s": [0.2]}}), flush=True)
{then}
"""
    return [sys.executable, "-c", code]


def test_run_worker_keeps_the_repetitions_before_a_failure() -> None:
    seen: list[dict] = []
    crash = run_worker(_fake_worker(1, "print('boom', file=sys.stderr); sys.exit(3)"), 30, on_rep=seen.append, reps=3)
    assert crash.status == "failed" and [r["rep"] for r in crash.reps] == [0] and seen == crash.reps
    assert crash.error == "exit status 3 in repetition 2 of 3, after 1 of 3 repetitions\nboom"
    hang = run_worker(_fake_worker(2, "time.sleep(60)"), 1.0, reps=3)
    assert hang.status == "timeout" and len(hang.reps) == 2 and hang.wall_s < 10
    assert hang.error == "timed out after 1 s in repetition 3 of 3, after 2 of 3 repetitions"
    assert hang.first_rep_s is not None and hang.first_rep_s < 5
    # The watchdog is per repetition: 4 repetitions of 0.4 s each outlast a 1 s timeout, and finish.
    tail = "print('TANDEM_BENCH_RESULT ' + json.dumps({'ok': True}))"
    steady = run_worker(_fake_worker(4, tail, every_s=0.4), 1.0, reps=4)
    assert steady.status == "ok" and len(steady.reps) == 4 and steady.wall_s > 1.0
    import time

    cut = run_worker(_fake_worker(1, "time.sleep(60)"), 30, deadline=time.monotonic() + 1.0, reps=3)
    assert cut.status == "budget" and len(cut.reps) == 1 and cut.wall_s < 10


def test_a_crash_keeps_the_repetitions_before_it_and_ends_the_row(
    tiny_qwen3moe_gguf: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash in repetition 2 of a row's first process (2 of --reps 3) keeps repetition 1 in the report, and the
    row's second process does not run."""
    monkeypatch.setenv(INJECT_ENV, "crash@1:tandem")
    empty = tmp_path / "no_peer"
    empty.mkdir()
    out = tmp_path / "rep"
    argv = ["bench", "-m", str(tiny_qwen3moe_gguf[1]), *FAST, "--reps", "3", "--matrix", "all,cpu-moe"]
    assert main([*argv, "--compare", "llamacpp", "--peer-lib", str(empty), "--report", str(out)]) == 1
    rep = _report(out)
    tandem = [r for r in rep["rows"] if r["engine"] == "tandem"]
    assert [r["placement"] for r in tandem] == ["cpu", "cpu --cpu-moe"]
    for row in tandem:
        assert row["status"] == "failed" and row["reps_done"] == 1 and len(row["process_wall_s"]) == 1
        assert row["error"].startswith("exit status 3 in repetition 2 of 2, after 1 of 2 repetitions")
        assert "injected crash" in row["error"]
        assert row["pp_tok_s"]["4"] > 0 and row["tg_tok_s"] > 0 and row["load_s"] > 0 and row["warmup_s"] > 0
        assert [r["rep"] for r in row["runs"]] == [0]
    md = (out / "report.md").read_text()
    assert "| tandem | `cpu` | failed | 1/3 |" in md


def test_one_process_runs_every_repetition(tiny_qwen3moe_gguf: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "rep"
    argv = ["bench", "-m", str(tiny_qwen3moe_gguf[1]), *FAST, "--reps", "3", "--report", str(out)]
    assert main(argv) == 0
    (row,) = _report(out)["rows"]
    assert (row["status"], row["reps_done"], len(row["process_wall_s"])) == ("ok", 3, 1)
    assert [r["rep"] for r in row["runs"]] == [0, 1, 2] and [r["seed"] for r in row["runs"]] == [0, 1, 2]
    assert len({r["load_s"] for r in row["runs"]}) == 1  # one load, one warm-up, for all three
    assert "| tandem | `cpu` | ok | 3/3 |" in (out / "report.md").read_text()


@pytest.mark.parametrize(
    "extra",
    [["--pp", "0"], ["--matrix", "nonsense"], ["--n-cpu-moe", "9"], ["--timeout", "0"], ["--pp", "60,8", "-c", "64"],
     ["--process-reps", "0"]],
)
def test_usage_errors_exit_2(tiny_qwen3moe_gguf: tuple[Path, Path], tmp_path: Path, extra: list[str]) -> None:
    argv = ["bench", "-m", str(tiny_qwen3moe_gguf[1]), "--tg", "8", "--report", str(tmp_path / "r"), *extra]
    assert main(argv) == 2
    assert not (tmp_path / "r").exists()


def test_report_path_that_is_a_file_is_a_usage_error(tiny_qwen3moe_gguf: tuple[Path, Path], tmp_path: Path) -> None:
    mine = tmp_path / "notes.txt"
    mine.write_text("a user's file")
    assert main(["bench", "-m", str(tiny_qwen3moe_gguf[1]), "--tg", "8", "--report", str(mine)]) == 2
    assert mine.read_text() == "a user's file"


@pytest.mark.parametrize(
    "extra", [["--matrix", "nonsense"], ["--peer-lib", "/x"], ["--budget", "60"], ["--process-reps", "2"]]
)
def test_matrix_options_are_never_ignored(tiny_qwen3moe_gguf: tuple[Path, Path], extra: list[str]) -> None:
    """Without --compare or --report, --matrix still runs its placements (its bad value is an error); the options
    that only such runs read are errors without them."""
    assert main(["bench", "-m", str(tiny_qwen3moe_gguf[1]), "--tg", "8", *extra]) == 2


def test_bad_pp_list_is_an_argparse_error() -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", "--pp", "512,abc"])
    assert e.value.code == 2


def test_plain_bench_takes_a_pp_list(tiny_qwen3moe_gguf: tuple[Path, Path], capsys) -> None:
    assert main(["bench", "-m", str(tiny_qwen3moe_gguf[1]), *FAST, "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "prefill pp4:" in out and "prefill pp8:" in out and "decode  tg2:" in out


def _peer_importable() -> bool:
    lib = default_peer_lib("cpu")
    if not (lib / "llama_cpp" / "__init__.py").is_file():
        return False
    probe = subprocess.run([sys.executable, "-c", "import llama_cpp"], env={"PYTHONPATH": str(lib)}, timeout=60)
    return probe.returncode == 0


@pytest.mark.skipif(not _peer_importable(), reason="llama-cpp-python CPU build not there (scripts/build_llamacpp.sh)")
def test_side_by_side_with_llamacpp(tiny_qwen3moe_gguf: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "rep"
    argv = ["bench", "-m", str(tiny_qwen3moe_gguf[1]), *FAST, "--reps", "1", "--cpu-moe"]
    assert main([*argv, "--compare", "llamacpp", "--report", str(out)]) == 0
    rep = _report(out)
    tandem, llama = rep["rows"]
    assert tandem["status"] == llama["status"] == "ok" and rep["exit_code"] == 0
    assert llama["llama_placement"] == {"n_gpu_layers": 0, "main_gpu": 0, "overrides": [[LLAMA_ALL_EXPERTS, "cpu"]]}
    assert llama["pp_tok_s"]["8"] > 0 and llama["tg_tok_s"] > 0 and llama["peak_rss_bytes"] > 0
    assert set(tandem["ratio_tandem_over_llamacpp"]) == {"pp4", "pp8", "tg2"}
    # its defaults (flash attention auto) compute attention on the CPU with flash attention, and the report says so
    assert llama["runs"][0]["flash_attention"] == "on"
    md = (out / "report.md").read_text()
    assert "×" in md and "llama.cpp's flash attention (its default `-fa auto`, as its log resolved it)" in md


def test_budget_rows(tiny_qwen3moe_gguf: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "rep"
    argv = ["bench", "-m", str(tiny_qwen3moe_gguf[1]), *FAST, "--budget", "0.001", "--report", str(out)]
    assert main(argv) == 1
    (row,) = _report(out)["rows"]
    assert row["status"] == "not run" and "time budget" in row["error"]
    cut = Row("tandem", 0, Placement(), runs=[{"pp_s": {}, "tg_s": [], "load_s": 1.0}])
    _stop(cut, 3, "the time budget was spent")
    assert (cut.status, cut.error) == ("partial", "the time budget was spent after 1 of 3 repetitions")


def test_report_is_written_when_the_chart_cannot_be_drawn(
    tiny_qwen3moe_gguf: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """matplotlib once failed to import on the GPU image: the report must still be whole and say so."""
    import tandem.bench.plot as plot

    def broken(*args: object, **kwargs: object) -> None:
        raise SystemError("ft2font returned NULL")

    monkeypatch.setattr(plot, "render_png", broken)
    empty = tmp_path / "no_peer"
    empty.mkdir()
    out = tmp_path / "rep"
    argv = ["bench", "-m", str(tiny_qwen3moe_gguf[1]), *FAST, "--reps", "1"]
    assert main([*argv, "--compare", "llamacpp", "--peer-lib", str(empty), "--report", str(out)]) == 1
    md = (out / "report.md").read_text()
    assert "report.png was not drawn: SystemError: ft2font returned NULL" in md
    assert "| tandem | `cpu` | ok |" in md and (out / "report.json").is_file() and not (out / "report.png").exists()


def test_worker_deadline_stops_after_the_first_repetition(tiny_qwen3moe_gguf: tuple[Path, Path], capsys) -> None:
    """--deadline (the orchestrator's share of --budget): no repetition starts that would end past it."""
    from tandem.bench import worker

    model = str(tiny_qwen3moe_gguf[1])
    assert worker.main(["-m", model, "--device", "cpu", *FAST, "--reps", "3", "--deadline", "1"]) == 0
    out = capsys.readouterr().out
    assert len(parse_reps(out)) == 1
    result = parse_result(out)
    assert result is not None and (result["reps_done"], result["reps_asked"], result["stopped"]) == (1, 3, "deadline")


def _a_report(tiny_qwen3moe_gguf: tuple[Path, Path], tmp_path: Path) -> Path:
    out = tmp_path / "rep"
    if not (out / "report.json").is_file():
        empty = tmp_path / "no_peer"
        empty.mkdir(exist_ok=True)
        argv = ["bench", "-m", str(tiny_qwen3moe_gguf[1]), *FAST, "--reps", "1", "--matrix", "all,cpu-moe"]
        main([*argv, "--compare", "llamacpp", "--peer-lib", str(empty), "--report", str(out)])
    return out


def _is_png(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    import struct

    return struct.unpack(">II", data[16:24])


def test_png_is_drawn_in_a_fresh_interpreter(tiny_qwen3moe_gguf: tuple[Path, Path], tmp_path: Path) -> None:
    out = _a_report(tiny_qwen3moe_gguf, tmp_path)
    assert "report.png" not in (out / "report.md").read_text()  # matplotlib drew it: no note
    png = tmp_path / "again.png"
    assert plot.render_png(out / "report.json", png) is None
    assert _is_png(png)[0] > 500
    # The subprocess imports matplotlib and nothing of tandem's (which would bring torch with it).
    cmd = plot._subprocess_cmd(out / "report.json", tmp_path / "probe.png")
    probe = f"""
import runpy, sys
sys.argv = {cmd[-3:]!r}
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit:
    pass
print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "tandem", "ggml", "triton", "matplotlib"))[:3])
"""
    shown = subprocess.run([*cmd[:-3], "-c", probe], capture_output=True, text=True, timeout=120, check=True).stdout
    assert "matplotlib" in shown and "torch" not in shown and "tandem" not in shown


def test_png_fallbacks(tiny_qwen3moe_gguf: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """matplotlib's subprocess fails (as on the GPU image): Pillow draws it; without Pillow, the bare writer."""
    out = _a_report(tiny_qwen3moe_gguf, tmp_path)
    monkeypatch.setenv(plot.INJECT_ENV, "fail")
    note = plot.render_png(out / "report.json", tmp_path / "pil.png")
    assert note is not None and note.startswith("report.png drawn with Pillow") and "injected matplotlib" in note
    assert _is_png(tmp_path / "pil.png")[0] >= 600
    monkeypatch.setenv(plot.INJECT_ENV, "hang")
    monkeypatch.setitem(sys.modules, "PIL", None)  # import PIL -> ImportError
    note = plot.render_png(out / "report.json", tmp_path / "bare.png", timeout_s=3)
    assert note is not None and "plain bars without text" in note and "timed out after 3 s" in note
    assert "Pillow too (ModuleNotFoundError" in note
    width, height = _is_png(tmp_path / "bare.png")
    monkeypatch.delitem(sys.modules, "PIL")
    from PIL import Image

    with Image.open(tmp_path / "bare.png") as img:  # a PNG any reader takes, with coloured bars in it
        assert img.size == (width, height) and plot._rgb(plot.COLORS["tandem"]) in {c for _, c in img.getcolors(9999)}


def test_report_md_says_how_the_png_was_drawn(
    tiny_qwen3moe_gguf: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(plot.INJECT_ENV, "fail")
    out = tmp_path / "rep"
    argv = ["bench", "-m", str(tiny_qwen3moe_gguf[1]), *FAST, "--reps", "1", "--report", str(out)]
    assert main(argv) == 0
    md = (out / "report.md").read_text()
    assert "_report.png drawn with Pillow: matplotlib's subprocess failed (exit status 1: SystemError: injected" in md
    assert _is_png(out / "report.png")


def test_budget_leaves_later_rows_their_first_repetition(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each worker's --deadline holds back the first-repetition time of the rows still to run."""
    import time

    import tandem.bench.compare as compare
    from tandem.bench.spec import BenchSettings

    deadlines: list[float] = []

    def fake_run_worker(cmd: list[str], timeout_s: float, **kw: object) -> compare.RunOutcome:
        deadlines.append(float(cmd[cmd.index("--deadline") + 1]) - time.time())
        rep = {"pp_s": {"4": [0.1]}, "tg_s": [0.2], "load_s": 1.0, "peak_rss_bytes": 1, "vram": {"used_bytes": None}}
        kw["on_rep"](rep)  # type: ignore[operator]
        return compare.RunOutcome("ok", result={**rep, "reps_done": 1}, reps=[rep], first_rep_s=10.0)

    monkeypatch.setattr(compare, "run_worker", fake_run_worker)
    settings = BenchSettings(model="m.gguf", threads=1, pp=(4,), tg=2, reps=1, n_ctx=64, n_batch=8, budget_s=100)
    placements = [Placement(), Placement(cpu_moe=True), Placement(n_cpu_moe=1)]
    report = compare.Comparison(settings, placements, engines=("tandem",)).run(log=io.StringIO())
    assert report.all_ok
    # The first process knows no first-repetition time yet; the second holds back 10 s for the third.
    assert deadlines[0] == pytest.approx(100, abs=2) and deadlines[1] == pytest.approx(90, abs=2)
    assert deadlines[2] == pytest.approx(100, abs=2)


def _fake_workers(monkeypatch: pytest.MonkeyPatch, tg_s: list[float]) -> list[tuple[str, int]]:
    """Worker processes replaced by one that reports each repetition at once, its decode time the next of `tg_s`;
    returns the (engine, repetitions) of each process run, filled as they run."""
    import tandem.bench.compare as compare

    ran: list[tuple[str, int]] = []
    times = iter(tg_s)

    def fake_run_worker(cmd: list[str], timeout_s: float, **kw: object) -> compare.RunOutcome:
        engine = "tandem" if "tandem.bench.worker" in cmd else "llamacpp"
        reps = int(cmd[cmd.index("--reps") + 1])
        ran.append((engine, reps))
        got = []
        for _ in range(reps):
            rep = {"pp_s": {"4": [0.1]}, "tg_s": [next(times)], "load_s": 1.0, "peak_rss_bytes": 1}
            rep["vram"] = {"used_bytes": None, "source": None}
            kw["on_rep"](rep)  # type: ignore[operator]
            got.append(rep)
        return compare.RunOutcome("ok", result={**got[-1], "reps_done": reps}, reps=got, first_rep_s=1.0)

    monkeypatch.setattr(compare, "run_worker", fake_run_worker)
    return ran


def test_two_processes_per_row_in_mirrored_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """With two engines and --reps 3, each placement runs tandem (2 repetitions), llama.cpp (2), llama.cpp (1),
    tandem (1): a slow spell of the machine falls on both engines. Each row ends with all 3 repetitions."""
    import tandem.bench.compare as compare
    from tandem.bench.spec import BenchSettings

    tg_s = [0.2, 0.25, 0.4, 0.5, 0.8, 1.0] * 2  # each repetition its own decode time: 10, 8, 5, 4, 2.5, 2 tok/s
    ran = _fake_workers(monkeypatch, tg_s)
    settings = BenchSettings(model="m.gguf", threads=1, pp=(4,), tg=2, reps=3, n_ctx=64, n_batch=8)
    peer = {"n_gpu_layers": -1, "overrides": []}
    comparison = compare.Comparison(settings, [Placement(), Placement(cpu_moe=True)], llama={0: peer, 1: peer})
    report = comparison.run(log=io.StringIO())
    assert report.all_ok and all(row.reps_done == 3 and len(row.walls) == 2 for row in report.rows)
    once = [("tandem", 2), ("llamacpp", 2), ("llamacpp", 1), ("tandem", 1)]
    assert ran == once + once
    text = render_markdown(report)
    assert "in the order tandem, llama.cpp, llama.cpp, tandem" in text
    # Each row's decode speeds, repetition by repetition in the order run (tandem: its first process, then its last).
    assert "- tandem `cpu`: 10.0, 8.0, 2.0\n" in text and "- llama.cpp `cpu`: 5.0, 4.0, 2.5\n" in text
    # Round by round: 9 against 4.5 tok/s (the medians of the first processes), then 2 against 2.5.
    assert "- `cpu`: 2.00×, 0.80×\n" in text


def test_process_reps_takes_turns_in_more_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """--process-reps 2 with --reps 5: three processes per engine (2, 2, 1 repetitions), the engines' order mirrored
    from round to round, so that no engine runs two rounds in a row at the same spell of the machine."""
    import tandem.bench.compare as compare
    from tandem.bench.spec import BenchSettings

    ran = _fake_workers(monkeypatch, [0.2] * 10)
    settings = BenchSettings(model="m.gguf", threads=1, pp=(4,), tg=2, reps=5, n_ctx=64, n_batch=8, process_reps=2)
    assert settings.process_plan(2) == [2, 2, 1] and settings.process_plan(1) == [2, 2, 1]
    peer = {"n_gpu_layers": -1, "overrides": []}
    report = compare.Comparison(settings, [Placement()], llama={0: peer}).run(log=io.StringIO())
    assert report.all_ok and all(row.reps_done == 5 and len(row.walls) == 3 for row in report.rows)
    assert ran == [("tandem", 2), ("llamacpp", 2), ("llamacpp", 2), ("tandem", 2), ("tandem", 1), ("llamacpp", 1)]
    assert (
        "3 worker processes per engine x placement, in the order tandem, llama.cpp, llama.cpp, tandem, and so "
        "on (each: load, one warm-up, then its repetitions: 2, 2, 1)" in render_markdown(report)
    )


def test_pcie_experts_goes_to_the_rows_with_experts_in_host_ram(
    tiny_qwen3moe_gguf: tuple[Path, Path], tmp_path: Path
) -> None:
    """`tandem bench --pcie-experts K --matrix ...`: the rows whose plan keeps experts in host RAM under a GPU get
    the flag on tandem's worker (each checked as loading would), the others (all on the GPU, the CPU) do not,
    llama.cpp's worker never does; a matrix without such a row is a usage error, not a flag left unused."""
    import tandem.bench.compare as compare
    from tandem.bench.spec import BenchSettings
    from tandem.convert import convert_hf
    from tandem.gguf import open_gguf
    from tandem.models import read_config
    from tandem.placement import RuntimeShape, plan_placement

    q8 = convert_hf(tiny_qwen3moe_gguf[0], tmp_path / "tiny-q8_0.gguf", "q8_0")  # a type the GPU kernels read
    f, cfg = open_gguf(q8), read_config(open_gguf(q8))
    placements = [*parse_matrix("cpu-moe,n-cpu-moe=half,all", Placement(device="cuda"), cfg.n_layers), Placement()]
    plans = [plan_placement(f, cfg, p.request(), RuntimeShape(n_ctx=64)) for p in placements]
    rows = compare.pcie_rows(f, cfg, plans, 1)
    assert rows == {0, 1} and compare.pcie_rows(f, cfg, plans, 0) == frozenset()
    with pytest.raises(TandemError, match="--pcie-experts 1: no row keeps routed experts in host RAM"):
        compare.pcie_rows(f, cfg, plans[2:], 1)
    with pytest.raises(TandemError, match="--pcie-experts 2: this model selects 2 experts per token"):
        compare.pcie_rows(f, cfg, plans, 2)

    settings = BenchSettings(model=str(q8), threads=1, pp=(4,), tg=2, reps=1, n_ctx=64, n_batch=8, pcie_experts=1)
    peer = {"n_gpu_layers": -1, "overrides": []}
    comparison = compare.Comparison(settings, placements, llama=dict.fromkeys(range(4), peer), pcie_rows=rows)
    cmds = [comparison._cmd("tandem", i, 1) or [] for i in range(4)]
    assert ["--pcie-experts" in cmd for cmd in cmds] == [True, True, False, False]
    assert all(cmd[cmd.index("--pcie-experts") + 1] == "1" for cmd in cmds[:2])
    assert not any("--pcie-experts" in (comparison._cmd("llamacpp", i, 1) or []) for i in range(4))
    # bench --seed: both engines' workers draw their prompts from it
    reseeded = dataclasses.replace(settings, seed=1000)
    seeded = compare.Comparison(reseeded, placements, llama=dict.fromkeys(range(4), peer))
    for engine in ("tandem", "llamacpp"):
        cmd = seeded._cmd(engine, 0, 1) or []
        assert cmd[cmd.index("--seed") + 1] == "1000"
