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

Drift (`zipf:S,drift:P`): the vocabulary is cut into P equal token id ranges, the phases, and each phase gets an
offset direction of its own (orthogonal, the same length) and, per layer, a ranking of its own. A router's bias is
then a row of biases per phase, read through coordinates c(x) of the input that are about one-hot in the token's
phase. A token's router input also carries its context's phases (attention mixes the context in), so c(x) is a
least-squares fit of the phase on the inputs' top principal directions (the noise from the rest), and the 4P
calibration texts are half of one phase's tokens alone, half of pieces of CALIBRATION_SEGMENT tokens of phases in
a random order, so that every phase is fitted after a long run of its own and after contexts of every mix (a
fixed order would let the context stand for the phase). A text that moves from one phase's tokens to the next's
(`drifting_text`, `tandem bench --drift`) moves its hot set with it, less sharply than a text of one phase shows
it (docs/synth.md).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.synth.presets import SynthError

MAX_POPULARITY = 0.95  # of the tokens that pick an expert: at most once per token, and 1 needs an infinite bias
CALIBRATION_SEQUENCES = 8  # random texts whose router inputs each router is fitted on, in one step
CALIBRATION_LENGTH = 256  # tokens of each
CALIBRATION_SEGMENT = 32  # with drift: the calibration texts' pieces of one phase
EMBED_OFFSET = 8.0  # the vector added to every token embedding, in units of the rows' mean norm
EMBED_CHUNK_ROWS = 4096  # rows of the table requantized at a time
COORD_DIRECTIONS = 32  # principal directions of the router inputs that the phase coordinates are read from
FIT_ITERATIONS = 400
FIT_STEP = 0.15
ROUTER_SUFFIX = ".ffn_gate_inp.weight"
ROUTER_BIAS_SUFFIX = ".ffn_gate_inp.bias"  # gpt-oss: written as zeros with a fitted router (the fit is the bias)
DEFAULT_PHASES = 4  # `drift` without a count
MAX_PHASES = 16  # each phase needs its share of the calibration rows


@dataclass(frozen=True)
class RoutingSpec:
    """`uniform` (the random routers as written), `zipf:S`, or `zipf:S,drift:P` (P phases, each a token id range
    of its own with a hot set of its own)."""

    kind: str = "uniform"
    exponent: float = 0.0
    phases: int = 1

    @property
    def skewed(self) -> bool:
        return self.kind != "uniform"

    def __str__(self) -> str:
        if not self.skewed:
            return "uniform"
        return f"zipf:{self.exponent:g}" + (f",drift:{self.phases}" if self.phases > 1 else "")


def parse_routing(text: str) -> RoutingSpec:
    """'uniform', 'zipf:S' (S > 0, e.g. zipf:1.0) or 'zipf:S,drift[:P]' (P phases, default DEFAULT_PHASES) ->
    RoutingSpec; anything else is a one-line SynthError."""
    t = text.strip().lower()
    if t == "uniform":
        return RoutingSpec()
    m = re.fullmatch(r"zipf:([0-9]*\.?[0-9]+)(,drift(?::([0-9]+))?)?", t)
    if m is None:
        raise SynthError(f"--routing: cannot read '{text}' (use uniform, zipf:S or zipf:S,drift:P with S > 0, "
                         "e.g. zipf:1.0 or zipf:1.0,drift:4)")  # fmt: skip
    s = float(m.group(1))
    if not 0 < s <= 4:
        raise SynthError(f"--routing zipf:{m.group(1)}: the exponent must be in (0, 4]")
    phases = int(m.group(3)) if m.group(3) is not None else DEFAULT_PHASES if m.group(2) else 1
    if m.group(2) and not 2 <= phases <= MAX_PHASES:
        raise SynthError(f"--routing {text.strip()}: drift takes 2 to {MAX_PHASES} phases")
    return RoutingSpec("zipf", s, phases)


