"""The routed experts as the CPU step graphs multiply them.

llama.cpp's loader puts every CPU weight whose product ggml's CPU_REPACK buffer supports into that buffer, the
expert stacks of a CPU-only model included (`mul_mat_id` on Q4_K, x86 with AVX2), and multiplies them with ggml's
interleaved gemm/gemv kernels. The layer path leaves the stacks in the file mapping unless `--repack-experts`
asks (the layout that suits `--cpu-moe` placements, whose prefill streams the mapped blocks to the GPU); the step
graphs, which run only where the whole model is on the CPU, hold them as llama.cpp does: `repack_experts` copies
(quant/ggml_weights.py), made once when the graphs are set up, in host RAM equal to those stacks (the mapped
pages of them then go cold, as llama.cpp's do).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

from tandem.layers.moe import MoE
from tandem.models.decoder import DecoderModel
from tandem.quant.ggml_cpu import ExpertFFN
from tandem.quant.ggml_weights import GGMLWeight, repack_experts, repackable_experts

__all__ = ["graph_experts"]

_STACKS = ("gate", "up", "gate_up", "down")


def graph_experts(model: DecoderModel, threads: int) -> dict[int, ExpertFFN]:
    """Per MoE layer (keyed by the id of its `MoE`), its experts' `ExpertFFN` with the stacks ggml repacks on this
    CPU copied into the repacked layout; ggml repacks a tensor on one thread, so `threads` copy at once."""
    ffns = {id(block.ffn): _layer_ffn(block.ffn) for block in model.blocks if isinstance(block.ffn, MoE)}
    todo = {id(w): w for ffn in ffns.values() for w in _stacks(ffn) if repackable_experts(w)}
    if not todo:
        return ffns
    with concurrent.futures.ThreadPoolExecutor(max(1, threads), thread_name_prefix="tandem-graph-repack") as pool:
        copies = dict(zip(todo, pool.map(repack_experts, todo.values()), strict=True))
    return {
        key: dataclasses.replace(ffn, **{name: copies.get(id(w), w) for name, w in _named_stacks(ffn)})
        for key, ffn in ffns.items()
    }


def _layer_ffn(moe: MoE) -> ExpertFFN:
    graph = getattr(moe.experts, "_graph", None)  # GLUExperts' ggml description of itself (decoder.unsupported)
    assert graph is not None
    return graph[1]


def _named_stacks(ffn: ExpertFFN) -> list[tuple[str, GGMLWeight]]:
    return [(name, w) for name in _STACKS if isinstance(w := getattr(ffn, name), GGMLWeight)]


def _stacks(ffn: ExpertFFN) -> list[GGMLWeight]:
    return [w for _, w in _named_stacks(ffn)]
