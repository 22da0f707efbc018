"""What each `tandem` subcommand does; argument parsing lives in cli/main.py."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tandem.api import LLM, check_model_tensors, default_model_path
from tandem.errors import TandemError
from tandem.gguf import open_gguf
from tandem.models import read_config
from tandem.placement import (
    ExpertStats,
    PlacementRequest,
    RuntimeShape,
    check_one_gpu,
    expert_layer,
    plan_placement,
)
from tandem.placement.tp import check_tp_flags, plan_tensor_parallel
from tandem.runtime.devices import check_pcie_experts, resolve_device
from tandem.runtime.sampling import check_option
from tandem.state.kv_cache import CACHE_DTYPES
from tandem.tokenizer.builtin_templates import builtin_template
from tandem.tokenizer.chat_template import parse_template_variables, read_template_file


def _load(args: argparse.Namespace) -> LLM:
    """Load with a progress bar for large files, then say where the weights actually are."""
    path = args.model or default_model_path()
    size = Path(path).stat().st_size if Path(path).is_file() else 0
    with _LoadProgress(size) as bar:
        llm = LLM(
            path,
            dtype=args.dtype,
            progress=bar.update,
            device=args.device,
            n_ctx=args.ctx_size,
            threads=args.threads,
            cache_type=args.cache_type,
            n_batch=args.batch_size,
            n_ubatch=getattr(args, "ubatch_size", None),  # run, chat, serve (bench's runs are one per step)
            n_parallel=args.parallel,
            repack_experts=args.repack_experts,
            pcie_experts=args.pcie_experts,
            expert_stats=args.expert_stats,
            **_placement(args),
        )
    print(_placement_line(llm), file=sys.stderr)
    for notice in llm.notices:
        print(f"notice: {notice}", file=sys.stderr)
    return llm


def _placement_line(llm: LLM) -> str:
    """What was placed where, read back from the loaded tensors (not from the flags)."""
    totals = llm.placement_summary()
    parts = ", ".join(f"{device} {n / 2**20:,.0f} MiB" for device, n in sorted(totals.items()))
    offloaded = [n for n, d in llm.placed.items() if d == "cpu" and expert_layer(n) is not None]
    line = f"weights: {parts}"
    if offloaded and any(d != "cpu" for d in totals):
        line += f"; {len(offloaded)} expert tensors in host RAM (CPU experts)"
    return line


class _LoadProgress:
    """A rich progress bar while a large file loads; silent for small files or a non-terminal."""

    THRESHOLD = 1 << 30

    def __init__(self, file_bytes: int) -> None:
        self.enabled = file_bytes >= self.THRESHOLD and sys.stderr.isatty()
        self._progress = None
        self._task = None

    def __enter__(self) -> _LoadProgress:
        if self.enabled:
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

            self._progress = Progress(TextColumn("loading"), BarColumn(), DownloadColumn(), transient=True)
            self._progress.start()
            self._task = self._progress.add_task("load", total=None)
        return self

    def update(self, done: int, total: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=done, total=total)

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()


def _placement(args: argparse.Namespace) -> dict[str, object]:
    return {
        "cpu_moe": args.cpu_moe,
        "n_cpu_moe": args.n_cpu_moe,
        "override_tensor": args.override_tensor,
        "gpu_memory": args.gpu_memory,
        "moe_cache": args.moe_cache,
        "moe_cache_refresh": args.moe_cache_refresh,
        "tp": args.tp,
        "n_gpu_layers": args.n_gpu_layers,
    }


def _sampling(args: argparse.Namespace) -> dict[str, object]:
    return {
        "temperature": args.temp,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "repeat_penalty": args.repeat_penalty,
        "repeat_last_n": args.repeat_last_n,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "seed": args.seed,
        "stop": args.stop,
    }


# The numeric flags, by the API option that OPTION_LIMITS (runtime/sampling.py) checks them as.
_NUMERIC_FLAGS = {"ctx_size": "n_ctx", "batch_size": "n_batch", "ubatch_size": "n_ubatch", "parallel": "n_parallel",
                  "threads": "threads", "pcie_experts": "pcie_experts", "n_cpu_moe": "n_cpu_moe",
                  "n_predict": "max_tokens",
                  "temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                  "repeat_penalty": "repeat_penalty", "repeat_last_n": "repeat_last_n", "seed": "seed",
                  "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}  # fmt: skip


def check_flags(args: argparse.Namespace) -> None:
    """Every numeric flag the command has, in range, before anything is opened (one line naming the flag)."""
    for attr, option in _NUMERIC_FLAGS.items():
        value = getattr(args, attr, None)
        if value is not None:
            check_option(option, value)


def _template_options(args: argparse.Namespace) -> dict[str, Any]:
    """--chat-template-file and --chat-template-kwargs as LLM.chat's arguments, checked before the model loads."""
    file, kwargs, name = args.chat_template_file, args.chat_template_kwargs, args.chat_template
    given = {"--chat-template-file": file, "--chat-template-kwargs": kwargs, "--chat-template": name,
             "-sys/--system-prompt": getattr(args, "system_prompt", None)}  # fmt: skip
    if args.command == "run" and not args.chat and (flags := [f for f, v in given.items() if v is not None]):
        raise TandemError(f"{flags[0]} needs --chat (it concerns the chat template)")
    if file is not None and name is not None:
        raise TandemError("--chat-template and --chat-template-file both name a template: give one")
    if name is not None:
        builtin_template(name)  # an unknown name fails before the model loads
    return {
        "chat_template": read_template_file(file) if file is not None else None,
        "chat_template_name": name,
        "chat_template_kwargs": parse_template_variables(kwargs) if kwargs is not None else None,
    }


