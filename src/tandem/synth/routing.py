"""Skewed routing for synthetic models (`tandem synth --routing zipf:S`).

Random routers route near-uniformly, which makes every expert-placement policy look alike. With `zipf:S` the
routers are rewritten so that, per layer, the share of routing slots an expert gets follows a Zipf law of exponent
S over its rank: popularity(r) = c * r**-S, where c makes the popularities of a layer sum to the experts per token
(A). An expert is chosen at most once per token, so a popularity is capped at MAX_POPULARITY (0.95) and the excess
goes to the others (for S = 1, E = 128, A = 8 the top expert is in 95 % of tokens' picks, the 128th in ~1.6 %).
Which expert holds which rank is a different random permutation in every layer.

How: a router's logits are a bias per expert plus unit noise per expert, both read from its input. The bias needs a
part of the input that is the same for every token, and a random model's router inputs have none that holds from
one text to the next: each random text has a strong direction of its own (|mean| 15-37 of |x| = 45 in the first
four layers of a Qwen3-30B-A3B-shaped model, the means of different texts at cosines -0.35..0.5; 2026-12-14). So
every token embedding gets one common vector of EMBED_OFFSET times a row's norm (the table requantized to its own
type by ggml), which carries through the residual stream: the router inputs of different texts then share their
mean direction (cosines 0.95-0.99 in those layers). A multiple of that direction gives the bias; whitened principal
directions of the rest give the noise. The routers are fitted after the file is written, on the router inputs of
one step of CALIBRATION_SEQUENCES random texts of CALIBRATION_LENGTH tokens run by tandem on the CPU, layer after
layer in the same pass (each router is fitted on the inputs its fitted predecessors produce), and written into the
file in place: the biases by a fixed-point iteration until each expert's share of the top-A picks of those inputs
is its target. Other random texts then give the law within sampling noise (tests/test_synth_routing.py).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.synth.presets import SynthError

MAX_POPULARITY = 0.95  # of the tokens that pick an expert: at most once per token, and 1 needs an infinite bias
CALIBRATION_SEQUENCES = 8  # random texts whose router inputs each router is fitted on, in one step
CALIBRATION_LENGTH = 256  # tokens of each
EMBED_OFFSET = 8.0  # the vector added to every token embedding, in units of the rows' mean norm
EMBED_CHUNK_ROWS = 4096  # rows of the table requantized at a time
FIT_ITERATIONS = 400
FIT_STEP = 0.15
ROUTER_SUFFIX = ".ffn_gate_inp.weight"
ROUTER_BIAS_SUFFIX = ".ffn_gate_inp.bias"  # gpt-oss: written as zeros with a fitted router (the fit is the bias)


@dataclass(frozen=True)
class RoutingSpec:
    """`uniform` (the random routers as written) or `zipf:S`."""

    kind: str = "uniform"
    exponent: float = 0.0

    @property
    def skewed(self) -> bool:
        return self.kind != "uniform"

    def __str__(self) -> str:
        return "uniform" if not self.skewed else f"zipf:{self.exponent:g}"


def parse_routing(text: str) -> RoutingSpec:
    """'uniform' or 'zipf:S' (S > 0, e.g. zipf:1.0) -> RoutingSpec; anything else is a one-line SynthError."""
    t = text.strip().lower()
    if t == "uniform":
        return RoutingSpec()
    m = re.fullmatch(r"zipf:([0-9]*\.?[0-9]+)", t)
    if m is None:
        raise SynthError(f"--routing: cannot read '{text}' (use uniform or zipf:S with S > 0, e.g. zipf:1.0)")
    s = float(m.group(1))
    if not 0 < s <= 4:
        raise SynthError(f"--routing zipf:{m.group(1)}: the exponent must be in (0, 4]")
    return RoutingSpec("zipf", s)


def zipf_popularity(n_experts: int, n_active: int, exponent: float, cap: float = MAX_POPULARITY) -> np.ndarray:
    """Popularity by rank (rank 1 first): c * r**-exponent summing to n_active, capped at `cap` with the excess
    spread over the uncapped ranks in proportion (water-filling)."""
    if not 0 < n_active < n_experts * cap:
        raise SynthError(f"{n_active} experts per token out of {n_experts} cannot be skewed (cap {cap})")
    law = np.arange(1, n_experts + 1, dtype=np.float64) ** -exponent
    pop = np.zeros(n_experts)
    free = np.ones(n_experts, dtype=bool)
    for _ in range(n_experts):
        pop[free] = law[free] / law[free].sum() * (n_active - pop[~free].sum())
        over = free & (pop > cap)
        if not over.any():
            break
        pop[over] = cap
        free &= ~over
    return pop


def layer_ranking(n_experts: int, layer: int, seed: int) -> np.ndarray:
    """The experts of `layer` by rank (index 0: the most popular): a permutation of its own per layer."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 7919, layer])))
    return rng.permutation(n_experts)


