"""cuda/streams.py side_by_side on a GPU (run on the device: `pytest -m gpu`): one token's projections on a
side stream give the results of running them one after the other, eagerly and replayed from a CUDA graph, and
the side stream really runs them."""

from __future__ import annotations

import pytest
import torch

from tandem.cuda.streams import _side_stream, side_by_side

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run with -m gpu on the device)"),
]


def _projections() -> list[torch.nn.Linear]:
    torch.manual_seed(0)
    return [torch.nn.Linear(256, n, device="cuda", dtype=torch.bfloat16) for n in (1024, 64, 64)]


@torch.inference_mode()
def test_side_by_side_equals_one_after_the_other_eager_and_captured() -> None:
    projections = _projections()
    x = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16)
    want = [p(x) for p in projections]
    got = side_by_side(x, *projections)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))

    seen: list[torch.cuda.Stream] = []

    def watching(p: torch.nn.Linear):  # type: ignore[no-untyped-def]
        def run(x: torch.Tensor) -> torch.Tensor:
            seen.append(torch.cuda.current_stream())
            return p(x)

        return run

    watched = [projections[0], *map(watching, projections[1:])]
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        side_by_side(x, *watched)  # warm-up outside the capture
        with torch.cuda.graph(graph, stream=stream):
            outs = side_by_side(x, *watched)
    assert seen and all(s == _side_stream(x.device) for s in seen), "the side stream did not run them"
    for _ in range(3):
        x.normal_()
        graph.replay()
        torch.cuda.synchronize()
        want = [p(x) for p in projections]
        assert all(torch.equal(o, w) for o, w in zip(outs, want, strict=True))
