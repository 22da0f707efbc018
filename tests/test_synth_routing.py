"""`tandem synth --routing zipf:S[,drift:P]`: the popularity law, the router fit on random hidden states (held-out
rows give the law, per phase with drift), and written 2-layer models whose routers, run by tandem on other random
texts, give a Zipf-like skew (with drift: per phase, with hot sets that differ between phases)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tandem.cli.main import main
from tandem.models.cpu_graph import SWITCH_ENV
from tandem.placement.experts import estimated_shares
from tandem.synth.presets import SynthError
from tandem.synth.routing import (
    MAX_POPULARITY,
    RoutingSpec,
    drifting_text,
    fit_router,
    layer_ranking,
    parse_routing,
    phase_tokens,
    target_popularity,
    token_phases,
    top_k_popularity,
    zipf_popularity,
)


def _slope(popularity_by_rank: np.ndarray, uncapped: np.ndarray, floor: float = 1e-4) -> float:
    """The fitted exponent of log popularity against log rank, over the uncapped ranks (shares below `floor`, an
    expert that happened not to be picked, count as `floor`)."""
    ranks = np.arange(1, len(popularity_by_rank) + 1)
    return float(np.polyfit(np.log(ranks[uncapped]), np.log(np.maximum(popularity_by_rank[uncapped], floor)), 1)[0])


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(np.argsort(np.argsort(a)), np.argsort(np.argsort(b)))[0, 1])


def test_zipf_popularity_law() -> None:
    for e, a, s in ((128, 8, 1.0), (256, 8, 0.5), (32, 4, 1.5), (128, 8, 2.0)):
        pop = zipf_popularity(e, a, s)
        assert pop.sum() == pytest.approx(a) and (pop <= MAX_POPULARITY + 1e-12).all()
        assert (np.diff(pop) <= 1e-12).all()  # by rank
        free = pop < MAX_POPULARITY - 1e-9
        ranks = np.arange(1, e + 1)[free]
        assert np.allclose(pop[free] * ranks**s, pop[free][0] * ranks[0] ** s)  # c * r**-S where not capped
    assert zipf_popularity(128, 8, 1.0)[0] == MAX_POPULARITY  # 1/H_128 * 8 = 1.47 > 1: capped
    assert not np.array_equal(layer_ranking(128, 0, 0), layer_ranking(128, 1, 0))  # a hot set per layer
    target = target_popularity(128, 8, RoutingSpec("zipf", 1.0), 3, 0)
    assert target.shape == (1, 128) and target[0, layer_ranking(128, 3, 0)[0]] == MAX_POPULARITY
    drift = target_popularity(128, 8, RoutingSpec("zipf", 1.0, 4), 3, 0)
    assert drift.shape == (4, 128) and np.array_equal(drift[0], target[0])  # phase 0 ranks as plain zipf
    assert all(drift[p, layer_ranking(128, 3, 0, p)[0]] == MAX_POPULARITY for p in range(4))
    assert len({int(np.argmax(drift[p])) for p in range(4)}) > 1  # a ranking per phase


def test_parse_routing() -> None:
    assert parse_routing("uniform") == RoutingSpec() and not RoutingSpec().skewed
    assert parse_routing("zipf:1.0") == RoutingSpec("zipf", 1.0) and str(parse_routing("Zipf:0.5")) == "zipf:0.5"
    assert parse_routing("zipf:1.0,drift") == RoutingSpec("zipf", 1.0, 4)
    assert str(parse_routing("zipf:0.5,drift:8")) == "zipf:0.5,drift:8" and parse_routing("zipf:1,drift:8").phases == 8
    for bad in ("zipf", "zipf:0", "zipf:-1", "zipf:9", "pareto:1", "zipf:1.0,drift:1", "zipf:1.0,drift:17",
                "zipf:1.0,drift:", "zipf:1.0,drift:x", "drift:4", "zipf:1.0,drift:4,"):  # fmt: skip
        with pytest.raises(SynthError, match="--routing"):
            parse_routing(bad)


def test_phase_tokens_and_drifting_text() -> None:
    for n_vocab, phases in ((151936, 4), (1000, 3), (10, 7)):
        ranges = [phase_tokens(n_vocab, phases, p) for p in range(phases)]
        assert [r.start for r in ranges[1:]] == [r.stop for r in ranges[:-1]] and ranges[-1].stop == n_vocab
        ids = torch.arange(n_vocab)
        assert token_phases(ids, n_vocab, phases).tolist() == [p for p, r in enumerate(ranges) for _ in r]
    text = drifting_text(1000, 3, 70, 16, seed=5, first=1)
    assert len(text) == 70
    assert token_phases(torch.tensor(text), 1000, 3).tolist() == [(1 + i // 16) % 3 for i in range(70)]
    assert text == drifting_text(1000, 3, 70, 16, seed=5, first=1) != drifting_text(1000, 3, 70, 16, seed=6, first=1)


@pytest.mark.parametrize("exponent", [0.6, 1.0, 1.5])
def test_fit_router_gives_the_law_on_held_out_hidden_states(exponent: float) -> None:
    """Random hidden states with a common direction and an anisotropic rest (as a model's router inputs): the
    fitted router's top-8 picks over fresh draws from the same distribution rank the experts as the target
    and fall with the target's exponent."""
    e, a, d, n = 128, 8, 512, 4096
    g = torch.Generator().manual_seed(int(exponent * 10))
    mean = torch.randn(d, generator=g)
    mixing = torch.randn(d, d, generator=g) * torch.logspace(0, -1.5, d)[None, :]  # spectrum over 1.5 decades

    def draw(count: int) -> torch.Tensor:
        return 3 * mean / mean.norm() * d**0.5 + torch.randn(count, d, generator=g) @ mixing.T

    target = target_popularity(e, a, RoutingSpec("zipf", exponent), layer=0, seed=1)[0]
    w = fit_router(draw(n), target, a, seed=2)
    held = top_k_popularity(draw(n).double() @ w.double().T, a).numpy()
    order = np.argsort(-target)
    uncapped = target[order] < MAX_POPULARITY - 1e-9
    assert _spearman(held, target) > 0.9  # the flat tail of nearly equal shares ranks by sampling noise
    assert abs(_slope(held[order], uncapped) + exponent) < 0.15
    assert np.abs(held - target).max() < 0.06


def test_fit_router_gives_each_phase_its_law_on_held_out_hidden_states() -> None:
    """Drift on random hidden states: rows of three phases, each with a common direction of its own and the same
    anisotropic rest. Over fresh rows of each phase the fitted router ranks the experts as that phase's target and
    falls with the exponent; the phases' hot sets (their 13 most picked of 128, 10 %) hardly overlap."""
    e, a, d, n, phases = 128, 8, 512, 6144, 3
    g = torch.Generator().manual_seed(3)
    means = torch.randn(phases, d, generator=g)
    mixing = torch.randn(d, d, generator=g) * torch.logspace(0, -1.5, d)[None, :]

    def draw(count: int, phase: torch.Tensor) -> torch.Tensor:
        offset = 3 * means[phase] / means[phase].norm(dim=1, keepdim=True) * d**0.5
        return offset + torch.randn(count, d, generator=g) @ mixing.T

    label = torch.arange(n) % phases
    target = target_popularity(e, a, RoutingSpec("zipf", 1.0, phases), layer=0, seed=1)
    w = fit_router(draw(n, label), target, a, seed=2, phase=label)
    fresh = draw(n, label).double() @ w.double().T
    hot = []
    for p in range(phases):
        held = top_k_popularity(fresh[label == p], a).numpy()
        order = np.argsort(-target[p])
        uncapped = target[p][order] < MAX_POPULARITY - 1e-9
        assert _spearman(held, target[p]) > 0.9, p
        assert abs(_slope(held[order], uncapped) + 1.0) < 0.15, p
        assert np.abs(held - target[p]).max() < 0.06, p
        hot.append(set(np.argsort(-held)[:13].tolist()))
    assert max(len(hot[p] & hot[q]) for p in range(phases) for q in range(p)) <= 3  # random sets: 1.3 on average


@contextlib.contextmanager
def _router_logits() -> Iterator[list[torch.Tensor]]:
    """Every router's logits (float64) as the models loaded inside compute them, in order: on the CPU's layer path,
    whose routers this reads (the step graphs route inside ggml)."""
    from tandem.layers import moe

    logits: list[torch.Tensor] = []
    real = moe._router_logits

    def spy(proj, x):  # type: ignore[no-untyped-def]
        out = real(proj, x)
        logits.append(out.double())
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe, "_router_logits", spy)
        mp.setenv(SWITCH_ENV, "0")
        yield logits


