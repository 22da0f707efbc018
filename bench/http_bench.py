"""`tandem serve` against llama.cpp's `llama-server` over HTTP: N concurrent streaming requests of the same
prompt length and token count to each OpenAI-compatible server, per N, side by side.

    python bench/http_bench.py -m MODEL.gguf --concurrency 1,4,16 --prompt-tokens 128 --max-tokens 64 \\
        --tandem "tandem serve" --llama-server DIR/bin/llama-server --flags "-t 16 --cpu-moe" [--out DIR]

Either server is started here (`--tandem CMD`, `--llama-server CMD`: the command without model, port, slots or
context, which are added: `-m MODEL --host 127.0.0.1 --port P -np N -c CTX`, llama-server's -c being N times
tandem's per-slot one, plus `--cont-batching`; then --flags for both and --tandem-flags / --llama-flags for one),
on a free port, waited for on /health and stopped at the end; or one already running is measured (`--tandem-url`,
`--llama-url`). `-np` is the largest N unless given. Build llama-server with scripts/build_llamacpp_tools.sh
(--shared-libs for a thin build against llama-cpp-python's libraries).

The workload, the same for both: `/v1/completions` (or `--endpoint chat`), streamed, with usage
(`stream_options.include_usage`), greedy (temperature 0), `max_tokens`; every request's prompt starts with its
own tag (round and stream), so no server reuses another request's cached prefix, then a fixed text cut to
--prompt-tokens tokens with the model's tokenizer (tandem's). Both are sent llama-server's `ignore_eos`, so every
stream runs to max_tokens (the table shows the tokens each stream got). Both servers run at once and take turns:
one untimed warm-up round per N each, then --reps rounds per N, the order of the two swapped from one round to
the next.

Per server and N, over all its rounds: TTFT (send to the first streamed text) p50 and p99; per-stream decode tok/s
(the median over streams of (tokens - 1) / (last text - first text)); aggregate decode tok/s (per round: the
tokens after each stream's first over the time from the first stream's first token to the last stream's last,
the median over rounds); all-N decoding tok/s (per round: the tokens streamed while every stream decodes, from
the last stream's first token to the first stream's last, over that time; the median over rounds: the aggregate's
window holds the prefill of the streams that start later where a server streams each as soon as its prompt is
done, as tandem's chunked prefill does, and not where it computes every prompt first, as llama-server's batch of
-b 2048 tokens does; this one compares N streams decoding at once alone); end-to-end tok/s (all tokens over the
round's whole time, prefill included). Tokens are
the usage's completion_tokens (else the streamed chunks). Writes OUT/http.json (after every round) and
OUT/http.md, and prints the table; the servers' logs are OUT/server_tandem.log and OUT/server_llama.cpp.log.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import math
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

PASSAGE = (
    "The history of the lighthouse begins with fires lit on hilltops to guide ships home at night. Later, towers "
    "of stone carried lamps of oil behind glass, and keepers climbed the stairs each evening to trim the wicks and "
    "polish the lenses. A good lens could throw a beam many miles across the water, and every light along a coast "
    "flashed in its own pattern so that sailors could tell one harbour from another. "
)
TANDEM, LLAMA = "tandem", "llama.cpp"


@dataclass
class Stream:
    """One request's clock readings (time.perf_counter) and what its answer said."""

    sent: float
    first: float | None = None  # the first chunk with text
    last: float | None = None  # the last chunk with text
    chunks: int = 0  # chunks with text
    times: list[float] = field(default_factory=list)  # when each chunk with text came
    completion_tokens: int | None = None  # from usage
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None

    @property
    def tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.chunks

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def decode_tps(self) -> float | None:
        if self.first is None or self.last is None or self.tokens < 2 or self.last <= self.first:
            return None
        return (self.tokens - 1) / (self.last - self.first)


