"""One layer's routed experts on the CPU, ggml's graph against tandem's kernel (tandem.quant.moe_kernel).

    python bench/moe_kernel.py MODEL.gguf [--layers 0,1] [--tokens 1,2,4,8,16,32,64,128] [--threads 16] [--reps 30]

For each layer and token count: T tokens, each routed to top_k distinct experts drawn uniformly (a batched decode
step of T sequences), the whole SwiGLU expert FFN timed with ggml's `mul_mat_id` graph (`CPUKernels.gated_experts`,
`native=False`), with ggml's graph on the Q4_K stacks repacked (`--repack-experts`, where ggml repacks them here)
and with the kernel (called directly: CPUKernels hands it 2 tokens and more), taking turns, medians of --reps
calls; prints µs per call, the ratios, the distinct experts and the kernel's largest difference from ggml relative
to the output's largest value.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tandem.gguf import open_gguf
from tandem.quant import moe_kernel
from tandem.quant.expert_ffn import ExpertFFN
from tandem.quant.ggml_cpu import CPUKernels
from tandem.quant.ggml_weights import GGMLWeight, repack_experts


def layer_ffn(path: str, layer: int) -> tuple[ExpertFFN, int]:
    f = open_gguf(path)
    top_k = int(f.metadata[f"{f.arch}.expert_used_count"])
    weights = {}
    for name in ("gate", "up", "down"):
        info = f.tensors[f"blk.{layer}.ffn_{name}_exps.weight"]
        weights[name] = GGMLWeight(info.data, info.qtype, info.shape)  # a view into the file's memory map
    return ExpertFFN(down=weights["down"], glu="swiglu", gate=weights["gate"], up=weights["up"]), top_k


def measure(ffn: ExpertFFN, repacked: ExpertFFN | None, top_k: int, t: int, ggml_side: CPUKernels, threads: int,
            reps: int) -> tuple[dict[str, float], int, float]:
    """µs per call of each way, the distinct experts, and the kernel's largest difference from ggml's graph."""
    e = ffn.down.shape[0]
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, ffn.stacks[0].shape[-1], generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(t)]).to(torch.int32)
    w = torch.rand(t, top_k, generator=g)
    out = torch.empty(t, ffn.down.shape[1])
    stacks = tuple((s.ptr, s.qtype) for s in ffn.stacks)
    nbytes, kernel = moe_kernel.experts_into(  # the kernel itself, at any token count
        out, x, ids, w, stacks, (ffn.down.ptr, ffn.down.qtype), e, ffn.down.shape[2], threads
    )
    scratch = torch.empty(nbytes, dtype=torch.uint8)

    def by_kernel() -> torch.Tensor:
        kernel(scratch.data_ptr())
        return out

    runs = {"ggml": lambda: ggml_side.gated_experts(x, ffn, ids, w), "kernel": by_kernel}
    if repacked is not None:
        runs["repacked"] = lambda: ggml_side.gated_experts(x, repacked, ids, w)
    times: dict[str, list[float]] = {name: [] for name in runs}
    outs = {}
    for _ in range(reps):
        for name, run in runs.items():
            start = time.perf_counter()
            outs[name] = run().clone()
            times[name].append(time.perf_counter() - start)
    ref = outs["ggml"]
    diff = ((outs["kernel"] - ref).abs().max() / ref.abs().max()).item()
    return {name: statistics.median(v) * 1e6 for name, v in times.items()}, len(set(ids.flatten().tolist())), diff


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--layers", default="0")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    ok, why = moe_kernel.available()
    if not ok:
        print(f"the kernel is not used here: {why}")
        return
    with CPUKernels(args.threads, native=False) as ggml_side:
        for layer in (int(v) for v in args.layers.split(",")):
            ffn, top_k = layer_ffn(args.model, layer)
            types = "/".join(w.qtype.name for w in (*ffn.stacks, ffn.down))
            stacks = {"gate": ffn.gate, "up": ffn.up, "down": ffn.down}
            packed = {k: repack_experts(w) for k, w in stacks.items() if w is not None}
            repacked = ExpertFFN(glu="swiglu", **packed) if any(w.repacked for w in packed.values()) else None
            for t in (int(v) for v in args.tokens.split(",")):
                us, distinct, diff = measure(ffn, repacked, top_k, t, ggml_side, args.threads, args.reps)
                line = (f"layer {layer} {types} T={t:3d} distinct {distinct:3d}: ggml {us['ggml']:8.0f} µs  kernel "
                        f"{us['kernel']:8.0f} µs  ggml/kernel {us['ggml'] / us['kernel']:.2f}")  # fmt: skip
                if "repacked" in us:
                    line += f"  repacked {us['repacked']:8.0f} µs  repacked/kernel {us['repacked'] / us['kernel']:.2f}"
                print(f"{line}  diff {diff:.1e}")


if __name__ == "__main__":
    main()
