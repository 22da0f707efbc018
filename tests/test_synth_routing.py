"""`tandem synth --routing zipf:S`: the popularity law, the router fit on random hidden states (held-out rows give
the law), and a written 2-layer model whose routers, run by tandem on other random texts, give a Zipf-like skew."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.cli.main import main
from tandem.synth.presets import SynthError
from tandem.synth.routing import (
    MAX_POPULARITY,
    RoutingSpec,
    fit_router,
    layer_ranking,
    parse_routing,
    target_popularity,
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
    assert target[layer_ranking(128, 3, 0)[0]] == MAX_POPULARITY


def test_parse_routing() -> None:
    assert parse_routing("uniform") == RoutingSpec() and not RoutingSpec().skewed
    assert parse_routing("zipf:1.0") == RoutingSpec("zipf", 1.0) and str(parse_routing("Zipf:0.5")) == "zipf:0.5"
    for bad in ("zipf", "zipf:0", "zipf:-1", "zipf:9", "pareto:1", "zipf:1.0,drift"):
        with pytest.raises(SynthError, match="--routing"):
            parse_routing(bad)


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

    target = target_popularity(e, a, RoutingSpec("zipf", exponent), layer=0, seed=1)
    w = fit_router(draw(n), target, a, seed=2)
    held = top_k_popularity(draw(n).double() @ w.double().T, a).numpy()
    order = np.argsort(-target)
    uncapped = target[order] < MAX_POPULARITY - 1e-9
    assert _spearman(held, target) > 0.9  # the flat tail of nearly equal shares ranks by sampling noise
    assert abs(_slope(held[order], uncapped) + exponent) < 0.15
    assert np.abs(held - target).max() < 0.06


def test_synthesized_model_routes_with_zipf_skew(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A 2-layer synthetic Qwen3-30B-A3B with zipf:1.0 routers, run by tandem on the CPU over two random texts it
    was not fitted on: in each layer the hot experts are the target's and the popularity falls about as r**-1
    (per text the hot set varies around the law: a text has a direction of its own). Measured on the dev machine
    (2026-12-14, 4 layers, two 384-token texts): fitted exponents 0.77-1.39."""
    import tandem
    from tandem.gguf import open_gguf
    from tandem.layers import moe
    from tandem.synth.writer import synthesize

    r = synthesize("qwen3-30b-a3b", tmp_path / "z.gguf", layers=2, routing="zipf:1.0", threads=2)
    assert open_gguf(r.path).metadata["tandem.synth.routing"] == "zipf:1"
    assert [f.layer for f in r.routing] == [0, 1]
    for fit in r.routing:  # the calibration texts themselves: the fit reached the target
        assert np.abs(fit.fitted - fit.target).max() < 0.03
    logits: list[torch.Tensor] = []
    real = moe._router_logits

    def spy(proj, x):  # type: ignore[no-untyped-def]
        out = real(proj, x)
        logits.append(out.double())
        return out

    counts = np.zeros((2, 128))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe, "_router_logits", spy)
        with tandem.LLM(r.path, device="cpu", n_ctx=512, threads=2) as llm:
            for seed in (1000, 1001):
                logits.clear()
                gen = torch.Generator().manual_seed(seed)
                llm.engine.feed(torch.randint(0, llm.config.n_vocab, (384,), generator=gen).tolist())
                for layer, lg in enumerate(logits):
                    counts[layer] += top_k_popularity(lg[16:], 8).numpy()
    for layer, fit in enumerate(r.routing):
        held = counts[layer] / 2
        order = np.argsort(-fit.target)
        uncapped = fit.target[order] < MAX_POPULARITY - 1e-9
        slope = _slope(held[order], uncapped, floor=1 / 736)  # half a pick in the two texts' 736 rows
        assert -1.8 < slope < -0.6, (layer, slope, np.round(held[order][:8], 3))
        assert np.corrcoef(held, fit.target)[0, 1] > 0.7, layer  # the hot experts are the target's (the tail is noise)
        assert held[order][:8].sum() > 3.0  # the 8 hottest take over a third of the slots (uniform: 0.5)


def test_synth_cli_routing_flag(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "x.gguf"
    assert main(["synth", "--like", "gpt-oss-20b", "--layers", "1", "--routing", "zipf", "-o", str(out)]) == 2
    assert not out.exists()