def phase_tokens(n_vocab: int, phases: int, phase: int) -> range:
    """The token ids of `phase` (of `phases`): equal contiguous ranges of the vocabulary, phase 0 first."""
    return range(phase * n_vocab // phases, (phase + 1) * n_vocab // phases)


def token_phases(ids: torch.Tensor, n_vocab: int, phases: int) -> torch.Tensor:
    """The phase of each token id (the inverse of `phase_tokens`)."""
    return ((ids.long() + 1) * phases - 1) // n_vocab


def drifting_text(n_vocab: int, phases: int, length: int, every: int, seed: int, first: int = 0) -> list[int]:
    """`length` random token ids that move to the next phase every `every` tokens, starting at phase `first` (the
    text `tandem bench --drift` decodes)."""
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for start in range(0, length, every):
        ids = phase_tokens(n_vocab, phases, (first + start // every) % phases)
        out += torch.randint(ids.start, ids.stop, (min(every, length - start),), generator=gen).tolist()
    return out


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


def layer_ranking(n_experts: int, layer: int, seed: int, phase: int = 0) -> np.ndarray:
    """The experts of `layer` by rank (index 0: the most popular) in `phase`: a permutation of its own per layer
    and phase."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 7919, layer, *([phase] if phase else [])])))
    return rng.permutation(n_experts)


def target_popularity(n_experts: int, n_active: int, spec: RoutingSpec, layer: int, seed: int) -> np.ndarray:
    """Each expert's (by id) target share of a layer's top-A picks, per phase: [phases, E]."""
    by_rank = zipf_popularity(n_experts, n_active, spec.exponent)
    out = np.empty((spec.phases, n_experts))
    for phase in range(spec.phases):
        out[phase, layer_ranking(n_experts, layer, seed, phase)] = by_rank
    return out


def top_k_popularity(logits: torch.Tensor, n_active: int) -> torch.Tensor:
    """How often each expert is among a row's top n_active logits, per row: [E] summing to n_active."""
    ids = torch.topk(logits, n_active, dim=-1).indices
    return torch.bincount(ids.flatten(), minlength=logits.shape[-1]).double() / logits.shape[0]


def fit_router(
    x: torch.Tensor, target: np.ndarray, n_active: int, seed: int, phase: torch.Tensor | None = None
) -> torch.Tensor:
    """Router weights W [E, D] (float32) whose top-n_active picks over the rows of x [N, D] of each phase give each
    expert its `target` share ([phases, E], or [E] for one phase; `phase` [N]: each row's, all 0 when None).

    logits = c(x) . bias_e + noise_e(x). c(x) [phases] is about one-hot, the row's own phase 1 (one phase: x . u / m,
    u the unit mean of x and m its length; drift: see below), so the first term is about bias_e[p] for every row of
    phase p; noise_e are the rows' coordinates along E whitened principal directions of x minus its phase's mean,
    rotated at random and orthogonal to the means (unit variance, uncorrelated over x). The biases by fixed-point
    iteration on log(target / share), each phase's on its own rows."""
    want = torch.from_numpy(np.atleast_2d(target))
    phases, e = want.shape
    x = x.double()
    n, d = x.shape
    label = torch.zeros(n, dtype=torch.long) if phase is None else phase.long()
    rows = [label == p for p in range(phases)]
    if min(int(r.sum()) for r in rows) < e:
        raise SynthError(f"a phase has fewer than {e} calibration rows: cannot fit its routing")
    means = torch.stack([x[r].mean(0) for r in rows])  # [phases, D]
    scale = float(x.norm(dim=1).mean())
    basis, tri = torch.linalg.qr(means.T)  # orthonormal basis of the means' span, [D, phases]
    if float(tri.diagonal().abs().min()) < 1e-6 * scale:
        raise SynthError("the router inputs have no common direction per phase to carry a bias: cannot skew the "
                         "routing")  # fmt: skip
    centred = x - means[label]
    if phases == 1:
        coords_w = means.T / float(means.norm()) ** 2  # x . u / m, u the unit mean and m its length
    else:
        # A drifting text's rows carry their context's phases too (attention mixes them in). c(x): least squares
        # of the one-hot phases on the rows' top principal coordinates (uncentred: the means are among them), so
        # that c reads the token's phase, not the context's; the noise from what those directions leave, so that
        # a context does not shift the logits of a phase's rows.
        torch.manual_seed(seed)
        _, _, top = torch.svd_lowrank(x / math.sqrt(n), q=min(COORD_DIRECTIONS, n, d), niter=3)  # [D, K]
        onehot = torch.nn.functional.one_hot(label, phases).double()
        coords_w = top @ torch.linalg.lstsq(x @ top, onehot).solution  # [D, phases]
        centred -= (centred @ top) @ top.T
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # svd_lowrank draws its sketch from the global generator
    _, sv, v = torch.svd_lowrank(centred / math.sqrt(n), q=min(e + 16, n, d), niter=3)  # the top E directions
    vh = v.T
    k = min(e, int((sv > 1e-9 * sv[0]).sum()))
    rot, _ = torch.linalg.qr(torch.randn(e, e, generator=g, dtype=torch.float64))
    rot = rot[:k]  # [k, E]: orthonormal rows
    noise_w = (vh[:k].T / sv[:k]) @ rot  # [D, E]
    noise_w -= basis @ (basis.T @ noise_w)  # orthogonal to the means: x @ noise_w has no constant part per phase
    coords = x @ coords_w  # [N, phases], about one-hot
    noise = x @ noise_w  # [N, E]
    bias = torch.log(want) * 2.0  # [phases, E]
    for _ in range(FIT_ITERATIONS):  # a share rises with its bias: a damped step converges (larger ones oscillate)
        logits = coords @ bias + noise
        for p, r in enumerate(rows):
            share = top_k_popularity(logits[r], n_active).clamp_min(0.5 / int(r.sum()))
            bias[p] += FIT_STEP * torch.log(want[p] / share).clamp(-1.0, 1.0)
    w = bias.T @ coords_w.T + noise_w.T  # logits = x @ w.T
    return w.float().contiguous()


@dataclass(frozen=True)
class LayerFit:
    layer: int
    target: np.ndarray  # [phases, E]: by phase and expert id
    fitted: np.ndarray  # [phases, E]: share of the top-A picks over each phase's calibration inputs


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


@contextlib.contextmanager
def _layer_path() -> Iterator[None]:
    """The calibration model on the CPU's layer path: its routers' projections become fitting Python objects
    (`_FittingProj`), which the CPU step graphs (models/cpu_graph, the default for some MoE families) cannot hold,
    and the graphs' set-up would copy every expert stack to repack it for nothing."""
    from tandem.models.cpu_graph import SWITCH_ENV

    before = os.environ.get(SWITCH_ENV)
    os.environ[SWITCH_ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[SWITCH_ENV]
        else:
            os.environ[SWITCH_ENV] = before


def offset_embeddings(path: str | Path, seed: int, phases: int = 1) -> None:
    """Add a vector (EMBED_OFFSET times the rows' mean norm) to every row of the file's token embedding table, one
    random direction per phase (orthogonal; `phase_tokens` says which rows), requantized in place by ggml to the
    table's own type (see the module's docstring). A tied table is the output head too: every logit then moves by
    its phase's amount."""
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
    directions: list[torch.Tensor] = []
    for draw in torch.randn(phases, d, generator=g):  # Gram-Schmidt: one phase is zipf:S's direction exactly
        for u in directions:
            draw = draw - (draw @ u) * u
        directions.append(draw / draw.norm())
    offsets = (torch.stack(directions) * EMBED_OFFSET * first.norm(dim=1).mean()).float()  # [phases, D]
    row_phase = token_phases(torch.arange(rows), rows, phases)
    if info.qtype not in (Q.F32, Q.F16):
        ggml.ggml_quantize_init(int(info.qtype))

    def requantize(r0: int) -> None:
        n = min(EMBED_CHUNK_ROWS, rows - r0)
        view = table[r0 * row_bytes : (r0 + n) * row_bytes]
        values = dequantize(torch.from_numpy(np.array(view)), info.qtype, (n, d)) + offsets[row_phase[r0 : r0 + n]]
        values = np.ascontiguousarray(values.numpy(), dtype=np.float32)
        if info.qtype == Q.F32:
            view[:] = values.view(np.uint8).reshape(-1)
            return
        out = np.empty(n * row_bytes, dtype=np.uint8)
        written = ggml.ggml_quantize_chunk(
            int(info.qtype), values.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), out.ctypes.data_as(ctypes.c_void_p),
            0, n, d, None,
        )  # fmt: skip
        if written != out.nbytes:
            raise SynthError(f"token_embd.weight: ggml quantized {written} bytes of {out.nbytes} ({info.qtype.name})")
        view[:] = out

    # ggml quantizes on the calling thread and ctypes lets go of the GIL: the chunks side by side (disjoint rows)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(requantize, range(0, rows, EMBED_CHUNK_ROWS)))
    table.flush()


def calibration_texts(n_vocab: int, phases: int, n_seqs: int, length: int, gen: torch.Generator) -> list[list[int]]:
    """`n_seqs` random texts of `length` tokens for a drifting fit: half of them of one phase's tokens alone (a phase
    after a long run of its own, the phases in turn), then texts of pieces of CALIBRATION_SEGMENT tokens, each of a
    phase drawn in a random order (as many pieces per phase), so that a phase's rows also come after contexts of
    every mix of phases and the fit reads the token's phase, not its context's (a fixed order would tie the two)."""
    pure = [phase_tokens(n_vocab, phases, p % phases) for p in range(n_seqs // 2)]
    pieces = (n_seqs - len(pure)) * length // CALIBRATION_SEGMENT
    mixed = [phase_tokens(n_vocab, phases, int(p)) for p in torch.randperm(pieces, generator=gen) % phases]
    texts = [torch.randint(r.start, r.stop, (length,), generator=gen) for r in pure]
    if mixed:
        flat = torch.cat([torch.randint(r.start, r.stop, (CALIBRATION_SEGMENT,), generator=gen) for r in mixed])
        texts += list(flat.view(-1, length))
    return [t.tolist() for t in texts]


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
    if spec.phases > 1:  # 1024 rows per phase (the tail's targets are a few picks each), half in runs of one phase
        n_seqs = max(n_seqs, 4 * spec.phases)
    n_tokens = n_seqs * length
    with _layer_path(), tandem.LLM(path, device="cpu", n_ctx=length, n_batch=n_tokens, n_parallel=n_seqs,
                                   threads=threads) as llm:  # fmt: skip
        cfg = llm.config
        assert cfg.moe is not None, "skewed routing needs routed experts"
        n_experts, n_active = cfg.moe.n_experts, cfg.moe.n_active

        gen = torch.Generator().manual_seed(seed)
        if spec.phases == 1:
            texts = [torch.randint(0, cfg.n_vocab, (length,), generator=gen).tolist() for _ in range(n_seqs)]
        else:
            texts = calibration_texts(cfg.n_vocab, spec.phases, n_seqs, length, gen)
        phase = token_phases(torch.tensor(texts).flatten(), cfg.n_vocab, spec.phases)  # the step's rows, in order

        def fit(layer: int, x: torch.Tensor) -> torch.Tensor:
            assert x.shape[0] == len(phase), "a router input row per token of the texts, in their order"
            target = target_popularity(n_experts, n_active, spec, layer, seed)
            w = fit_router(x, target, n_active, seed + layer, phase)
            logits = x @ w.T
            fitted = np.stack([top_k_popularity(logits[phase == p], n_active).numpy() for p in range(spec.phases)])
            fits[layer] = LayerFit(layer, target, fitted)
            weights[f"blk.{layer}{ROUTER_SUFFIX}"] = w
            return w

        routers = list(_routers(llm.model))
        if not routers:
            raise SynthError(f"{path}: no routers found to skew")
        for layer, router in routers:
            router.proj = _FittingProj(layer, f"blk.{layer}{ROUTER_SUFFIX}", fit)
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
