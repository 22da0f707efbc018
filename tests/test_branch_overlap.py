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


def test_pcie_experts_split_each_tokens_experts(tiny_qwen3moe_gguf: tuple[object, object]) -> None:
    """--pcie-experts K: OffloadedExperts sends each token's first A - K selected experts to the host op and queues
    the last K on the GPU reader between the host op's start and its result, and adds the two. Here both sides
    are the layer's CPU experts (the host op run in place), so the sum must equal all A experts at once, up to
    float32 rounding of the split sum; that the GPU reader reads host blocks exactly: tests/test_gpu_offload.py."""
    from tandem.weights.offload import OffloadedExperts

    with tandem.LLM(tiny_qwen3moe_gguf[1], device="cpu", cache_type="f32", threads=1, n_ctx=64) as llm:
        moe = next(b.ffn for b in llm.model.blocks if hasattr(b.ffn, "experts"))
        events: list[str] = []
        seen: dict[str, torch.Tensor] = {}

        def pcie(x: torch.Tensor, routing: Routing) -> torch.Tensor:
            events.append("pcie queued")
            seen["pcie"] = routing.ids
            return moe.experts(x, Routing(routing.ids.contiguous(), routing.weights.contiguous()))  # ggml's need

        offloaded = OffloadedExperts(on_cpu=moe.experts, streamed=None, stage_vectors=None, min_batch=32,
                                     pcie=pcie, pcie_slots=1)  # fmt: skip

        def host_start(inputs: list[torch.Tensor], shape: object, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
            events.append("host start")
            inputs = [i.contiguous() for i in inputs]  # as the host op's buffers hold them
            seen["host"] = inputs[1]
            out = moe.experts(inputs[0], Routing(ids=inputs[1], weights=inputs[2])).to(dtype)

            def result() -> torch.Tensor:
                events.append("host result")
                return out

            return result

        offloaded.host.start = host_start  # type: ignore[method-assign]  # the host op, run in place
        x = torch.randn(3, llm.config.hidden, generator=torch.Generator().manual_seed(0))
        routing = moe.router(x)
        assert routing.ids.shape[1] == 2
        torch.testing.assert_close(offloaded(x, routing), moe.experts(x, routing), rtol=1e-6, atol=1e-6)
        assert events == ["host start", "pcie queued", "host result"]
        assert torch.equal(seen["host"], routing.ids[:, :1].int()) and torch.equal(seen["pcie"], routing.ids[:, 1:])
