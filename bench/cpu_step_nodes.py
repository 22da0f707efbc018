"""Where a CPU step graph spends its time, node by node (`--device cpu`: models/cpu_graph).

    python bench/cpu_step_nodes.py [-m MODEL] [-t THREADS] [--pp 512] [--position 600] [--reps 3]
                                   [--query-blocks 64,128,256]

For a prefill of `--pp` random tokens into an empty cache and for one decode step at `--position`: the whole
graph's time, then each node's alone (a view of the graph holding only it, repeated), summed by op (products by
their weight's type) with the largest nodes. Each node timed alone pays one graph launch (~1 µs) and finds its
inputs in cache where the whole graph may not: the sum is a floor, the breakdown says which ops to look at. Both
graphs run on the model's ggml threads, as `tandem bench --device cpu` runs them, with their attention as
TANDEM_CPU_FLASH_ATTN picks it (docs/FLAGS.md; by default with an f16 cache the flash-attention node).

--query-blocks: instead, the whole prefill graph's time with each of these query block sizes (rows of a sequence that
attend together, `QUERY_BLOCK`; the values do not depend on it), in rotation: an A/B of the attention's node size
against the keys it computes past the causal triangle.
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections import defaultdict
from pathlib import Path

import ggml
import numpy as np
import torch

import tandem
from tandem.api import default_model_path
from tandem.models.cpu_graph import StepGraph
from tandem.models.cpu_graph import step as step_shapes
from tandem.models.cpu_graph.step import Pieces, step_key


def _timed(run: object, reps: int) -> float:
    """Median seconds of `reps` calls of run() after one untimed."""
    run()  # type: ignore[operator]
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        run()  # type: ignore[operator]
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def profile(graph: StepGraph, pieces: Pieces, reps: int, top: int) -> None:
    # builds the program and fills its inputs; the logits' node writes into the returned tensor: kept alive here
    logits = graph.run(pieces)
    step = graph._programs[step_key(pieces, graph.kinds, flash=graph.flash, rings=graph.rings)]
    kernels = graph.runner.kernels
    program = step.program
    whole = _timed(lambda: kernels.compute_graph(program.address), reps)
    n = ggml.ggml_graph_n_nodes(program.graph)
    by_op: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    nodes = []
    for i in range(n):
        view = ggml.ggml_graph_view(program.graph, i, i + 1)
        seconds = _timed(lambda v=view: kernels.compute_graph(ctypes.addressof(v)), reps)
        node = ggml.ggml_graph_node(program.graph, i).contents
        op = ggml.ggml_op_desc(node).decode()
        src0 = node.src[0].contents if node.src[0] else None
        if op in ("MUL_MAT", "MUL_MAT_ID") and src0 is not None:
            op += "/" + ggml.ggml_type_name(src0.type).decode()
        by_op[op] += seconds
        count[op] += 1
        nodes.append((seconds, i, op, tuple(node.ne), tuple(src0.ne) if src0 is not None else ()))
    alone = sum(by_op.values())
    print(f"  {n} nodes; the whole graph {whole * 1e3:.2f} ms, its nodes alone {alone * 1e3:.2f} ms")
    for op, seconds in sorted(by_op.items(), key=lambda kv: -kv[1]):
        print(f"  {op:24s} {count[op]:5d} nodes {seconds * 1e3:9.2f} ms {100 * seconds / alone:5.1f} %")
    print("  largest nodes:")
    for seconds, i, op, ne, src_ne in sorted(nodes, reverse=True)[:top]:
        print(f"    #{i:<5d} {op:24s} {seconds * 1e6:9.1f} µs  out {ne}  src0 {src_ne}")
    del logits


def query_blocks(graph: StepGraph, pieces: Pieces, sizes: list[int], reps: int) -> None:
    times: dict[int, list[float]] = {size: [] for size in sizes}
    for _ in range(reps):
        for size in sizes:
            step_shapes.QUERY_BLOCK = size  # read by step_key when it cuts the rows into blocks
            graph.run(pieces)  # builds this size's program (kept) and runs it once
            t = time.perf_counter()
            graph.run(pieces)
            times[size].append(time.perf_counter() - t)
    n = sum(len(tokens) for _, _, tokens in pieces)
    for size, seconds in times.items():
        best, median = min(seconds), float(np.median(seconds))
        print(f"  query block {size:5d}: prefill {median * 1e3:9.1f} ms median, {best * 1e3:9.1f} best "
              f"({n / median:.1f} tok/s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", type=Path, default=None)
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("--pp", type=int, default=512)
    parser.add_argument("--position", type=int, default=600, help="the decode step's position")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--query-blocks", default=None, help="comma-separated sizes: time whole prefills only")
    args = parser.parse_args()
    path = args.model or default_model_path()
    n_ctx = max(args.pp, args.position) + 64
    with tandem.LLM(path, device="cpu", threads=args.threads, n_ctx=n_ctx, n_batch=args.pp) as llm:
        graph = llm.engine.runner.cpu_graph
        if graph is None:
            raise SystemExit("this model's CPU step does not run as ggml graphs")
        tokens = torch.randint(3, llm.config.n_vocab, (args.pp,), generator=torch.Generator().manual_seed(0))
        print(f"{path.name}, {args.threads} threads, prefill of {args.pp} tokens:")
        if args.query_blocks:
            query_blocks(graph, [(0, 0, tokens.tolist())], [int(x) for x in args.query_blocks.split(",")], args.reps)
            return
        profile(graph, [(0, 0, tokens.tolist())], args.reps, args.top)
        print(f"one decode step at position {args.position}:")
        profile(graph, [(0, args.position, [5])], args.reps, args.top)


if __name__ == "__main__":
    main()