def target_popularity(n_experts: int, n_active: int, spec: RoutingSpec, layer: int, seed: int) -> np.ndarray:
    """Each expert's (by id) target share of a layer's top-A picks."""
    by_rank = zipf_popularity(n_experts, n_active, spec.exponent)
    out = np.empty(n_experts)
    out[layer_ranking(n_experts, layer, seed)] = by_rank
    return out


def top_k_popularity(logits: torch.Tensor, n_active: int) -> torch.Tensor:
    """How often each expert is among a row's top n_active logits, per row: [E] summing to n_active."""
    ids = torch.topk(logits, n_active, dim=-1).indices
    return torch.bincount(ids.flatten(), minlength=logits.shape[-1]).double() / logits.shape[0]


def fit_router(x: torch.Tensor, target: np.ndarray, n_active: int, seed: int) -> torch.Tensor:
    """Router weights W [E, D] (float32) whose top-n_active picks over the rows of x [N, D] give each expert its
    `target` share: logits = bias_e * (x . u) / m + noise_e(x), u the unit mean of x and m its length (so the
    first term is about bias_e for every row), noise_e the rows' coordinates along E whitened principal
    directions of x - mean, rotated at random (unit variance, uncorrelated over x); the biases by fixed-point
    iteration on log(target / share)."""
    x = x.double()
    n, d = x.shape
    e = len(target)
    mean = x.mean(0)
    m = float(mean.norm())
    if m < 1e-6 * float(x.norm(dim=1).mean()):
        raise SynthError("the router inputs have no common direction to carry a bias: cannot skew the routing")
    u = mean / m
    centred = x - mean
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # svd_lowrank draws its sketch from the global generator
    _, sv, v = torch.svd_lowrank(centred / math.sqrt(n), q=min(e + 16, n, d), niter=3)  # the top E directions
    vh = v.T
    k = min(e, int((sv > 1e-9 * sv[0]).sum()))
    rot, _ = torch.linalg.qr(torch.randn(e, e, generator=g, dtype=torch.float64))
    rot = rot[:k]  # [k, E]: orthonormal rows
    noise_w = (vh[:k].T / sv[:k]) @ rot  # [D, E]
    noise_w -= u[:, None] * (u @ noise_w)[None, :]  # orthogonal to the mean: x @ noise_w has no constant part
    base = (x @ u / m)[:, None]  # [N, 1], about 1
    noise = x @ noise_w  # [N, E]
    want = torch.from_numpy(target)
    bias = torch.log(want) * 2.0
    for _ in range(FIT_ITERATIONS):  # a share rises with its bias: a damped step converges (larger ones oscillate)
        share = top_k_popularity(base * bias + noise, n_active).clamp_min(0.5 / n)
        bias = bias + FIT_STEP * torch.log(want / share).clamp(-1.0, 1.0)
    w = bias[:, None] * (u / m)[None, :] + noise_w.T  # logits = x @ w.T
    return w.float().contiguous()


@dataclass(frozen=True)
class LayerFit:
    layer: int
    target: np.ndarray  # by expert id
    fitted: np.ndarray  # share of the top-A picks over the calibration inputs, by expert id


class _FittingProj:
    """Stands in for a router's projection during the calibration prefill: fits its weights on the first input
    it is given (the layer's router inputs), then computes the logits with them."""

    def __init__(self, layer: int, name: str, fit: Any) -> None:
        self.layer, self.name, self.fit = layer, name, fit
        self.weight: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        assert self.weight is not None
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            self.weight = self.fit(self.layer, x.float())
        return x.float() @ self.weight.T


def _routers(model: Any) -> Iterator[tuple[int, Any]]:
    """(layer, router) of every routed layer of a loaded model: the objects with a router's `proj` and
    `n_active`, found in the blocks' FFNs."""
    for i, block in enumerate(model.blocks):
        stack, seen = [block.ffn], set()
        while stack:
            obj = stack.pop()
            if id(obj) in seen or obj is None or isinstance(obj, torch.Tensor):
                continue
            seen.add(id(obj))
            if hasattr(obj, "proj") and hasattr(obj, "n_active"):
                yield i, obj
                continue
            stack.extend(v for v in getattr(obj, "__dict__", {}).values() if hasattr(v, "__dict__"))