@dataclass
class Round:
    """N requests sent at once to one server."""

    streams: list[Stream]

    @property
    def ok(self) -> list[Stream]:
        return [s for s in self.streams if s.error is None and s.first is not None]

    @property
    def decode_tps(self) -> float | None:
        ok = self.ok
        if len(ok) < len(self.streams) or not ok:
            return None
        start, end = min(s.first or math.inf for s in ok), max(s.last or 0.0 for s in ok)
        tokens = sum(s.tokens - 1 for s in ok)
        return tokens / (end - start) if end > start and tokens > 0 else None

    @property
    def all_decoding_tps(self) -> float | None:
        """Tokens per second while every stream of the round decodes: from the last stream's first token to the
        first stream's last one (None when they do not overlap); a stream's tokens in that window are its chunks
        there times its tokens per chunk."""
        ok = self.ok
        if len(ok) < len(self.streams) or not ok:
            return None
        start, end = max(s.first or math.inf for s in ok), min(s.last or 0.0 for s in ok)
        if end <= start:
            return None
        tokens = sum(sum(start < t <= end for t in s.times) * s.tokens / s.chunks for s in ok)
        return tokens / (end - start) if tokens > 0 else None

    @property
    def e2e_tps(self) -> float | None:
        ok = self.ok
        if len(ok) < len(self.streams) or not ok:
            return None
        span = max(s.last or 0.0 for s in ok) - min(s.sent for s in ok)
        return sum(s.tokens for s in ok) / span if span > 0 else None


@dataclass
class Row:
    """One server at one N, over its rounds: what the table and the JSON show."""

    server: str
    n: int
    rounds: int = 0
    streams: int = 0
    errors: int = 0
    first_error: str | None = None
    tokens_min: int | None = None
    tokens_max: int | None = None
    tokens_asked: int = 0
    prompt_tokens: int | None = None
    finish_reasons: dict[str, int] = field(default_factory=dict)
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    ttft_ms_by_round: list[list[float]] = field(default_factory=list)  # each round's, sorted: when prompts started
    stream_tps: float | None = None
    agg_tps: float | None = None
    all_tps: float | None = None
    e2e_tps: float | None = None


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile, linear between the closest ranks (numpy's default)."""
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(server: str, n: int, rounds: list[Round], asked: int) -> Row:
    row = Row(server=server, n=n, rounds=len(rounds), tokens_asked=asked)
    streams = [s for r in rounds for s in r.streams]
    row.streams = len(streams)
    bad = [s for s in streams if s.error is not None or s.first is None]
    row.errors = len(bad)
    row.first_error = next((s.error or "no text streamed" for s in bad), None)
    ok = [s for s in streams if s not in bad]
    if not ok:
        return row
    row.tokens_min, row.tokens_max = min(s.tokens for s in ok), max(s.tokens for s in ok)
    prompts = [s.prompt_tokens for s in ok if s.prompt_tokens is not None]
    row.prompt_tokens = round(statistics.median(prompts)) if prompts else None
    for s in ok:
        reason = s.finish_reason or "none"
        row.finish_reasons[reason] = row.finish_reasons.get(reason, 0) + 1
    ttfts = [s.ttft * 1e3 for s in ok if s.ttft is not None]
    row.ttft_p50_ms, row.ttft_p99_ms = percentile(ttfts, 50), percentile(ttfts, 99)
    row.ttft_ms_by_round = [sorted(round(s.ttft * 1e3, 1) for s in r.ok if s.ttft is not None) for r in rounds]
    tps = [t for s in ok if (t := s.decode_tps) is not None]
    row.stream_tps = statistics.median(tps) if tps else None
    agg = [t for r in rounds if (t := r.decode_tps) is not None]
    row.agg_tps = statistics.median(agg) if agg else None
    every = [t for r in rounds if (t := r.all_decoding_tps) is not None]
    row.all_tps = statistics.median(every) if every else None
    e2e = [t for r in rounds if (t := r.e2e_tps) is not None]
    row.e2e_tps = statistics.median(e2e) if e2e else None
    return row


# -- the workload ---------------------------------------------------------------------------------------------
def prompt_body(model: str | None, n_tokens: int) -> tuple[str, int | None]:
    """The fixed text cut so that a request's prompt (BOS, its tag "[r000 s000] ", the text) is n_tokens tokens of
    the model's tokenizer, and that count as the tokenizer reads the whole prompt; without a model or tokenizer,
    about four characters a token (and None)."""
    text = PASSAGE * (n_tokens // 40 + 2)
    tag = "[r000 s000] "
    if model:
        try:
            from tandem.gguf.reader import open_gguf
            from tandem.tokenizer.tokenizer import Tokenizer

            tok = Tokenizer.from_metadata(open_gguf(model).metadata)
            ids = tok.encode(text, add_special=False, parse_special=False)
            want = max(1, n_tokens - len(tok.encode(tag, add_special=True, parse_special=False)))
            for _ in range(3):  # the tag and the text may tokenize differently together: correct the cut
                body = tok.decode(ids[:want])
                got = len(tok.encode(tag + body, add_special=True, parse_special=False))
                if got == n_tokens or want + n_tokens - got < 1:
                    break
                want += n_tokens - got
            return body, got
        except Exception as e:  # noqa: BLE001 - any tokenizer failure: fall back to the character estimate
            print(f"http_bench: no tokenizer ({type(e).__name__}: {e}); prompt length estimated", file=sys.stderr)
    return text[: max(1, 4 * n_tokens - len(tag))], None


def request_body(endpoint: str, prompt: str, max_tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}, **extra}  # fmt: skip
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def one_request(client: httpx.AsyncClient, url: str, body: dict[str, Any], chat: bool) -> Stream:
    s = Stream(sent=time.perf_counter())
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                s.error = f"HTTP {r.status_code}: {text[:300]}"
                return s
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    s.error = f"error event: {json.dumps(chunk['error'])[:300]}"
                    break
                now = time.perf_counter()
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if text:
                        s.first = s.first or now
                        s.last = now
                        s.chunks += 1
                        s.times.append(now)
                    if choice.get("finish_reason"):
                        s.finish_reason = choice["finish_reason"]
                usage = chunk.get("usage")
                if usage:
                    s.completion_tokens = usage.get("completion_tokens")
                    s.prompt_tokens = usage.get("prompt_tokens")
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        s.error = f"{type(e).__name__}: {e}"[:300]
    return s


# -- the servers ----------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Server:
    """One server: its name, base URL, the fields its requests add, and the process when started here."""

    name: str
    url: str
    extra: dict[str, Any]
    cmd: list[str] | None = None
    log: Path | None = None
    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float) -> None:
        if self.cmd is None:
            return
        assert self.log is not None
        print(f"http_bench: starting {self.name}: {shlex.join(self.cmd)}", file=sys.stderr, flush=True)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_die_with_parent)  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode} before it was ready:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready on {self.url}/health after {timeout:.0f} s:\n{self.tail()}")

    def tail(self, lines: int = 15) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


