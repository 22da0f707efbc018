"""Where a batched step spends its time (run on the device): N sequences decoding together, and N prompts
prefilled together, per placement.

    python bench/profile_batched.py MODEL [--placements all,cpu-moe] [--seqs 16] [-t 16] [--pp 128] [--ctx N]
        [--host 25] [--sampler] [--host-ops]

For each placement: the wall time of a decode step of N rows (the mean over 16 steps), the GPU kernels of a few
such steps (torch profiler, graph replays included) by total GPU time, with their count per step, and the same
for the prefill of N prompts of PP tokens. What bench/batched_compare.py measures end to end, taken apart.
With --host-ops (`--cpu-moe` placements whose experts all compute on the CPU): how long the CPU experts take where
the captured decode step runs them, and the same calls again on the step's last inputs, back to back and with a GPU
layer's time between them (are they slower in the step, and is it the pause?); the bytes of the distinct experts
those calls read, their rate, and the host's read rate at the same threads (a float32 sum over 2 GiB): how near
the experts are to the memory's bandwidth.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import ctypes
import io
import os
import pstats
import time
from collections.abc import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import tandem
from tandem.runtime.sampling import Sampler, SamplingParams

PLACEMENTS = {
    "all": {}, "cpu-moe": {"cpu_moe": True}, "cpu-moe+pcie3": {"cpu_moe": True, "pcie_experts": 3},
    "cpu-moe+repack": {"cpu_moe": True, "repack_experts": True},
}  # fmt: skip


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _admit(llm: tandem.LLM, n: int, pp: int, tg: int, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    for cache in llm.engine.pool.caches:
        cache.truncate(0)
    prompts = [torch.randint(0, llm.config.n_vocab, (pp,), generator=gen).tolist() for _ in range(n)]
    greedy = Sampler(SamplingParams(temperature=0.0))
    return [llm.engine.add_request(p, greedy, tg, frozenset()) for p in prompts]


def _table(prof: profile, steps: int, rows: int) -> str:
    """GPU kernels and copies by total time: ms per step, count per step, name."""
    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    total = sum(sum(v) for v in by_name.values()) / steps / 1e3
    lines = [f"  GPU time {total:.2f} ms per step, {sum(len(v) for v in by_name.values()) / steps:.0f} kernels/copies"]
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:rows]
    lines += [f"  {sum(v) / steps / 1e3:7.3f} ms  x{len(v) / steps:5.1f}  {name[:100]}" for name, v in ranked]
    return "\n".join(lines)


def _threads() -> str:
    """The process's threads by name, and what libgomp takes for the CPUs: ggml's and torch's OpenMP teams share
    one libgomp, which stops spinning at barriers once the teams' threads outnumber its CPUs."""
    names = collections.Counter()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names[f.read().strip()] += 1
        except OSError:
            continue
    gomp = ctypes.CDLL("libgomp.so.1")
    with open("/proc/self/maps") as f:
        maps = sorted({line.split()[-1] for line in f if "gomp" in line})
    return (
        f"threads {sum(names.values())}: {dict(names.most_common())}; libgomp omp_get_num_procs "
        f"{gomp.omp_get_num_procs()}, omp_get_max_threads {gomp.omp_get_max_threads()}; loaded {maps}; "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}"
    )


GAP_S = 250e-6  # about the GPU's part of a layer between two host calls of a 16-row step


def _replay_ms(ops: list[Callable[[], None]], repeats: int, gap_s: float) -> float:
    """ms to run every op once, `gap_s` of spinning after each (as the host spins while the GPU computes the
    layer's other part) left out; the mean over `repeats`."""
    t0 = time.perf_counter()
    for _ in range(repeats):
        for run in ops:
            run()
            until = time.perf_counter() + gap_s
            while time.perf_counter() < until:
                pass
    return ((time.perf_counter() - t0) / repeats - len(ops) * gap_s) * 1e3