def offset_embeddings(path: str | Path, seed: int) -> None:
    """Add one common vector (EMBED_OFFSET times the rows' mean norm, a random direction) to every row of the
    file's token embedding table, requantized in place by ggml to the table's own type (see the module's
    docstring). A tied table is the output head too: every logit then moves by the same amount."""
    import ctypes

    import ggml
    from gguf import GGMLQuantizationType as Q

    from tandem.gguf import open_gguf
    from tandem.quant.dequant import dequantize

    f = open_gguf(path)
    info = f.tensors["token_embd.weight"]
    rows, d = info.shape
    row_bytes = info.n_bytes // rows
    table = np.memmap(path, mode="r+", dtype=np.uint8, offset=info.offset, shape=(info.n_bytes,))
    first = dequantize(torch.from_numpy(np.array(table[: min(rows, EMBED_CHUNK_ROWS) * row_bytes])), info.qtype,
                       (min(rows, EMBED_CHUNK_ROWS), d))  # fmt: skip
    g = torch.Generator().manual_seed(seed + 104729)
    direction = torch.randn(d, generator=g)
    offset = (direction / direction.norm() * EMBED_OFFSET * first.norm(dim=1).mean()).float()
    if info.qtype not in (Q.F32, Q.F16):
        ggml.ggml_quantize_init(int(info.qtype))
    for r0 in range(0, rows, EMBED_CHUNK_ROWS):
        n = min(EMBED_CHUNK_ROWS, rows - r0)
        view = table[r0 * row_bytes : (r0 + n) * row_bytes]
        values = (dequantize(torch.from_numpy(np.array(view)), info.qtype, (n, d)) + offset).numpy()
        values = np.ascontiguousarray(values, dtype=np.float32)
        if info.qtype == Q.F32:
            view[:] = values.view(np.uint8).reshape(-1)
            continue
        out = np.empty(n * row_bytes, dtype=np.uint8)
        written = ggml.ggml_quantize_chunk(
            int(info.qtype), values.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), out.ctypes.data_as(ctypes.c_void_p),
            0, n, d, None,
        )  # fmt: skip
        if written != out.nbytes:
            raise SynthError(f"token_embd.weight: ggml quantized {written} bytes of {out.nbytes} ({info.qtype.name})")
        view[:] = out
    table.flush()
    del table


def calibrate_routers(
    path: str | Path,
    spec: RoutingSpec,
    seed: int,
    threads: int | None = None,
    n_seqs: int = CALIBRATION_SEQUENCES,
    length: int = CALIBRATION_LENGTH,
) -> list[LayerFit]:
    """Fit every router of the file at `path` to `spec` and write them into the file in place (see the module's
    docstring; `offset_embeddings` first). Returns each layer's target and fitted popularity."""
    import tandem  # the CPU model that produces the router inputs: imported only when skewing

    fits: dict[int, LayerFit] = {}
    weights: dict[str, torch.Tensor] = {}
    n_tokens = n_seqs * length
    with tandem.LLM(path, device="cpu", n_ctx=length, n_batch=n_tokens, n_parallel=n_seqs, threads=threads) as llm:
        cfg = llm.config
        assert cfg.moe is not None, "skewed routing needs routed experts"
        n_experts, n_active = cfg.moe.n_experts, cfg.moe.n_active

        def fit(layer: int, x: torch.Tensor) -> torch.Tensor:
            target = target_popularity(n_experts, n_active, spec, layer, seed)
            w = fit_router(x, target, n_active, seed + layer)
            fits[layer] = LayerFit(layer, target, top_k_popularity(x @ w.T, n_active).numpy())
            weights[f"blk.{layer}{ROUTER_SUFFIX}"] = w
            return w

        routers = list(_routers(llm.model))
        if not routers:
            raise SynthError(f"{path}: no routers found to skew")
        for layer, router in routers:
            router.proj = _FittingProj(layer, f"blk.{layer}{ROUTER_SUFFIX}", fit)
        gen = torch.Generator().manual_seed(seed)
        texts = [torch.randint(0, cfg.n_vocab, (length,), generator=gen).tolist() for _ in range(n_seqs)]
        llm.engine.runner.run(list(enumerate(texts)))  # one step: every router sees all the texts' rows at once
        f = llm.file
        at = {name: f.tensors[name].offset for name in weights}  # from the file's start
        shapes = {name: f.tensors[name].shape for name in weights}
        types = {name: f.tensors[name].qtype.name for name in weights}
    with open(path, "r+b") as fh:
        for name, w in weights.items():
            if types[name] != "F32" or tuple(w.shape) != tuple(shapes[name]):
                raise SynthError(f"{name}: expected an F32 router of shape {shapes[name]}, found {types[name]}")
            fh.seek(at[name])
            fh.write(w.numpy().astype("<f4").tobytes())
    return [fits[i] for i in sorted(fits)]
