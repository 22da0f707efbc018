"""Where prefill and decode spend their time (run on the device), per placement.

    python bench/profile_step.py MODEL [--placements cpu-moe,all] [-t 16] [--pp 512] [--tg 64]

Placements: cpu-moe, cpu-moe-in-order (the same with the captured step in segments replayed in order, without
HostFlags: TANDEM_HOST_FLAGS=0; an A/B of what the hand-over through flags gains), cpu-moe-repacked (with
--repack-experts), n-cpu-moe-24, all.
For each placement: load time; prefill and decode speed; with experts in host RAM, the share of a decode
step spent in ggml's graphs on the CPU (the experts, timed around CPUKernels._compute) against
the rest (GPU segments, transfers, Python); the top CUDA kernels and copies of one prefill (torch
profiler). Also every CPU layer's expert FFN alone at one token, for several thread counts (the CPU's floor).

--memory: the same FFN graphs swept over every CPU layer (one token, a fresh random route per layer, as decode
reads them) with the experts' bytes in different memory: the file mapping as loaded (page-locked for the
streamed prefill), copies in anonymous memory with 4 KiB pages and with transparent huge pages, and the file
mapping again once unregistered. Which of these costs tandem's CPU experts their speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import mmap
import os
import statistics
import time
import warnings
from pathlib import Path

import numpy as np
import torch

import tandem
from tandem.cuda.host_memory import HostRegistration
from tandem.quant.expert_ffn import ExpertFFN
from tandem.quant.ggml_cpu import CPUKernels
from tandem.quant.ggml_weights import GGMLWeight
from tandem.weights.offload import HOST_FLAGS_ENV

PLACEMENTS = {
    "cpu-moe": {"cpu_moe": True},
    "cpu-moe-in-order": {"cpu_moe": True},  # the same, its captured step in segments, without HostFlags
    "cpu-moe-repacked": {"cpu_moe": True, "repack_experts": True},  # Q4_K experts from repacked copies
    "n-cpu-moe-24": {"n_cpu_moe": 24},
    "all": {},
}


def _sync() -> None:
    torch.cuda.synchronize()


def _prefill(llm: tandem.LLM, n: int) -> float:
    llm.engine.reset()
    _sync()
    start = time.perf_counter()
    llm.engine.feed(list(range(100, 100 + n)))
    _sync()
    return n / (time.perf_counter() - start)


def _decode(llm: tandem.LLM, n: int) -> float:
    engine = llm.engine
    logits = engine.feed(list(range(100, 164)))
    engine.append([int(torch.argmax(logits))])  # the first step is eager (compiles, captures next)
    logits = engine.append([int(torch.argmax(logits))])
    _sync()
    start = time.perf_counter()
    for _ in range(n):
        logits = engine.append([int(torch.argmax(logits))])
    _sync()
    return n / (time.perf_counter() - start)


def _host_share(llm: tandem.LLM, n: int) -> tuple[float, float, int, str]:
    """(ggml compute ms per token, step ms per token, ggml computes per token, how the computes of a token
    compare) over n decode steps: the time the CPU spends in ggml's graphs (the experts), measured around
    `CPUKernels._compute`, which the prepared host ops of the captured step call too. The comparison: the
    median compute among each token's first 4 against the rest, since the graph launch overlaps those."""
    spent: list[float] = []
    kernels = {id(k): k for k in _cpu_kernels(llm)}.values()

    def timed(fn):  # type: ignore[no-untyped-def]
        def run(graph):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            fn(graph)
            spent.append(time.perf_counter() - start)

        return run

    for k in kernels:
        k._compute = timed(k._compute)  # type: ignore[method-assign]
    try:
        rate = _decode(llm, n)
    finally:
        for k in kernels:
            del k._compute  # back to CPUKernels._compute
    # _decode ran 2 untimed steps before the n timed ones (the 64-token prompt streams its experts)
    per_token = round(len(spent) / (n + 2))
    host_ms = sum(spent) / (n + 2) * 1e3
    by_token = [spent[i : i + per_token] for i in range(0, per_token * (n + 2), per_token)][2:]
    first = statistics.median(t for token in by_token for t in token[:4]) * 1e6
    rest = statistics.median(t for token in by_token for t in token[4:]) * 1e6
    spread = f"median ggml compute: {first:.0f} us among each token's first 4, {rest:.0f} us for the rest"
    return host_ms, 1e3 / rate, per_token, spread