class HostOpTimes:
    """Times the CPU experts (tandem's kernel or ggml's graph) where the decode step runs them: OffloadedExperts'
    prepared host calls wrapped (before the model loads), each layer's latest kept to be run again alone."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        # (layer's op, rows) -> its prepared call and the routing ids it reads
        self.latest: dict[tuple[int, int], tuple[Callable[[], None], torch.Tensor]] = {}

    def install(self) -> None:
        from tandem.weights.offload import OffloadedExperts

        original = OffloadedExperts._bind

        def timed_bind(
            experts: OffloadedExperts, xs: list[torch.Tensor], out: torch.Tensor
        ) -> Callable[[], None] | None:
            bound = original(experts, xs, out)
            if bound is None:
                return None
            self.latest[(id(experts), int(xs[1].shape[0]))] = (bound, xs[1])

            def run() -> None:
                t0 = time.perf_counter()
                bound()
                self.seconds += time.perf_counter() - t0
                self.calls += 1

            return run

        OffloadedExperts._bind = timed_bind  # type: ignore[method-assign]

    def report(self, llm: tandem.LLM, path: str, n: int, pp: int, steps: int = 16, repeats: int = 5) -> str:
        engine = llm.engine
        seqs = _admit(llm, n, pp, steps + 8, seed=23)
        while not all(s.n_output for s in seqs):
            engine.step()
        for _ in range(4):
            engine.step()
        _sync()
        self.seconds, self.calls = 0.0, 0
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync()
        wall = (time.perf_counter() - t0) / steps * 1e3
        in_step, calls = self.seconds / steps * 1e3, self.calls / steps
        latest = [(run, ids) for (_, rows), (run, ids) in self.latest.items() if rows == n]
        ops = [run for run, _ in latest]
        alone, apart = (_replay_ms(ops, repeats, gap) for gap in (0.0, GAP_S))
        distinct = sum(int(torch.unique(ids).numel()) for _, ids in latest)
        read_gb = distinct * _expert_bytes(path) / 1e9
        threads = torch.get_num_threads()
        while engine.has_work:
            engine.step()
        self.latest.clear()  # this model's calls: the next placement loads its own
        from tandem.quant import moe_kernel

        ok, why = moe_kernel.available()
        who = "tandem's kernel (Q4_K/Q6_K SwiGLU layers)" if ok else f"ggml's graph ({why})"
        return (
            f"{_threads()}\n"
            f"the CPU experts, by {who}, in a decode step of {n} rows: {wall:.2f} ms wall per step, "
            f"{in_step:.2f} ms in {calls:.0f} host calls ({in_step / wall:.0%}); the {len(ops)} layers' last calls "
            f"again, back to back: {alone:.2f} ms; {GAP_S * 1e3:.2f} ms apart: {apart:.2f} ms\n"
            f"those calls read {distinct / max(len(latest), 1):.1f} distinct experts per layer, {read_gb:.2f} GB: "
            f"{read_gb / alone * 1e3:.1f} GB/s back to back; the host reads {_read_rate_gbs(threads):.1f} GB/s "
            f"({threads} threads, float32 sum of 2 GiB, best of 5)"
        )


def _expert_bytes(path: str) -> float:
    """The mean bytes of one expert of one layer (its gate, up and down blocks) in the file."""
    from tandem.gguf import open_gguf
    from tandem.placement import expert_layer

    stacks = [i for i in open_gguf(path).tensors.values() if expert_layer(i.name) is not None and len(i.shape) == 3]
    layers = {expert_layer(i.name) for i in stacks}
    return sum(i.n_bytes for i in stacks) / len(layers) / stacks[0].shape[0]  # (E, N, K) stacks


def _read_rate_gbs(threads: int, reps: int = 5) -> float:
    """GB/s of a float32 sum over 2 GiB with `threads` threads, the best of `reps`: the host memory's read rate."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    x = torch.ones(1 << 29, dtype=torch.float32)
    best = float("inf")
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    torch.set_num_threads(saved)
    return x.numel() * 4 / best / 1e9


