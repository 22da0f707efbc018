"""Qwen3.5-MoE / Qwen3-Next specifics: the delta-net's two forms, recurrent state under prefix reuse,
the converted metadata and the chat template. (Logits against transformers: test_models.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from llamacpp_logits import assert_logits_match_llama_cpp
from torch.utils._python_dispatch import TorchDispatchMode

import tandem
from tandem.gguf import open_gguf
from tandem.layers.delta_net import (
    DeltaNetState,
    StateOrderError,
    causal_conv1d,
    chunked_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from tandem.runtime.engine import Engine
from tandem.runtime.kv_cache import KVCache
from tandem.tokenizer.chat_template import chat_template_from_metadata, render_chat

REUSE_ATOL = 2e-5  # same model, same tokens, different batching: only float32 rounding differs
LLAMA_CPP_FIXTURE = Path(__file__).parent / "fixtures" / "qwen35moe_llamacpp.json"


def _inputs(t: int, h: int = 3, dk: int = 8, dv: int = 8, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=gen), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=gen), dim=-1)
    v = torch.randn(t, h, dv, generator=gen)
    g = -torch.rand(t, h, generator=gen) * 0.3  # decays 0.74..1
    beta = torch.rand(t, h, generator=gen)
    return [q, k, v, g, beta]


@pytest.mark.parametrize("t", [1, 5, 64, 65, 150])
def test_chunked_matches_recurrent(t: int) -> None:
    q, k, v, g, beta = _inputs(t)
    init = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(1))
    s_rec, s_chk = init.clone(), init.clone()
    out_rec = recurrent_gated_delta_rule(q, k, v, g, beta, s_rec)
    out_chk = chunked_gated_delta_rule(q, k, v, g, beta, s_chk)
    torch.testing.assert_close(out_chk, out_rec, atol=1e-5, rtol=0)
    torch.testing.assert_close(s_chk, s_rec, atol=1e-5, rtol=0)


def test_chunked_split_anywhere_is_the_same() -> None:
    """Prefill in uneven pieces (state carried between calls) equals one call."""
    q, k, v, g, beta = _inputs(100)
    whole = torch.zeros(3, 8, 8)
    ref = chunked_gated_delta_rule(q, k, v, g, beta, whole)
    state = torch.zeros(3, 8, 8)
    parts = [chunked_gated_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state)
             for a, b in ((0, 30), (30, 97), (97, 100))]  # fmt: skip
    torch.testing.assert_close(torch.cat(parts), ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(state, whole, atol=1e-5, rtol=0)


def test_causal_conv1d_streams() -> None:
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(20, 6, generator=gen), torch.randn(6, 4, generator=gen)
    ref = causal_conv1d(x, torch.zeros(3, 6), w)
    state = torch.zeros(3, 6)
    steps = torch.cat([causal_conv1d(x[i : i + 1], state, w) for i in range(20)])
    torch.testing.assert_close(steps, ref, atol=1e-6, rtol=0)
    # by hand: out[t] = sum_j x[t - 3 + j] * w[:, j]
    padded = torch.cat([torch.zeros(3, 6), x])
    manual = torch.stack([(padded[i : i + 4].T * w).sum(-1) for i in range(20)])
    torch.testing.assert_close(ref, manual, atol=1e-6, rtol=0)


def test_state_snapshot_restore() -> None:
    s = DeltaNetState(conv=torch.ones(3, 4), ssm=torch.ones(2, 4, 4), length=7)
    snap = s.snapshot()
    s.conv.zero_()
    s.length = 9
    s.restore(snap)
    assert s.length == 7 and bool((s.conv == 1).all())
    s.restore(None)
    assert s.length == 0 and not s.ssm.any()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(4, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefix_reuse_matches_fresh_run(tiny_qwen35moe_gguf: tuple[Path, Path]) -> None:
    """Multi-turn reuse of the cached prefix gives the logits of a fresh run, whether the new prompt extends
    the cache, diverges after the last checkpoint, or diverges before it (back to the start)."""
    _, path = tiny_qwen35moe_gguf
    turn1 = _prompt(70, 1)  # longer than a delta-net chunk
    with tandem.LLM(path, cache_type="f32", threads=2) as llm:
        engine = llm.engine

        def fresh(ids: list[int]) -> np.ndarray:
            return llm.logits(ids)[-1]

        # name: (prompt, tokens that must be recomputed); run in this order, each after the previous one
        cases = {
            "extends the cache": (turn1 + [7, 8, 9] + _prompt(12, 2), 12),
            "diverges after the checkpoint": (turn1 + _prompt(9, 3), 9 + 1),  # back to the checkpoint at 69
            "same prompt again": (turn1, 1),
            "diverges early": (turn1[:10] + _prompt(30, 4), 40),  # no checkpoint below 10: from the start
        }
        expected = {name: fresh(ids) for name, (ids, _) in cases.items()}
        engine.reset()
        engine.feed(turn1)
        assert [pos for pos, _ in engine.cache.checkpoints] == [69]
        for t in (7, 8, 9):  # "generated" tokens appended after the prompt
            engine.append([t])
        computed = []
        forward = engine.model.forward

        def counting_forward(ids: torch.Tensor, *args: object, **kw: bool) -> torch.Tensor:
            computed.append(len(ids))
            return forward(ids, *args, **kw)  # type: ignore[arg-type]

        engine.model.forward = counting_forward  # type: ignore[method-assign]
        for name, (ids, n_computed) in cases.items():
            computed.clear()
            got = engine.feed(ids).numpy()
            diff = float(np.abs(got - expected[name]).max())
            print(f"{name}: max|diff| {diff:.2e}, recomputed {sum(computed)}")
            assert diff < REUSE_ATOL, name
            assert sum(computed) == n_computed, name
            assert engine.cache.tokens == ids and engine.cache.length == len(ids)


def test_state_refuses_wrong_position(tiny_qwen35moe_gguf: tuple[Path, Path]) -> None:
    _, path = tiny_qwen35moe_gguf
    with tandem.LLM(path, cache_type="f32", threads=2) as llm:
        llm.engine.feed(_prompt(10, 5))
        llm.engine.cache.length = 4  # a truncation that bypasses KVCache.truncate
        with pytest.raises(StateOrderError):
            llm.engine.append([5])


# Ops that read a tensor's value on the host (a sync on a GPU, forbidden while capturing a CUDA graph) or
# whose output shape depends on values.
HOST_READS = {"item", "_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "_unique2",
              "unique_dim", "unique_consecutive", "bincount"}  # fmt: skip


class NoHostReads(TorchDispatchMode):
    """Fails on HOST_READS ops, except under the ggml CPU kernels (on a GPU model they are host ops, where
    the captured step is split)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        if (name in HOST_READS or str(func) == "aten.repeat_interleave.Tensor") and not _in_ggml_kernels():
            raise AssertionError(f"{func} reads tensor values on the host inside the captured step")
        return func(*args, **(kwargs or {}))


