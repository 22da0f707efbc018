"""The GPU work a MoE layer can do while experts in host RAM compute is queued between the experts' start and
their result: Gemma 4's dense MLP branch (ParallelFFN) and Qwen3.5/3.6's shared expert (MoEWithSharedExpert).

With the experts offloaded, `start` is OffloadedExperts.start: the inputs go to the host, the CPU computes, and the
result is copied back only when asked; what is queued in between runs on the GPU at the same time (that a host op
overlaps GPU work queued so: tests/test_gpu_offload.py, test_host_call_overlaps_gpu_work_eager_and_captured).
Here, on the CPU, the order of the calls and the result, on the tiny models' real layers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

import tandem
from tandem.layers.ffn import ParallelFFN
from tandem.layers.moe import Routing
from tandem.layers.shared_expert import MoEWithSharedExpert


class RecordingExperts:
    """Routed experts that log when they are started and when their result is taken."""

    def __init__(self, inner: Callable[[torch.Tensor, Routing], torch.Tensor], events: list[str]) -> None:
        self.inner = inner
        self.events = events

    def __call__(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        return self.inner(x, routing)

    def start(self, x: torch.Tensor, routing: Routing) -> Callable[[], torch.Tensor]:
        self.events.append("experts start")
        out = self.inner(x, routing)

        def result() -> torch.Tensor:
            self.events.append("experts result")
            return out

        return result


def _recording(events: list[str], name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    def call(x: torch.Tensor) -> torch.Tensor:
        events.append(name)
        return fn(x)

    return call


@pytest.mark.parametrize("fixture", ["tiny_gemma4_gguf", "tiny_qwen35moe_gguf"])
def test_gpu_branch_is_queued_while_the_experts_compute(fixture: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(fixture)[1]
    with tandem.LLM(path, device="cpu", cache_type="f32", threads=1, n_ctx=64) as llm:
        events: list[str] = []
        ffn = next(b.ffn for b in llm.model.blocks if isinstance(b.ffn, ParallelFFN | MoEWithSharedExpert))
        x = torch.randn(3, llm.config.hidden, generator=torch.Generator().manual_seed(0))
        if isinstance(ffn, ParallelFFN):  # Gemma 4: dense(x) + sparse(x)
            experts = RecordingExperts(ffn.sparse.experts, events)
            recorded = ParallelFFN(
                dense=_recording(events, "gpu branch", ffn.dense),
                sparse=dataclasses.replace(ffn.sparse, experts=experts),
            )
        else:  # Qwen3.5/3.6: routed(x) + shared(x)
            experts = RecordingExperts(ffn.routed.experts, events)
            recorded = MoEWithSharedExpert(
                routed=dataclasses.replace(ffn.routed, experts=experts),
                shared=_recording(events, "gpu branch", ffn.shared),  # type: ignore[arg-type]
            )
        torch.testing.assert_close(recorded(x), ffn(x), rtol=0, atol=0)
        assert events == ["experts start", "gpu branch", "experts result"]