def _host_profile(llm: tandem.LLM, n: int, pp: int, rows: int) -> str:
    """The host's time in one prefill of n prompts by function, the largest own times first."""
    seqs = _admit(llm, n, pp, 4, seed=11)
    _sync()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    while not all(s.n_output for s in seqs):
        llm.engine.step()
    _sync()
    prof.disable()
    wall = (time.perf_counter() - t0) * 1e3
    while llm.engine.has_work:
        llm.engine.step()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(rows)
    body = out.getvalue().split("ncalls", 1)[-1]
    return f"prefill under cProfile: {wall:.1f} ms wall\n  ncalls{body}"


def profile_placement(
    path: str,
    name: str,
    n: int,
    pp: int,
    threads: int,
    rows: int,
    ctx: int | None = None,
    host: int = 0,
    host_ops: HostOpTimes | None = None,
) -> None:
    start = time.perf_counter()
    llm = tandem.LLM(path, n_ctx=ctx or pp + 64, n_parallel=n, threads=threads, **PLACEMENTS[name])
    engine = llm.engine
    print(f"== {name}: {n} sequences, pp {pp} (loaded in {time.perf_counter() - start:.1f} s)", flush=True)
    for rep in range(2):  # the first captures the graphs and tunes the kernels of these shapes
        seqs = _admit(llm, n, pp, 40, seed=rep)
        _sync()
        t0 = time.perf_counter()
        while not all(s.n_output for s in seqs):
            engine.step()
        _sync()
        t1 = time.perf_counter()
        steps = 0
        while engine.has_work:
            engine.step()
            steps += 1
        _sync()
        t2 = time.perf_counter()
        print(
            f"  rep {rep}: prefill of {n}x{pp} tokens {t1 - t0:.3f} s ({n * pp / (t1 - t0):.0f} tok/s); "
            f"{steps} decode steps of {n} rows: {(t2 - t1) / steps * 1e3:.2f} ms per step "
            f"({n * steps / (t2 - t1):.1f} tok/s)",
            flush=True,
        )
    seqs = _admit(llm, n, pp, 24, seed=7)
    with profile(activities=[ProfilerActivity.CUDA]) as prefill:
        while not all(s.n_output for s in seqs):
            engine.step()
        _sync()
    print(f"prefill of {n} prompts:\n{_table(prefill, 1, rows)}")
    if host:
        print(_host_profile(llm, n, pp, host))
    for _ in range(4):
        engine.step()
    _sync()
    steps = 8
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as decode:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync()
        wall = (time.perf_counter() - t0) / steps * 1e3
    print(f"decode step of {n} rows (profiled: {wall:.2f} ms wall per step):\n{_table(decode, steps, rows)}")
    while engine.has_work:
        engine.step()
    if host_ops is not None and host_ops.latest:
        print(host_ops.report(llm, path, n, pp), flush=True)
    llm.close()
    torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--placements", default="all,cpu-moe")
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--pp", type=int, default=128)
    p.add_argument("-t", "--threads", type=int, default=16)
    p.add_argument("--rows", type=int, default=18, help="kernels listed per table")
    p.add_argument("--ctx", type=int, default=None, help="context size (default: pp + 64)")
    p.add_argument("--host", type=int, default=0, help="functions listed in the prefill's host profile (0: none)")
    p.add_argument("--sampler", action="store_true", help="the bench worker's VRAM sampler thread runs meanwhile")
    p.add_argument(
        "--host-ops", action="store_true", help="time the CPU experts in the decode step and alone (--cpu-moe alone)"
    )
    args = p.parse_args()
    host_ops = HostOpTimes() if args.host_ops else None
    if host_ops is not None:
        host_ops.install()
    from tandem.bench.vram import VramSampler

    sampler = VramSampler().start() if args.sampler else None
    for name in args.placements.split(","):
        profile_placement(args.model, name, args.seqs, args.pp, args.threads, args.rows, args.ctx, args.host, host_ops)
    if sampler is not None:
        sampler.stop()


if __name__ == "__main__":
    main()
