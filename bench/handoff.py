"""What one hand-off between the captured decode step and a host op costs (run on the device).

    python bench/handoff.py [--ops 40] [--width 2048] [--reps 100]

A chain of `--ops` host ops, each fed by a small GPU op on the previous one's result ([1, width] bf16 + 1, as a
layer feeds its experts) and doing no work on the host (it hands its input back), captured the way the decode
step is (cuda/graphs.py SegmentedGraph over weights/offload.py HostCall): `flags` (a graph per host op, launched
two ahead by this thread, which runs the host ops and hands over through page-locked flags: the default) and
`in-order` (the graphs and host ops replayed in order, each host op waiting for an event: TANDEM_HOST_FLAGS=0).
The same chain without host ops, as one graph, is the floor. Prints µs per step and, over the floor, per
hand-off: the per-layer price a `--cpu-moe` decode pays on top of ggml and the GPU's kernels (Qwen3.6-35B-A3B
has 40 per token). Here the GPU's part between two host ops is one small kernel, shorter than a launch, so the
launches cannot hide in it as they do in a model's layer: the figures bound a hand-off's price from above.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from tandem.cuda.graphs import SegmentedGraph
from tandem.weights.offload import HOST_FLAGS_ENV, HostCall

ARRANGEMENTS = {"flags": "1", "in-order": "0"}  # TANDEM_HOST_FLAGS


def _timed(replay: object, reps: int) -> float:
    """Median µs of `replay()` followed by a device synchronisation, over `reps` after 5 untimed."""
    times = []
    for i in range(reps + 5):
        start = time.perf_counter()
        replay()  # type: ignore[operator]
        torch.cuda.synchronize()
        if i >= 5:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


@torch.inference_mode()
def _chain(n_ops: int, width: int, reps: int, with_host: bool) -> tuple[float, bool]:
    """(µs per replayed step, whether its host ops handed over through flags) for a chain of n_ops GPU ops,
    each handing off to the host when `with_host`."""
    x = torch.zeros(1, width, device="cuda", dtype=torch.bfloat16)
    hosts = [HostCall(lambda xs: xs[0]) for _ in range(n_ops)] if with_host else []

    def step() -> torch.Tensor:
        h = x
        for i in range(n_ops):
            h = h + 1
            if with_host:
                h = hosts[i]([h.float()], h.shape, h.dtype)
        return h

    want = step()  # eager: compiles, makes the host ops' page-locked buffers
    graph = SegmentedGraph()
    out = graph.capture(step, hosts)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want), "the replayed chain differs from the eager one"
    return _timed(graph.replay, reps), graph.uses_flags


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ops", type=int, default=40)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--reps", type=int, default=100)
    a = p.parse_args()
    floor, _ = _chain(a.ops, a.width, a.reps, with_host=False)
    print(f"{a.ops} GPU ops, no host ops (one graph): {floor:.0f} us per step")
    for name, flags in ARRANGEMENTS.items():
        os.environ[HOST_FLAGS_ENV] = flags
        us, by_flags = _chain(a.ops, a.width, a.reps, with_host=True)
        assert by_flags == (flags == "1"), "this driver should run the stream memory operations HostFlag uses"
        print(f"{a.ops} host ops, {name}: {us:.0f} us per step, {(us - floor) / a.ops:.1f} us per hand-off")


if __name__ == "__main__":
    main()