def _in_ggml_kernels() -> bool:
    import inspect

    return any(frame.filename.endswith("quant/ggml_cpu.py") for frame in inspect.stack(0))


class EagerDecodeGraph:
    """cuda/graphs.py's DecodeGraph run eagerly on the CPU: the same static inputs (the embedding copied into
    `x`, the position filled into a tensor) and the same `blocks_and_head` call that a capture records, under
    NoHostReads. Only `start` differs: on the CPU attention stores K/V at `start` (on a GPU by `positions`);
    the delta-net layers ignore it inside `captured_step`."""

    def __init__(self, engine: Engine) -> None:
        self.model, self.cache = engine.model, engine.cache
        self.x = torch.zeros(1, self.model.cfg.hidden, dtype=self.model.dtype)
        self.positions = torch.zeros(1, dtype=torch.long)
        self.steps = 0

    def __call__(self, token: int) -> torch.Tensor:
        self.x.copy_(self.model.embed_tokens(torch.tensor([token])))
        self.positions.fill_(self.cache.length)
        with NoHostReads():
            logits = self.model.blocks_and_head(self.x, self.positions, self.cache, start=self.cache.length)
        self.steps += 1
        return logits[-1]


def _state_pointers(cache: KVCache) -> list[int]:
    return [t.data_ptr() for layer in cache.layers if isinstance(layer, DeltaNetState) for t in (layer.conv, layer.ssm)]