class ServerVram:
    """Each server's peak GPU memory, loading included: the memory the driver lists for the processes of its process
    group (`nvidia-smi --query-compute-apps`), sampled every `interval_s`. The servers run at once, so the device's
    used memory alone cannot tell them apart. Empty where nvidia-smi is missing or lists none of their processes."""

    def __init__(self, servers: Sequence[Server], interval_s: float = 0.5) -> None:
        self.servers, self.interval_s = servers, interval_s
        self.peak_mib: dict[str, int] = {}
        self._exe = shutil.which("nvidia-smi")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> ServerVram:
        if self._exe is not None:
            self._thread = threading.Thread(target=self._loop, name="server-vram", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        try:
            out = subprocess.run([str(self._exe), "--query-compute-apps=pid,used_memory",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return
        groups = {s.proc.pid: s.name for s in self.servers if s.proc is not None}
        for name, mib in vram_by_server(out, groups, os.getpgid).items():
            self.peak_mib[name] = max(self.peak_mib.get(name, 0), mib)

    def stop(self) -> dict[str, int]:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.sample()
        return self.peak_mib


def vram_by_server(smi_csv: str, groups: dict[int, str], getpgid: Any) -> dict[str, int]:
    """MiB per server from nvidia-smi's `pid, used_memory` lines: a process counts for the server whose process
    group (its pid, started in a session of its own) it belongs to; processes of others, gone or unreadable,
    do not."""
    used: dict[str, int] = {}
    for line in smi_csv.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 2 or not fields[0].isdigit() or not fields[1].isdigit():
            continue
        try:
            name = groups.get(getpgid(int(fields[0])))
        except (ProcessLookupError, PermissionError):
            continue
        if name is not None:
            used[name] = used.get(name, 0) + int(fields[1])
    return used


def _die_with_parent() -> None:
    """In a server's process before it starts: SIGTERM when the bench's process ends, even if killed (SIGKILL),
    so that no server outlives the bench holding the GPU's memory."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass


def _has(cmd: list[str], *names: str) -> bool:
    return any(a in names or any(a.startswith(n + "=") for n in names) for a in cmd)


def server_command(base: str, args: argparse.Namespace, port: int, llama: bool) -> list[str]:
    """The command line: `base` (its program and flags), then what is not in it yet of the model, address, slots
    and context, then --flags and the server's own flags."""
    cmd = shlex.split(base)
    # the server's own flags: after `serve` (tandem, also as `python -m tandem.cli.main serve`), else the program
    given = cmd[cmd.index("serve") + 1 :] if "serve" in cmd else cmd[1:]
    given += shlex.split(args.flags) + shlex.split(args.llama_flags if llama else args.tandem_flags)
    if cmd and cmd[0] == "tandem" and shutil.which("tandem") is None:
        cmd = [sys.executable, "-m", "tandem.cli.main", *cmd[1:]]
    if args.model and not _has(given, "-m", "--model"):
        cmd += ["-m", args.model]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    if not _has(given, "-np", "--parallel"):
        cmd += ["-np", str(args.np)]
    if not _has(given, "-c", "--ctx-size"):
        cmd += ["-c", str(args.ctx * args.np if llama else args.ctx)]  # llama-server's -c: all slots together
    if llama and not _has(given, "--cont-batching", "-cb", "--no-cont-batching", "-nocb"):
        cmd += ["--cont-batching"]
    cmd += shlex.split(args.flags) + shlex.split(args.llama_flags if llama else args.tandem_flags)
    return cmd


def make_servers(args: argparse.Namespace, out: Path) -> list[Server]:
    servers = []
    for name, base, url, llama in ((TANDEM, args.tandem, args.tandem_url, False),
                                   (LLAMA, args.llama_server, args.llama_url, True)):  # fmt: skip
        extra: dict[str, Any] = {"ignore_eos": True} if args.ignore_eos else {}
        if url:
            servers.append(Server(name, url.rstrip("/"), extra))
        elif base:
            port = free_port()
            cmd = server_command(base, args, port, llama)
            servers.append(Server(name, f"http://127.0.0.1:{port}", extra, cmd, out / f"server_{name}.log"))
    return servers


# -- the run --------------------------------------------------------------------------------------------------
async def run_round(
    client: httpx.AsyncClient, server: Server, n: int, tag: str, body: str, max_tokens: int, endpoint: str
) -> Round:
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    requests = [
        one_request(client, server.url + path,
                    request_body(endpoint, f"[{tag} s{i:03d}] {body}", max_tokens, server.extra), endpoint == "chat")
        for i in range(n)
    ]  # fmt: skip
    return Round(list(await asyncio.gather(*requests)))


def report(args: argparse.Namespace, servers: list[Server], rows: list[Row], notes: list[str]) -> dict[str, Any]:
    by = {(r.server, r.n): r for r in rows}
    ratios = []
    for n in args.concurrency:
        t, ll = by.get((TANDEM, n)), by.get((LLAMA, n))
        if t and ll:
            keys = ("agg_tps", "all_tps", "stream_tps", "e2e_tps", "ttft_p50_ms", "ttft_p99_ms")
            ratios.append({"n": n, **{k: _ratio(getattr(t, k), getattr(ll, k)) for k in keys}})
    config = {k: v for k, v in vars(args).items() if k not in ("out",)}
    config["commands"] = {s.name: shlex.join(s.cmd) if s.cmd else s.url for s in servers}
    return {"config": config, "rows": [asdict(r) for r in rows], "ratios": ratios, "notes": notes}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _tokens(row: dict[str, Any]) -> str:
    """A row's tokens per stream: 64, 60-64, or "60 of 64" when fewer than asked."""
    lo, hi, asked = row["tokens_min"], row["tokens_max"], row["tokens_asked"]
    if lo is None:
        return "-"
    text = str(lo) if lo == hi else f"{lo}-{hi}"
    return text if lo >= asked else f"{text} of {asked}"


def markdown(rep: dict[str, Any]) -> str:
    cfg = rep["config"]
    model = Path(cfg["model"]).name if cfg["model"] else "(each server's own)"
    lines = [
        f"HTTP streaming: {cfg['endpoint']}, prompt {cfg['prompt_tokens']} tokens, max_tokens {cfg['max_tokens']}, "
        f"{cfg['reps']} rounds per N, model {model}",
        "",
        "| N | server | agg decode tok/s | all N decoding tok/s | per-stream tok/s | e2e tok/s | TTFT p50 ms "
        "| TTFT p99 ms | tokens/stream | prompt tok | errors |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ratios = {r["n"]: r for r in rep["ratios"]}
    for n in cfg["concurrency"]:
        for r in (r for r in rep["rows"] if r["n"] == n):
            toks = _tokens(r)
            lines.append(
                f"| {n} | {r['server']} | {_f(r['agg_tps'])} | {_f(r['all_tps'])} | {_f(r['stream_tps'])} "
                f"| {_f(r['e2e_tps'])} "
                f"| {_f(r['ttft_p50_ms'])} | {_f(r['ttft_p99_ms'])} | {toks} | {r['prompt_tokens'] or '-'} "
                f"| {r['errors']}/{r['streams']} |"
            )
        if n in ratios:
            q = ratios[n]
            lines.append(
                f"| {n} | tandem ÷ llama.cpp | {_f(q['agg_tps'], 2)}× | {_f(q['all_tps'], 2)}× "
                f"| {_f(q['stream_tps'], 2)}× "
                f"| {_f(q['e2e_tps'], 2)}× | {_f(q['ttft_p50_ms'], 2)}× | {_f(q['ttft_p99_ms'], 2)}× | | | |"
            )
    if ratios:
        lines.append("- tandem ÷ llama.cpp: above 1 in the tok/s columns and below 1 in the TTFT ones is tandem ahead")
    lines += [f"- {note}" for note in rep["notes"]]
    errors = [f"- {r['server']} N={r['n']}: {r['first_error']}" for r in rep["rows"] if r["first_error"]]
    return "\n".join(lines + errors) + "\n"


async def measure(args: argparse.Namespace, servers: list[Server], out: Path, t0: float) -> dict[str, Any]:
    body, prompt_tokens = prompt_body(args.model, args.prompt_tokens)
    notes: list[str] = []
    if prompt_tokens is None:
        notes.append("prompt length estimated (no tokenizer): see the prompt tok column")
    rounds: dict[tuple[str, int], list[Round]] = {(s.name, n): [] for s in servers for n in args.concurrency}
    limits = httpx.Limits(max_connections=max(args.concurrency) + 4, max_keepalive_connections=max(args.concurrency))
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)

    def rows() -> list[Row]:
        return [summarize(s.name, n, rounds[s.name, n], args.max_tokens) for n in args.concurrency for s in servers]

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        if args.warmup_tokens > 0:
            for server in servers:
                for n in args.concurrency:
                    r = await run_round(client, server, n, f"w{n:03d}", body, args.warmup_tokens, args.endpoint)
                    bad = [s.error for s in r.streams if s.error]
                    if bad:
                        notes.append(f"{server.name} warm-up N={n}: {bad[0]}")
        k = 0
        for rep in range(args.reps):
            for i, n in enumerate(args.concurrency):
                order = servers if (rep + i) % 2 == 0 else servers[::-1]  # each N: the other first next round
                k += 1
                for server in order:
                    if args.budget and time.monotonic() - t0 > args.budget:
                        notes.append(f"budget of {args.budget:.0f} s spent: stopped before round {rep + 1} of N={n}")
                        return report(args, servers, rows(), notes)
                    r = await run_round(client, server, n, f"r{k:03d}", body, args.max_tokens, args.endpoint)
                    rounds[server.name, n].append(r)
                    (out / "http.json").write_text(json.dumps(report(args, servers, rows(), notes), indent=1))
    return report(args, servers, rows(), notes)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", help="the GGUF both servers load (and whose tokenizer cuts the prompt)")
    p.add_argument("--tandem", metavar="CMD", help='start tandem with CMD (e.g. "tandem serve")')
    p.add_argument("--llama-server", metavar="CMD", help="start llama-server with CMD (its path, optional flags)")
    p.add_argument("--tandem-url", help="measure a tandem server already running at this URL")
    p.add_argument("--llama-url", help="measure a llama-server already running at this URL")
    p.add_argument("--flags", default="", help='flags for both servers started here (e.g. "-t 16 --cpu-moe")')
    p.add_argument("--tandem-flags", default="", help="more flags for tandem")
    p.add_argument("--llama-flags", default="", help='more flags for llama-server (e.g. "-ngl 99")')
    p.add_argument("--concurrency", default="1,4,16", help="requests at once, a list (default 1,4,16)")
    p.add_argument("-np", "--parallel", dest="np", type=int, help="the servers' slots (default: the largest N)")
    p.add_argument("-c", "--ctx", type=int, help="context per slot (default: prompt + max tokens + 64)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt length in tokens (default 128)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--reps", type=int, default=3, help="timed rounds per server and N (default 3)")
    p.add_argument("--warmup-tokens", type=int, default=8, help="tokens of the warm-up round per N (0: none)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos")  # fmt: skip
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default 600)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds for a server to be ready")
    p.add_argument("--budget", type=float, default=0.0, help="stop starting rounds after this many seconds")
    p.add_argument("--out", default="out/http", help="folder of http.json, http.md and the logs")
    args = p.parse_args(argv)
    try:
        args.concurrency = sorted({int(n) for n in str(args.concurrency).split(",") if n.strip()})
    except ValueError:
        p.error(f"--concurrency must be a list of integers, got {args.concurrency!r}")
    if not args.concurrency or min(args.concurrency) < 1:
        p.error("--concurrency must list integers of 1 or more")
    if not (args.tandem or args.tandem_url or args.llama_server or args.llama_url):
        p.error("nothing to measure: give --tandem/--tandem-url and/or --llama-server/--llama-url")
    if args.max_tokens < 1 or args.prompt_tokens < 1 or args.reps < 1:
        p.error("--max-tokens, --prompt-tokens and --reps must be 1 or more")
    args.np = args.np or max(args.concurrency)
    args.ctx = args.ctx or args.prompt_tokens + max(args.max_tokens, args.warmup_tokens) + 64
    return args


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # SIGTERM (e.g. from `timeout`): unwind, so the servers are stopped


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    servers = make_servers(args, out)
    previous = signal.signal(signal.SIGTERM, _terminate)
    stopped = None
    vram = ServerVram(servers).start()
    try:
        for server in servers:
            server.start(args.start_timeout)
        rep = asyncio.run(measure(args, servers, out, t0))
    except RuntimeError as e:
        print(f"http_bench: {e}", file=sys.stderr)
        return 1
    except SystemExit as e:  # SIGTERM: the rounds done so far, as written after each
        stopped = e
    finally:
        peak_mib = vram.stop()
        for server in servers:
            server.stop()
        signal.signal(signal.SIGTERM, previous)
    if stopped is not None:
        if not (out / "http.json").exists():
            raise stopped
        rep = json.loads((out / "http.json").read_text())
        rep["notes"].append("stopped by SIGTERM: the rounds done until then")
    rep["peak_vram_mib"] = peak_mib
    if peak_mib:
        rep["notes"].append("peak VRAM MiB (the driver's figure for each server's processes, loading included): "
                            + ", ".join(f"{name} {mib:,}" for name, mib in peak_mib.items()))
    (out / "http.json").write_text(json.dumps(rep, indent=1))
    md = markdown(rep)
    (out / "http.md").write_text(md)
    print(md, end="")
    if stopped is not None:
        return 1
    return 0 if all(r["errors"] == 0 and r["rounds"] > 0 for r in rep["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