def _texts_popularity(path, seeds, length: int = 384) -> np.ndarray:  # type: ignore[no-untyped-def]
    """Per random text of `length` tokens (one per seed), each layer's picks per token by expert [texts, 2, 128]
    (the first 16 rows of a text left out), the model run by tandem on the CPU."""
    import tandem

    out = np.zeros((len(seeds), 2, 128))
    with _router_logits() as logits:
        with tandem.LLM(path, device="cpu", n_ctx=length, threads=2) as llm:
            for k, seed in enumerate(seeds):
                logits.clear()
                gen = torch.Generator().manual_seed(seed)
                llm.engine.reset()
                llm.engine.feed(torch.randint(0, llm.config.n_vocab, (length,), generator=gen).tolist())
                for layer, lg in enumerate(logits):
                    out[k, layer] = top_k_popularity(lg[16:], 8).numpy()
    return out


def test_a_plain_models_hot_sets_per_text_are_not_taken_for_its_routers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A plain synthetic model (random routers) routes each random text with a hot set of its own: over four texts
    the counts still look skewed (the top 12 of 128 experts take 20-26 % of a layer's picks), but two halves of
    them disagree, so the placement trusts none of it and plans the budget as without statistics (whole layers),
    where the summed counts alone would scatter single experts."""
    from tandem.gguf import open_gguf
    from tandem.models import read_config
    from tandem.placement import PlacementRequest, RuntimeShape, plan_placement
    from tandem.synth.writer import synthesize

    path = synthesize("qwen3-30b-a3b", tmp_path / "plain.gguf", layers=2, threads=2).path
    per_text = _texts_popularity(path, seeds=(2000, 2001, 2002, 2003), length=256) * 240  # picks per text
    halves = np.stack([per_text[0::2].sum(axis=0), per_text[1::2].sum(axis=0)])
    counts = halves.sum(axis=0)
    for layer in range(2):
        observed = counts[layer] / counts[layer].sum()
        assert np.sort(observed)[::-1][:12].sum() > 0.15  # skewed to the eye (uniform: 0.09)
        trusted = estimated_shares(counts[layer], 8, halves[:, layer])
        assert np.abs(trusted - 1 / 128).sum() < 0.3 * np.abs(observed - 1 / 128).sum(), layer
    f = open_gguf(path)
    cfg = read_config(f)
    shape = RuntimeShape(n_ctx=256)
    full = plan_placement(f, cfg, PlacementRequest.from_flags(device="cuda"), shape).gpu_bytes()
    floor = plan_placement(f, cfg, PlacementRequest.from_flags(device="cuda", cpu_moe=True), shape).gpu_bytes()
    request = PlacementRequest.from_flags(device="cuda", gpu_memory=floor + (full - floor) * 5 // 8)
    plans = {label: plan_placement(f, cfg, request, shape, expert_counts=c, counts_label=label)
             for label, c in (("none", None), ("halves", halves), ("summed", counts))}  # fmt: skip
    whole = {label: cfg.n_layers - len(p.cpu_expert_layers) for label, p in plans.items()}
    assert whole["halves"] == whole["none"] == 1 and whole["summed"] == 0, whole


def test_synthesized_model_routes_with_zipf_skew(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A 2-layer synthetic Qwen3-30B-A3B with zipf:1.0 routers, run by tandem on the CPU over two random texts it
    was not fitted on: in each layer the hot experts are the target's and the popularity falls about as r**-1
    (per text the hot set varies around the law: a text has a direction of its own). Measured on the dev machine
    (2026-12-14, 4 layers, two 384-token texts): fitted exponents 0.77-1.39."""
    from tandem.gguf import open_gguf
    from tandem.synth.writer import synthesize

    r = synthesize("qwen3-30b-a3b", tmp_path / "z.gguf", layers=2, routing="zipf:1.0", threads=2)
    assert open_gguf(r.path).metadata["tandem.synth.routing"] == "zipf:1"
    assert [f.layer for f in r.routing] == [0, 1]
    for fit in r.routing:  # the calibration texts themselves: the fit reached the target
        assert fit.target.shape == (1, 128) and np.abs(fit.fitted - fit.target).max() < 0.03
    per_text = _texts_popularity(r.path, seeds=(1000, 1001))
    counts = per_text.sum(axis=0)
    for layer in range(2):  # the two texts agree on the hot experts: the placement keeps most of the skew (with a
        # text per half, less what each text's own hot set adds: 72 % here; four texts a half kept 95 %, 4 layers)
        observed = counts[layer] / counts[layer].sum()
        trusted = estimated_shares(counts[layer], 8, per_text[:, layer])
        assert np.abs(trusted - 1 / 128).sum() > 0.6 * np.abs(observed - 1 / 128).sum(), layer
    for layer, fit in enumerate(r.routing):
        held, target = counts[layer] / 2, fit.target[0]
        order = np.argsort(-target)
        uncapped = target[order] < MAX_POPULARITY - 1e-9
        slope = _slope(held[order], uncapped, floor=1 / 736)  # half a pick in the two texts' 736 rows
        assert -1.8 < slope < -0.6, (layer, slope, np.round(held[order][:8], 3))
        assert np.corrcoef(held, target)[0, 1] > 0.7, layer  # the hot experts are the target's (the tail is noise)
        assert held[order][:8].sum() > 3.0  # the 8 hottest take over a third of the slots (uniform: 0.5)


def test_synthesized_drift_model_routes_by_phase(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A 2-layer synthetic Qwen3-30B-A3B with zipf:1.0,drift:4 routers, run by tandem on the CPU over texts it was
    not fitted on. One 256-token text per phase: in each layer the popularity falls about as r**-1 over that
    phase's ranking, and the phases' hot sets (the 13 most picked of 128 experts, 10 %) overlap little. A text that
    moves to the next phase every 128 tokens: after each switch the new phase's target hot set takes more picks
    than the previous phase's (less than in a text of one phase: the context's earlier phases stay in the router
    inputs). Measured on the dev machine (2026-12-02), two sets of texts: per phase and layer fitted exponents
    0.95-1.37, correlation with the target 0.67-0.88, hot sets sharing 0-5 of 13 experts; three drifting texts:
    each piece's own top 13 take 1.5-5.2 of the 8 picks, the previous phase's 0.4-1.5."""
    import tandem
    from tandem.gguf import open_gguf
    from tandem.synth.writer import synthesize

    phases, n_vocab = 4, 151936
    r = synthesize("qwen3-30b-a3b", tmp_path / "d.gguf", layers=2, routing="zipf:1.0,drift:4", threads=2)
    assert open_gguf(r.path).metadata["tandem.synth.routing"] == "zipf:1,drift:4"
    for fit in r.routing:  # the calibration texts themselves: each phase's fit reached its target
        assert fit.target.shape == (phases, 128) and np.abs(fit.fitted - fit.target).max() < 0.05
    with _router_logits() as logits:

        def route(llm, text: list[int]) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
            logits.clear()
            llm.engine.feed(text)  # one step (n_batch covers it): one router call per layer
            assert len(logits) == 2
            return list(logits)

        with tandem.LLM(r.path, device="cpu", n_ctx=512, n_batch=512, threads=2) as llm:
            pure = [route(llm, drifting_text(n_vocab, phases, 256, 256, seed=2000 + p, first=p)) for p in range(phases)]
            drifting = route(llm, drifting_text(n_vocab, phases, 512, 128, seed=3000))
    for layer, fit in enumerate(r.routing):
        hot = []
        for p in range(phases):
            held, target = top_k_popularity(pure[p][layer][16:], 8).numpy(), fit.target[p]
            order = np.argsort(-target)
            uncapped = target[order] < MAX_POPULARITY - 1e-9
            slope = _slope(held[order], uncapped, floor=1 / 480)  # half a pick in the text's 240 rows
            assert -1.8 < slope < -0.6, (layer, p, slope, np.round(held[order][:8], 3))
            assert np.corrcoef(held, target)[0, 1] > 0.6, (layer, p)
            assert held[order][:8].sum() > 2.5, (layer, p)  # uniform: 0.5; the target: 3.7
            hot.append(set(np.argsort(-held)[:13].tolist()))
        overlaps = [len(hot[p] & hot[q]) for p in range(phases) for q in range(p)]
        assert max(overlaps) <= 4, (layer, overlaps)  # two random sets of 13: 1.3 on average
        top13 = [torch.from_numpy(np.argsort(-fit.target[p])[:13].copy()) for p in range(phases)]
        for piece in range(4):  # a piece's picks after its first 32 tokens, in a phase's target top 13 (of 8 picks)
            picks = torch.topk(drifting[layer][piece * 128 + 32 : (piece + 1) * 128], 8, dim=-1).indices
            share = [torch.isin(picks, top).sum().item() / len(picks) for top in top13]
            assert share[piece] > 1.2, (layer, piece, share)  # uniform: 0.8, the target 4.4
            if piece:  # the hot set moved on: the new phase's takes more picks than the previous one's
                assert share[piece] > share[piece - 1], (layer, piece, share)


def test_synth_cli_routing_flag(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "x.gguf"
    assert main(["synth", "--like", "gpt-oss-20b", "--layers", "1", "--routing", "zipf", "-o", str(out)]) == 2
    assert main(["synth", "--like", "gpt-oss-20b", "--layers", "1", "--routing", "zipf:1,drift:1", "-o", str(out)]) == 2
    assert not out.exists()