def _step_breakdown(llm: tandem.LLM, n: int) -> str:
    """Where the host's time goes in n replays of the captured decode step, per token: launching the graphs
    (CPU time of `CUDAGraph.replay`) and the host steps (waiting for the GPU's hand-over, then ggml, see
    _host_share). With a step in segments replayed in order, also the GPU time of the segments (CUDA
    events around each; a one-graph step waits on the host inside its graph, so its GPU time is the step)."""
    captured = llm.engine.runner.captured(1)
    graph = captured.graph if captured is not None else None
    if graph is None:
        return "(no captured decode step)"
    steps, host_steps = list(graph.steps), list(graph.host_steps)
    launch = [0.0]
    host = [0.0]
    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def timed_graph(step):  # type: ignore[no-untyped-def]
        def run() -> None:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if not graph.uses_flags:
                begin.record()
            start = time.perf_counter()
            step()
            launch[0] += time.perf_counter() - start
            if not graph.uses_flags:
                end.record()
                events.append((begin, end))

        return run

    def timed_host(step):  # type: ignore[no-untyped-def]
        def run() -> None:
            start = time.perf_counter()
            step()
            host[0] += time.perf_counter() - start

        return run

    def is_graph(step) -> bool:  # type: ignore[no-untyped-def]
        return isinstance(getattr(step, "__self__", None), torch.cuda.CUDAGraph)

    n_graphs = sum(is_graph(s) for s in steps)
    n_host = len(steps) - n_graphs + len(host_steps)
    graph.steps = [timed_graph(s) if is_graph(s) else timed_host(s) for s in steps]
    graph.host_steps = [timed_host(s) for s in host_steps]
    try:
        step_ms = 1e3 / _decode(llm, n)
    finally:
        graph.steps, graph.host_steps = steps, host_steps
    _sync()
    per = n + 2  # _decode replays 2 untimed steps before the n timed ones
    line = (
        f"decode step {step_ms:.2f} ms ({'flags' if graph.uses_flags else 'segments in order'}): "
        f"{n_graphs} graph(s) and {n_host} host steps per token; launching {launch[0] / per * 1e3:.2f} ms (CPU), "
        f"host steps (wait for the GPU + ggml) {host[0] / per * 1e3:.2f} ms"
    )
    if events:
        line += f", the segments on the GPU {sum(b.elapsed_time(e) for b, e in events) / per:.2f} ms"
    return line


def _cpu_graphs(llm: tandem.LLM) -> list[tuple[CPUKernels, ExpertFFN]]:
    """The (kernels, one-graph description) of each layer's experts kept in host RAM."""
    found = []
    for block in llm.model.blocks:
        ffn = block.ffn
        for branch in ("sparse", "routed"):  # Gemma 4's routed branch beside the dense one; Qwen3.5's beside
            ffn = getattr(ffn, branch, ffn)  # the shared expert
        experts = getattr(ffn, "experts", None)
        graph = getattr(getattr(experts, "on_cpu", experts), "_graph", None)
        if graph is not None:
            found.append(graph)
    return found


def _cpu_kernels(llm: tandem.LLM) -> list[CPUKernels]:
    """The CPUKernels instances behind the model's experts kept in host RAM."""
    return [kernels for kernels, _ in _cpu_graphs(llm)]


def _profile_prefill(llm: tandem.LLM, n: int, rows: int = 14) -> str:
    from torch.profiler import ProfilerActivity, profile

    llm.engine.reset()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.engine.feed(list(range(100, 100 + n)))
        _sync()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60)