def _template_notice(llm: LLM, template: dict[str, Any]) -> None:
    """One line on stderr when the chat runs on tandem's built-in template because the file carries none."""
    fallback = llm.builtin_chat_template
    if fallback is not None and template["chat_template"] is None and template["chat_template_name"] is None:
        print(f"notice: the model has no chat template; using tandem's built-in '{fallback}' "
              "(--chat-template NAME or --chat-template-file FILE to choose another)", file=sys.stderr)  # fmt: skip


def _write_stream(pieces: Iterable[str], llm: LLM) -> str:
    """Print the pieces as they come, then a newline; returns the text. Says so on stderr when the context filled."""
    text = []
    for piece in pieces:
        text.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if llm.engine.context_full:
        sys.stdout.flush()
        print(f"notice: the context ({llm.n_ctx} tokens, -c) is full: generation stopped there", file=sys.stderr)
    return "".join(text)


def run(args: argparse.Namespace) -> int:
    check_flags(args)
    template = _template_options(args)
    llm = _load(args)
    try:
        if args.chat:
            messages = []
            if args.system_prompt:
                messages.append({"role": "system", "content": args.system_prompt})
            messages.append({"role": "user", "content": args.prompt})
            _template_notice(llm, template)
            pieces = llm.chat(
                messages, **template, max_tokens=args.n_predict, stream=True, **_sampling(args)
            )
        else:
            pieces = llm.generate(args.prompt, max_tokens=args.n_predict, stream=True, **_sampling(args))
            sys.stdout.write(args.prompt)
        _write_stream(pieces, llm)
    finally:
        llm.close()
    return 0


def chat(args: argparse.Namespace) -> int:
    check_flags(args)
    template = _template_options(args)
    llm = _load(args)
    llm.apply_chat_template([{"role": "user", "content": "hi"}], **template)  # fail now, not later
    _template_notice(llm, template)
    messages: list[dict[str, str]] = []
    if args.system_prompt:
        messages.append({"role": "system", "content": args.system_prompt})
    print("tandem chat: empty line or Ctrl-D to quit", file=sys.stderr)
    try:
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            reply = llm.chat(messages, **template, max_tokens=args.n_predict, stream=True, **_sampling(args))
            messages.append({"role": "assistant", "content": _write_stream(reply, llm)})
    finally:
        llm.close()
    return 0


