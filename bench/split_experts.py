"""Can the GPU take part of a decode token's CPU experts? (run on the device; a feasibility probe)

    python bench/split_experts.py MODEL.gguf [-t 16] [--gpu-experts 1,2,3,4]

With --cpu-moe, a decode token's selected experts are computed by ggml on the CPU while the GPU waits. Their
blocks are page-locked in place (the prefill streams them), so a GPU kernel can also read them straight from
host RAM over PCIe, with no copy in VRAM. This times, per layer of the model's CPU experts (one token, a fresh
random route per layer):
- ggml alone on all the active experts, and on fewer (what the CPU keeps when the GPU takes k);
- the GPU alone on k experts read from host memory (the experts `--pcie-experts` builds: the same Triton kernels as
  experts in VRAM, over device views of the page-locked file);
- both at once: the GPU on k experts while ggml computes the others (they share host memory's bandwidth).
The last line says what one layer of experts would cost split that way, against ggml alone. The figures in
docs/PERFORMANCE.md (session 11) came from this script before it used the loader's `--pcie-experts` experts (its
own copy of their products then; the same kernels).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import tandem
from tandem.layers.moe import RoutedExperts, Routing
from tandem.quant.expert_ffn import ExpertFFN
from tandem.quant.ggml_cpu import CPUKernels
from tandem.weights.offload import OffloadedExperts


def _layers(llm: tandem.LLM) -> list[tuple[CPUKernels, ExpertFFN, RoutedExperts]]:
    """Per layer with CPU experts: ggml's kernels and FFN, and the same experts as the GPU reads them over PCIe
    (built by the loader for --pcie-experts)."""
    found = []
    for block in llm.model.blocks:
        experts = getattr(block.ffn, "experts", None)
        if isinstance(experts, OffloadedExperts) and experts.pcie is not None and experts.on_cpu._graph is not None:
            kernels, ffn = experts.on_cpu._graph  # type: ignore[attr-defined]
            found.append((kernels, ffn, experts.pcie))
    return found


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("-t", "--threads", type=int, default=16)
    p.add_argument("--gpu-experts", default="1,2,3,4")
    p.add_argument("--tokens", type=int, default=12)
    a = p.parse_args()
    llm = tandem.LLM(a.model, device="cuda", cpu_moe=True, threads=a.threads, pcie_experts=1)
    layers = _layers(llm)
    if not layers:
        raise SystemExit("no CPU experts with a GPU kernel in this model")
    kernels, ffn0, _ = layers[0]
    n_experts, d, _ = (int(n) for n in ffn0.down.shape)
    k_in = int(ffn0.stacks[0].shape[-1])
    top_k = llm.config.moe.n_active if llm.config.moe else 8
    print(f"{len(layers)} layers of CPU experts, {n_experts} experts, top-{top_k}, {a.threads} threads", flush=True)

    buffers: list[torch.Tensor] = []  # the prepared ggml calls' buffers, which must outlive them

    def cpu_runs(n: int) -> tuple[list, torch.Tensor]:
        x, w = torch.randn(1, k_in), torch.full((1, n), 1.0 / max(n, 1))
        ids, out = torch.zeros(1, n, dtype=torch.int32), torch.empty(1, d)
        buffers.extend((x, w, ids, out))
        return [kernels.gated_experts_into(out, x, ffn, ids, w) for _, ffn, _ in layers], ids

    xg = torch.randn(1, k_in, device="cuda", dtype=torch.bfloat16)

    def gpu_graphs(n: int) -> tuple[list[torch.cuda.CUDAGraph], list[torch.Tensor]]:
        """Per layer, its n GPU experts captured as a graph over a fixed ids buffer (as the decode step would
        hold them), so that a launch costs microseconds and ggml starts at once."""
        ids = [torch.zeros(1, n, dtype=torch.int32, device="cuda") for _ in layers]
        gw = torch.full((1, n), 1.0 / top_k, device="cuda", dtype=torch.bfloat16)
        buffers.append(gw)
        graphs = []
        for i, (_, _, over_pcie) in enumerate(layers):
            over_pcie(xg, Routing(ids=ids[i], weights=gw))  # compiled, tuned
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                over_pcie(xg, Routing(ids=ids[i], weights=gw))
            graphs.append(g)
        return graphs, ids

    def sweep(n_cpu: int, n_gpu: int) -> float:
        """µs per layer (median over tokens of the token's mean) of n_cpu experts on ggml while the GPU
        computes n_gpu others from host memory."""
        runs, ids = cpu_runs(n_cpu) if n_cpu else ([None] * len(layers), None)
        graphs, gids = gpu_graphs(n_gpu) if n_gpu else ([], [])
        per_token = []
        for token in range(a.tokens + 3):
            routes = [torch.randperm(n_experts)[:top_k].int() for _ in layers]
            for i, r in enumerate(routes[: len(gids)]):
                gids[i].copy_(r[n_cpu : n_cpu + n_gpu].view(1, -1))
            torch.cuda.synchronize()
            start = time.perf_counter()
            for i, run in enumerate(runs):
                if n_gpu:
                    graphs[i].replay()
                if run is not None:
                    assert ids is not None
                    ids[0] = routes[i][:n_cpu]
                    run()
                if n_gpu:
                    torch.cuda.synchronize()
            if token >= 3:
                per_token.append((time.perf_counter() - start) / len(layers) * 1e6)
        return statistics.median(per_token)

    rows = []

    def row(what: str, n_cpu: int, n_gpu: int) -> None:
        rows.append((what, n_cpu, n_gpu, sweep(n_cpu, n_gpu)))
        print(*rows[-1], flush=True)

    row("ggml alone (first)", top_k, 0)
    row("ggml alone", top_k, 0)
    for k in (int(s) for s in a.gpu_experts.split(",")):
        row("GPU alone, from host memory", 0, k)
        row("ggml alone", top_k - k, 0)
        row("both at once", top_k - k, k)
    row("ggml alone (again)", top_k, 0)
    print(f"{'what':32} {'CPU experts':>11} {'GPU experts':>11} {'us/layer':>9}")
    for what, c, g, us in rows:
        print(f"{what:32} {c:>11} {g:>11} {us:>9.1f}")
    base = min(us for what, c, g, us in rows if c == top_k)
    best = min((r for r in rows if r[0] == "both at once"), key=lambda r: r[3])
    print(f"SPLIT: ggml alone {base:.1f} us/layer; best split {best[1]}+{best[2]}: {best[3]:.1f} us/layer "
          f"({base / best[3]:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