def _profile_decode(llm: tandem.LLM, steps: int = 8, rows: int = 14) -> str:
    """Top CUDA kernels of a few decode steps (graph replays included)."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    logits = engine.feed(list(range(100, 164)))
    for _ in range(2):
        logits = engine.append([int(torch.argmax(logits))])
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            logits = engine.append([int(torch.argmax(logits))])
        _sync()
    return f"decode, {steps} steps:\n" + prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60
    )


def _kernel_trace(llm: tandem.LLM) -> str:
    """The GPU kernels and copies of ONE decode step, in the order they ran, with their durations: what a
    fused kernel would replace."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    logits = engine.feed(list(range(100, 164)))
    for _ in range(2):
        logits = engine.append([int(torch.argmax(logits))])
    _sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.append([int(torch.argmax(logits))])
        _sync()
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    total = sum(e.time_range.elapsed_us() for e in kernels)
    lines = [f"one decode step: {len(kernels)} GPU kernels/copies, {total / 1e3:.2f} ms of GPU time"]
    lines += [f"{e.time_range.elapsed_us():8.1f} us  {e.name[:110]}" for e in kernels]
    return "\n".join(lines)


def _sweep_ms(kernels: CPUKernels, ffns: list[ExpertFFN], tokens: int = 24, top_k: int = 8) -> float:
    """ms per token of every layer's expert FFN graph, one after the other, each on a fresh random route."""
    e, d, _ = ffns[0].down.shape
    k = ffns[0].stacks[0].shape[-1]
    x, w = torch.randn(1, k), torch.full((1, top_k), 1.0 / top_k)
    ids, out = torch.zeros(1, top_k, dtype=torch.int32), torch.empty(1, d)
    runs = [kernels.gated_experts_into(out, x, ffn, ids, w) for ffn in ffns]
    routes = torch.stack([torch.randperm(e)[:top_k] for _ in range((tokens + 4) * len(ffns))]).int()
    total = 0.0
    for i, run in enumerate(runs * (tokens + 4)):
        ids[0] = routes[i]
        start = time.perf_counter()
        run()
        if i >= 4 * len(runs):  # 4 untimed tokens first
            total += time.perf_counter() - start
    return total / tokens * 1e3


def _ggml_floor(llm: tandem.LLM, threads: list[int]) -> list[str]:
    """Every CPU layer's expert FFN graph swept per token, alone (no GPU work, no hand-offs), per thread count:
    what the decode step's ggml part would cost if nothing else ran. Compare with the step's ggml share."""
    ffns = [ffn for _, ffn in _cpu_graphs(llm)]
    if not ffns:
        return ["(no CPU experts in this placement)"]
    lines = []
    for n in threads:
        kernels = CPUKernels(n)
        ms = _sweep_ms(kernels, ffns)
        kernels.close()
        lines.append(f"ggml expert FFNs alone, 1 token, {len(ffns)} layers, {n} threads: {ms:.2f} ms per token")
    return lines