@pytest.mark.parametrize("fixture", ["tiny_qwen35moe_gguf", "tiny_qwen3next_gguf"])
def test_captured_decode_step_matches_eager(fixture: str, request: pytest.FixtureRequest) -> None:
    """The engine's graph path (captured_step, the DecodeGraph call, advance) run eagerly on the CPU gives the
    logits of the ordinary decode over a multi-turn chat: decode steps, a new turn that restores the recurrent
    checkpoint and one that goes back to the start, each followed by steps; the state tensors stay the ones
    allocated with the cache (a CUDA graph keeps their addresses) and the step reads no value on the host."""
    _, path = request.getfixturevalue(fixture)
    turn1 = _prompt(70, 6)  # longer than a delta-net chunk
    script = [  # (prompt fed, tokens decoded one at a time after it)
        (turn1, _prompt(6, 7)),
        (turn1 + _prompt(5, 8), _prompt(6, 9)),  # diverges after the checkpoint at 69: restored
        (turn1[:10] + _prompt(20, 10), _prompt(4, 11)),  # no checkpoint below 10: back to the start
    ]
    runs = []
    for graph in (False, True):
        with tandem.LLM(path, device="cpu", cache_type="f32", threads=2, n_ctx=256) as llm:
            engine = llm.engine
            assert engine._decode_graph is None  # no graphs on the CPU: the stand-in below plays the graph
            stand_in = EagerDecodeGraph(engine)
            if graph:
                engine._decode_graph, engine._warm = stand_in, True  # type: ignore[assignment]
            pointers = _state_pointers(engine.cache)
            logits = []
            for prompt, steps in script:
                logits.append(engine.feed(prompt).clone())
                for t in steps:
                    logits.append(engine.append([t]).clone())
                    assert engine.cache.tokens[-1] == t and len(engine.cache.tokens) == engine.cache.length
                    lengths = {layer.length for layer in engine.cache.layers if isinstance(layer, DeltaNetState)}
                    assert lengths == {engine.cache.length}, (lengths, engine.cache.length)
                assert _state_pointers(engine.cache) == pointers, "a recurrent state tensor was reallocated"
            # feed's last prompt token and every decoded token went through the graph path
            assert stand_in.steps == (sum(1 + len(steps) for _, steps in script) if graph else 0)
            runs.append(torch.stack(logits))
    eager, graphed = runs
    diff = (graphed - eager).abs().max().item()
    print(f"{fixture}: max|captured - eager| over {len(eager)} steps {diff:.2e}")
    assert diff < REUSE_ATOL, diff


def test_captured_delta_net_step_ignores_start_and_count(tiny_qwen35moe_gguf: tuple[Path, Path]) -> None:
    """Inside captured_step a delta-net layer neither checks `start` (the graph passes 0) nor counts the
    position; KVCache.advance counts it, and a cache out of step with its recurrent layers is refused."""
    _, path = tiny_qwen35moe_gguf
    with tandem.LLM(path, device="cpu", cache_type="f32", threads=2, n_ctx=64) as llm:
        engine = llm.engine
        engine.feed(_prompt(9, 12))
        i = next(i for i, layer in enumerate(engine.cache.layers) if isinstance(layer, DeltaNetState))
        block, state = engine.model.blocks[i], engine.cache.layers[i]
        x = torch.randn(1, engine.model.cfg.hidden)
        conv = state.conv.clone()
        with engine.cache.captured_step():
            block.mixer(x, torch.zeros(1, dtype=torch.long), state, 0)
        assert state.length == 9 and not torch.equal(state.conv, conv)  # stepped in place, not counted
        with pytest.raises(StateOrderError):  # outside captured_step the position is checked again
            block.mixer(x, torch.zeros(1, dtype=torch.long), state, 0)
        engine.cache.advance([5])
        assert state.length == engine.cache.length == 10 and engine.cache.tokens[-1] == 5
        engine.cache.length = 4  # a truncation that bypasses KVCache.truncate
        with pytest.raises(StateOrderError), engine.cache.captured_step():
            pass