def inspect(args: argparse.Namespace) -> int:
    """A dry run: metadata, quant mix and the placement plan, without loading weights or touching a GPU; the
    layers are built on the weights where they lie in the file, so that a tensor the architecture needs and the file
    lacks is the error `run` would give."""
    check_flags(args)
    f = open_gguf(args.model or default_model_path())
    cfg = read_config(f)
    request = PlacementRequest.from_flags(device=resolve_device(args.device, args.n_gpu_layers), **_placement(args))
    shape = RuntimeShape(
        n_ctx=args.ctx_size, n_batch=args.batch_size, cache_bytes_per_value=CACHE_DTYPES[args.cache_type].itemsize,
        n_seq=args.parallel,
    )  # fmt: skip
    stats = ExpertStats.open(args.expert_stats, f, cfg) if args.expert_stats else None
    counts = {} if stats is None else stats.placement_counts()
    plan = plan_placement(f, cfg, request, shape, **counts)  # type: ignore[arg-type]
    check_one_gpu(plan)
    check_pcie_experts(plan, f, cfg, args.pcie_experts)
    tp = None
    if request.tp > 1:  # each rank's slices and plan (docs/TENSOR_PARALLEL.md)
        check_tp_flags(request, args.pcie_experts)
        tp = plan_tensor_parallel(f, cfg, request, shape).to_dict()
    check_model_tensors(f, cfg)
    mix: Counter[str] = Counter()
    mix_bytes: Counter[str] = Counter()
    for t in f.tensors.values():
        mix[t.qtype.name] += 1
        mix_bytes[t.qtype.name] += t.n_bytes
    summary = {
        "path": str(f.path),
        "architecture": f.arch,
        "name": f.get("general.name"),
        "file_bytes": f.file_size,
        "n_tensors": len(f.tensors),
        "n_params": sum(t.n_elements for t in f.tensors.values()),
        "n_layers": cfg.n_layers,
        "hidden": cfg.hidden,
        "n_heads": cfg.n_heads,
        "n_kv_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "n_vocab": cfg.n_vocab,
        "context_length": cfg.context_length,
        "experts": None if cfg.moe is None else {"count": cfg.moe.n_experts, "active": cfg.moe.n_active},
        "quant_mix": {k: {"tensors": mix[k], "bytes": mix_bytes[k]} for k in sorted(mix)},
        "plan": {k: v for k, v in plan.to_dict().items() if k != "tensors"},
        "tp": tp,
        "pcie_experts": args.pcie_experts,
        "parallel": args.parallel,
        "n_ctx": args.ctx_size,
        "tensors": [
            {
                "name": t.name,
                "type": t.qtype.name,
                "shape": list(t.shape),
                "bytes": t.n_bytes,
                "device": plan.device_of(t.name),
            }
            for t in f.tensors.values()
        ],
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    _print_inspect(summary, show_tensors=args.tensors)
    return 0


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def _print_inspect(summary: dict, show_tensors: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    head = Table(show_header=False, box=None)
    for key in (
        "path",
        "architecture",
        "name",
        "n_layers",
        "hidden",
        "n_heads",
        "n_kv_heads",
        "head_dim",
        "n_vocab",
        "context_length",
        "experts",
        "n_tensors",
    ):
        head.add_row(key, str(summary[key]))
    head.add_row("parameters", f"{summary['n_params'] / 1e6:.1f} M")
    head.add_row("file size", f"{_mib(summary['file_bytes'])} MiB")
    console.print(head)
    mix = Table("type", "tensors", "MiB", title="quant mix")
    for k, v in summary["quant_mix"].items():
        mix.add_row(k, str(v["tensors"]), _mib(v["bytes"]))
    console.print(mix)
    plan = summary["plan"]
    placed = Table("device", "weights MiB", title=f"placement plan (--device {plan['request']['device']})")
    for device, n in sorted(plan["weight_bytes"].items()):
        placed.add_row(device, _mib(n))
    console.print(placed)
    if plan["request"]["device"] != "cpu":
        vram = Table("expected VRAM", "MiB")
        vram.add_row("weights", _mib(plan["weight_bytes"].get(plan["request"]["device"], 0)))
        vram.add_row(f"KV cache ({summary['parallel']} x {summary['n_ctx']} tokens)", _mib(plan["kv_bytes"]))
        vram.add_row("workspace", _mib(plan["workspace_bytes"]))
        vram.add_row("expert staging (prefill)", _mib(plan["staging_bytes"]))
        if plan["expert_cache"]["bytes"]:
            n = sum(plan["expert_cache"]["experts_per_layer"].values())
            vram.add_row(f"expert cache ({n} experts)", _mib(plan["expert_cache"]["bytes"]))
        vram.add_row("CUDA context, modules, allocator", _mib(plan["process_bytes"]))
        vram.add_row("total", _mib(plan["expected_gpu_bytes"]))
        console.print(vram)
    if plan["cpu_expert_layers"]:
        layers = plan["cpu_expert_layers"]
        console.print(f"experts on the CPU: {len(layers)} layers ({layers[0]}..{layers[-1]})")
    if plan["expert_cache"]["bytes"]:
        console.print(_cache_lines(plan["expert_cache"], summary["experts"]["count"]))
    if summary["pcie_experts"]:
        console.print(
            f"decode: the GPU computes {summary['pcie_experts']} of each token's {summary['experts']['active']} "
            "experts in host RAM, reading them there over PCIe (--pcie-experts; no VRAM)"
        )
    for note in plan["notes"]:
        console.print(note)
    if show_tensors:
        table = Table("tensor", "type", "shape", "MiB", "device", title="tensors")
        for t in summary["tensors"]:
            table.add_row(t["name"], t["type"], "x".join(map(str, t["shape"])), _mib(t["bytes"]), t["device"])
        console.print(table)
    if summary["tp"] is not None:
        _print_tensor_parallel(console, summary["tp"], show_tensors)


def _print_tensor_parallel(console: Any, tp: dict, show_tensors: bool) -> None:
    """Each rank's weights by device and expected VRAM (--tp N), and with --tensors each rank's slice of every
    tensor."""
    from rich.table import Table

    title = f"tensor parallel: {tp['tp']} ranks ({tp['backend']})"
    ranks = Table("rank", "device", "weights on it MiB", "host RAM MiB", "KV cache MiB", "workspace MiB",
                  "staging MiB", "expected VRAM MiB", title=title)  # fmt: skip
    for r in tp["ranks"]:
        gpu = r["device"] != "cpu"
        ranks.add_row(str(r["rank"]), r["device"], _mib(r["weight_bytes"].get(r["device"], 0)),
                      _mib(r["weight_bytes"].get("cpu", 0)) if gpu else "-", _mib(r["kv_bytes"]),
                      _mib(r["workspace_bytes"]), _mib(r["staging_bytes"]),
                      _mib(r["expected_gpu_bytes"]) if gpu else "-")  # fmt: skip
    console.print(ranks)
    if not show_tensors:
        return
    for r in tp["ranks"]:
        table = Table("tensor", "split", "shape", "MiB", "device", title=f"rank {r['rank']} ({r['device']})")
        for name, t in r["tensors"].items():
            table.add_row(name, t["split"], "x".join(map(str, t["shape"])), _mib(t["bytes"]), t["device"])
        console.print(table)


def _cache_lines(cache: dict, n_experts: int) -> str:
    """Experts cached in VRAM per layer, runs of layers with the same count on one line."""
    per = {int(k): v for k, v in cache["experts_per_layer"].items()}
    runs: list[tuple[int, int, int]] = []
    for layer in sorted(per):
        if runs and runs[-1][1] == layer - 1 and runs[-1][2] == per[layer]:
            runs[-1] = (runs[-1][0], layer, per[layer])
        else:
            runs.append((layer, layer, per[layer]))
    lines = [f"experts cached in VRAM beside host RAM ({cache['source']}):"]
    for a, b, n in runs:
        lines.append(f"  layer{'s' if b > a else ''} {a}{'..' + str(b) if b > a else ''}: {n} of {n_experts}")
    return "\n".join(lines)


def convert(args: argparse.Namespace) -> int:
    from tandem.convert import convert_hf

    out = convert_hf(Path(args.hf_dir), Path(args.outfile), outtype=args.outtype, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0


def synth(args: argparse.Namespace) -> int:
    """Write a random model with the shapes of a real one (`tandem synth --like NAME -o out.gguf`)."""
    from tandem.synth.writer import synthesize

    shown: list[bool] = []

    def progress(done: int, total: int) -> None:
        print(f"\r{done / 2**30:.1f} / {total / 2**30:.1f} GiB", end="", file=sys.stderr, flush=True)
        shown[:] = [True]

    try:
        r = synthesize(
            args.like, Path(args.outfile), layers=args.layers, quant=args.quant, seed=args.seed,
            overwrite=args.overwrite, progress=progress if sys.stderr.isatty() else None, routing=args.routing,
        )  # fmt: skip
    finally:
        if shown:  # end the progress line, also before an error message
            print(file=sys.stderr)
    rate = r.file_bytes / max(r.seconds, 1e-9) / 1e6
    print(
        f"wrote {r.path}: {r.plan.preset.name}, {r.plan.n_layers} layers, {r.plan.mix}, "
        f"{r.plan.n_params / 1e9:.2f}B parameters, {r.file_bytes / 2**30:.2f} GiB "
        f"in {r.seconds:.1f} s ({rate:.0f} MB/s)"
    )
    if r.routing:
        top = sum(float(f.target.max(axis=1).mean()) for f in r.routing) / len(r.routing)
        print(f"routing {r.plan.routing}: {len(r.routing)} routers fitted (the hottest expert of a layer is in "
              f"{top:.0%} of the tokens' picks)")  # fmt: skip
    return 0


def _bench_concurrency(args: argparse.Namespace, pp_sizes: list[int]) -> int:
    """`tandem bench --concurrency 1,4,16`: the engine with N sequences at once, in this process."""
    from rich.console import Console
    from rich.table import Table

    from tandem.bench.runner import run_concurrent

    sizes = args.concurrency
    if min(sizes) <= 0 or args.tg < 2 or len(pp_sizes) != 1:
        raise TandemError("--concurrency takes positive sizes, one --pp size and --tg of 2 or more")
    args.parallel = max(args.parallel, *sizes)
    check_option("n_parallel", args.parallel)
    llm = _load(args)
    try:
        results = run_concurrent(llm, sizes, pp_sizes[0], args.tg, args.reps, args.seed)
    finally:
        llm.close()
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
        return 0
    table = Table("sequences", f"prefill pp{pp_sizes[0]} tok/s", f"decode tg{args.tg} tok/s (all)", "per stream",
                  title=f"{Path(llm.file.path).name}, {args.reps} reps (median)")  # fmt: skip
    for r in results:
        table.add_row(str(r.n_seqs), f"{r.pp_tok_s:,.1f}", f"{r.tg_tok_s:,.1f}", f"{r.tg_tok_s_per_stream:,.1f}")
    Console().print(table)
    return 0


def _bench_drift(args: argparse.Namespace, pp_sizes: list[int]) -> int:
    """`tandem bench --drift N`: teacher-forced decode of a drifting text, tok/s per window (bench/drift.py)."""
    from rich.console import Console
    from rich.table import Table

    from tandem.bench.drift import check_drift, run_drift

    if len(pp_sizes) != 1:
        raise TandemError("--drift takes one --pp size")
    check_drift(args.drift, args.drift_window)
    llm = _load(args)
    try:
        name = Path(llm.file.path).name
        r = run_drift(llm, name, pp_sizes[0], args.tg, args.drift, args.drift_window, args.reps, args.seed)
    finally:
        llm.close()
    if args.json:
        print(json.dumps(r.as_dict(), indent=2))
        return 0
    table = Table("decoded tokens", "phase", "decode tok/s",
                  title=f"{r.model} ({r.routing}), a new phase every {r.every} tokens after pp{r.pp_tokens}, "
                        f"{r.reps} reps (median)")  # fmt: skip
    for w in r.windows:
        table.add_row(f"{w.start}..{w.start + w.tokens - 1}", str(w.phase), f"{w.tok_s:,.1f}")
    Console().print(table)
    return 0


def bench(args: argparse.Namespace) -> int:
    check_flags(args)
    if args.tp > 1:  # its figures (memory, speed) are one process's: rank 0's of N
        raise TandemError(f"--tp {args.tp}: bench is not built under tensor parallelism yet; time it with run or the "
                          "API (docs/TENSOR_PARALLEL.md)")  # fmt: skip
    if args.drift is not None and (args.compare or args.report or args.matrix):
        raise TandemError("--drift runs in this process: not with --compare, --report or --matrix")
    if args.compare or args.report or args.matrix:
        # Worker processes per engine x placement, a report that survives failures: tandem/bench/compare.py.
        from tandem.bench.compare import run_from_args

        return run_from_args(args)
    if args.peer_lib or args.budget is not None or args.process_reps is not None:
        raise TandemError("--peer-lib, --budget and --process-reps apply to runs with --compare, --report or --matrix")
    from tandem.bench.runner import run_bench

    pp_sizes = args.pp if isinstance(args.pp, list) else [args.pp]
    if min(pp_sizes) <= 0 or args.tg <= 0 or args.reps <= 0:
        raise TandemError("--pp, --tg and --reps must be positive")
    if max(pp_sizes) + args.tg > args.ctx_size:
        raise TandemError(f"--pp {max(pp_sizes)} + --tg {args.tg} exceed the context size {args.ctx_size} (-c)")
    if args.concurrency and args.drift is not None:
        raise TandemError("--concurrency and --drift are separate runs")
    if args.concurrency:
        return _bench_concurrency(args, pp_sizes)
    if args.drift is not None:
        return _bench_drift(args, pp_sizes)
    start = time.perf_counter()
    llm = _load(args)
    load_s = time.perf_counter() - start
    try:
        name = Path(llm.file.path).name
        results = [run_bench(llm, name, load_s, pp, args.tg, args.reps, args.seed) for pp in pp_sizes]
    finally:
        llm.close()
    if args.json:
        dicts = [r.as_dict() for r in results]
        print(json.dumps(dicts[0] if len(dicts) == 1 else dicts, indent=2))
        return 0
    for result in results:
        print(
            f"{result.model} ({result.arch}) {result.device}, {result.threads} threads\n"
            f"  prefill pp{result.pp_tokens}: {result.pp_tok_s:9.1f} tok/s\n"
            f"  decode  tg{result.tg_tokens}: {result.tg_tok_s:9.1f} tok/s\n"
            f"  load {result.load_s:.2f} s, peak RSS {result.peak_rss_bytes / 2**20:.0f} MiB"
        )
    return 0


def serve(args: argparse.Namespace) -> int:
    """`tandem serve`: the OpenAI- and Ollama-compatible HTTP server (src/tandem/server/), the port bound before
    the model loads on the engine's thread."""
    import ipaddress

    from tandem.server import ChatTemplate, listen
    from tandem.server import serve as run_server

    check_flags(args)
    if not 0 <= args.port <= 65535:
        raise TandemError(f"--port must be in 0..65535, got {args.port}")
    if args.api_key is not None and not args.api_key:
        raise TandemError("--api-key is empty")
    template = _template_options(args)
    sock = listen(args.host, args.port)

    def ready(llm: LLM) -> None:
        _template_notice(llm, template)
        host, port = sock.getsockname()[:2]
        print(f"tandem serve: http://{host}:{port}/v1 (OpenAI) and /api (Ollama), {llm.engine.pool.n_slots} slots "
              f"of {llm.n_ctx} tokens; Ctrl-C stops", file=sys.stderr)  # fmt: skip
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback and args.api_key is None:
            print(f"notice: listening on {host} without --api-key: anyone who can reach it can use the model",
                  file=sys.stderr)  # fmt: skip

    try:
        run_server(lambda: _load(args), sock, api_key=args.api_key, template=ChatTemplate(**template), on_ready=ready)
    finally:
        sock.close()
    return 0