def _anonymous_copy(ffn: ExpertFFN, huge: bool) -> ExpertFFN:
    """`ffn` with its weights' bytes copied into fresh anonymous mappings (huge pages asked for, or refused)."""

    def copy(w: GGMLWeight | None) -> GGMLWeight | None:
        if w is None:
            return None
        m = mmap.mmap(-1, w.data.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private: THP applies
        m.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
        data = np.frombuffer(m, dtype=np.uint8)  # keeps the mapping alive
        data[:] = w.data
        return GGMLWeight(data=data, qtype=w.qtype, shape=w.shape)

    return dataclasses.replace(ffn, **{n: copy(getattr(ffn, n)) for n in ("gate", "up", "gate_up", "down")})


def _huge_pages() -> str:
    """This process's memory in huge pages (smaps_rollup), and the system's THP modes."""
    with open("/proc/self/smaps_rollup") as f:
        kinds = [line.split()[:2] for line in f if "PmdMapped" in line or line.startswith("AnonHugePages")]
    thp = Path("/sys/kernel/mm/transparent_hugepage")
    modes = [f"{n} {(thp / n).read_text().split('[')[1].split(']')[0]}" for n in ("enabled", "shmem_enabled")
             if (thp / n).exists() and "[" in (thp / n).read_text()]  # fmt: skip
    return ", ".join(f"{k.rstrip(':')} {int(v) >> 10} MiB" for k, v in kinds) + "; THP " + ", ".join(modes)


def _expert_memory(llm: tandem.LLM, threads: int) -> list[str]:
    """The expert FFN of every CPU layer swept per token (see --memory), with its bytes in different memory."""
    ffns = [ffn for _, ffn in _cpu_graphs(llm)]
    if not ffns:
        return ["(no CPU experts in this placement)"]
    per_token = sum(8 * sum(w.data.nbytes for w in f.stacks + (f.down,)) // f.down.shape[0] for f in ffns)
    kernels = CPUKernels(threads)
    small = [_anonymous_copy(f, huge=False) for f in ffns]
    huge = [_anonymous_copy(f, huge=True) for f in ffns]
    lines = [f"after the copies: {_huge_pages()}"]

    def sweep(round_: int, name: str, sets: list[ExpertFFN]) -> None:
        ms = _sweep_ms(kernels, sets)
        lines.append(f"round {round_}: {name}: {ms:.2f} ms/token ({per_token / ms / 1e6:.1f} GB/s), "
                     f"{ms / len(ffns) * 1e3:.0f} us/layer")  # fmt: skip

    memories = {"file mapping, page-locked (as loaded)": ffns, "anonymous, 4 KiB pages": small,
                "anonymous, huge pages": huge}  # fmt: skip
    for round_ in range(2):
        for name, sets in memories.items():
            sweep(round_, name, sets)
    with warnings.catch_warnings():  # isinstance on every object wakes torch's deprecated aliases
        warnings.simplefilter("ignore")
        pins = [o for o in gc.get_objects() if isinstance(o, HostRegistration)]
    for pin in pins:
        pin.close()
    for round_ in range(2):
        sweep(round_, f"file mapping, {len(pins)} registration(s) closed", ffns)
    kernels.close()
    return lines


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--placements", default="cpu-moe,all")
    p.add_argument("-t", "--threads", type=int, default=16)
    p.add_argument("--pp", type=int, default=512)
    p.add_argument("--tg", type=int, default=64)
    p.add_argument("--floor-threads", default="8,12,16")
    p.add_argument("--trace", help="append each placement's one-step kernel sequence to this file")
    p.add_argument("--memory", action="store_true", help="only the experts' memory A/B (see above), then stop")
    a = p.parse_args()
    summary = []
    for name in a.placements.split(","):
        os.environ[HOST_FLAGS_ENV] = "0" if name.endswith("-in-order") else "1"
        start = time.perf_counter()
        with tandem.LLM(a.model, device="cuda", threads=a.threads, n_ctx=2048, **PLACEMENTS[name]) as llm:
            load_s = time.perf_counter() - start
            print(f"== {name}: loaded in {load_s:.1f} s; notices: {llm.notices}")
            print(f"   VRAM plan {llm.plan.gpu_bytes() >> 20} MiB (staging {llm.plan.staging_bytes >> 20} MiB)")
            if a.memory:
                _prefill(llm, a.pp)  # touches the experts as a run would
                for line in _expert_memory(llm, a.threads):
                    print("   " + line)
                    summary.append(f"{name}: {line}")
                continue
            _prefill(llm, a.pp)  # warm-up: compiles and tunes the prefill kernels
            pp = max(_prefill(llm, a.pp) for _ in range(2))
            tg = _decode(llm, a.tg)
            peak = torch.cuda.max_memory_allocated() >> 20
            print(f"   pp{a.pp} {pp:.1f} tok/s, tg {tg:.1f} tok/s, torch peak {peak} MiB")
            line = f"{name}: pp{a.pp} {pp:.1f} tok/s, tg {tg:.1f} tok/s"
            if llm.model.host_boundaries:
                host_ms, step_ms, calls, spread = _host_share(llm, a.tg)
                print(
                    f"   decode step {step_ms:.2f} ms: ggml computes {host_ms:.2f} ms ({calls} per token), "
                    f"the rest (GPU segments, hand-offs, Python) {step_ms - host_ms:.2f} ms; {spread}"
                )
                line += f"; step {step_ms:.2f} ms = ggml {host_ms:.2f} + rest {step_ms - host_ms:.2f}"
                for floor in _ggml_floor(llm, [int(t) for t in a.floor_threads.split(",")]):
                    print("   " + floor)
            breakdown = _step_breakdown(llm, a.tg)
            print("   " + breakdown)
            line += "\n   " + breakdown
            print(_profile_prefill(llm, a.pp))
            print(_profile_decode(llm))
            if a.trace:
                with open(a.trace, "a") as f:
                    f.write(f"== {name}: " + _kernel_trace(llm) + "\n")
            summary.append(line)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    print("== summary")
    for line in summary:
        print(line)


if __name__ == "__main__":
    main()