@pytest.mark.parametrize("fixture", ["tiny_qwen35moe_gguf", "tiny_qwen3next_gguf"])
def test_converted_metadata(fixture: str, request: pytest.FixtureRequest) -> None:
    _, path = request.getfixturevalue(fixture)
    f = open_gguf(path)
    arch = f.arch
    assert arch == ("qwen35moe" if fixture == "tiny_qwen35moe_gguf" else "qwen3next")
    assert f.metadata[f"{arch}.attention.recurrent_layers"] == [True, False, True, False]
    assert f.metadata[f"{arch}.full_attention_interval"] == 2
    assert f.metadata[f"{arch}.rope.dimension_count"] == 8
    assert f.metadata[f"{arch}.ssm.inner_size"] == 64 and f.metadata[f"{arch}.ssm.time_step_rank"] == 4
    assert f.metadata[f"{arch}.expert_shared_feed_forward_length"] == 48
    split = arch == "qwen35moe"
    assert ("blk.0.ssm_beta.weight" in f.tensors) == split and ("blk.0.ssm_ba.weight" in f.tensors) != split
    assert f.tensors["blk.0.ssm_conv1d.weight"].shape == (128, 4)
    assert "blk.1.attn_qkv.weight" not in f.tensors and "blk.1.ssm_a" not in f.tensors  # attention layer
    cfg = tandem.models.read_config(f)
    assert cfg.recurrent == (True, False, True, False)


def test_chat_template_renders_and_generates(tiny_qwen35moe_gguf: tuple[Path, Path]) -> None:
    _, path = tiny_qwen35moe_gguf
    with tandem.LLM(path, cache_type="f32", threads=2) as llm:
        template = chat_template_from_metadata(llm.file.metadata)
        messages = [
            {"role": "user", "content": "Where are you going?"},
            {"role": "assistant", "content": "<think>\nhm\n</think>\n\nTo the library."},
            {"role": "user", "content": "How many books?"},
        ]
        text = render_chat(template, messages)
        assert text == (
            "<|im_start|>user\nWhere are you going?<|im_end|>\n<|im_start|>assistant\nTo the library.<|im_end|>\n"
            "<|im_start|>user\nHow many books?<|im_end|>\n<|im_start|>assistant\n<think>\n"
        )
        no_think = render_chat(template, messages[:1], enable_thinking=False)
        assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        ids = llm.tokenize(text, add_special=False)
        assert ids[0] == llm.tokenize("<|im_start|>", add_special=False)[0]
        out = llm.generate_ids(ids, max_tokens=5, temperature=0)
        assert len(out) <= 5


@pytest.mark.parametrize("arch", ["qwen35moe", "qwen3next"])
def test_logits_match_llama_cpp(arch: str, request: pytest.FixtureRequest) -> None:
    """Against llama.cpp reading the same GGUF (scripts/record_qwen35moe_fixture.py): a prefill in one batch
    (its chunked delta-net) and the last tokens decoded one at a time (its recurrent form)."""
    _, path = request.getfixturevalue(f"tiny_{arch}_gguf")
    fx = json.loads(LLAMA_CPP_FIXTURE.read_text(encoding="utf-8"))
    model = fx["models"][arch]
    assert_logits_match_llama_cpp(path, model["prompts"], model["gguf_sha256"], label=arch,
                                  script="scripts/record_qwen35moe_fixture.py", columns=fx["columns"],
                                  decode_steps=fx["decode_steps"])  # fmt: skip


def test_value_head_reorder_is_grouped_to_tiled() -> None:
    """llama.cpp's qwen35moe layout: value head (key head k, i-th of its group) moves to i * Hk + k."""
    from tandem.convert.qwen35moe import _tile

    n_k, n_v, d = 2, 6, 3
    grouped = np.arange(n_v * d * 2).reshape(n_v * d, 2)  # rows: head-major, d rows per head
    tiled = _tile(grouped, 0, n_k, n_v, d)
    r = n_v // n_k
    for k in range(n_k):
        for i in range(r):
            src, dst = k * r + i, i * n_k + k
            assert (tiled[dst * d : (dst + 1) * d] == grouped[src * d : (src + 1) * d]).all()


def test_unsupported_hybrid_configs_are_rejected() -> None:
    from tandem.convert.qwen35moe import check_config
    from tandem.errors import ConversionError

    base = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "num_hidden_layers": 2}  # fmt: skip
    check_config(base)
    for bad in ({"mlp_only_layers": [1]}, {"linear_value_head_dim": 32}, {"linear_num_value_heads": 3},
                {"norm_topk_prob": False}, {"layer_types": ["linear_attention"]}):  # fmt: skip
        with pytest.raises(ConversionError):
            check_config({**base, **bad})
