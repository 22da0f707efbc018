"""Qwen3.5-MoE / Qwen3-Next specifics: the delta-net's two forms, recurrent state under prefix reuse,
the converted metadata and the chat template. (Logits against transformers: test_models.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from llamacpp_logits import assert_logits_match_llama_cpp

import tandem
from tandem.gguf import open_gguf
from tandem.layers.delta_net import (
    DeltaNetState,
    StateOrderError,
    causal_conv1d,
    chunked_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from tandem.state.batch import StepBatch
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


@pytest.mark.parametrize("t", [1, 5, 150])
def test_ggml_rule_matches_recurrent(t: int) -> None:
    """ggml's fused op (the CPU path's rule, llama.cpp's) gives the recurrent form's outputs and state, from a
    state in ggml's layout (S transposed per head), with unscaled queries (the op scales its outputs)."""
    from tandem.quant.ggml_ops import ggml_gated_delta_rule

    q, k, v, g, beta = _inputs(t)
    init = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(1))
    s_rec = init.clone()
    out_rec = recurrent_gated_delta_rule(q, k, v, g, beta, s_rec)
    s_ggml = init.transpose(1, 2).contiguous().numpy()
    arrays = [x.contiguous().numpy() for x in (q * 8**0.5, k, v, g, beta)]
    out = torch.from_numpy(ggml_gated_delta_rule(*arrays, s_ggml, n_threads=2))
    torch.testing.assert_close(out, out_rec, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.from_numpy(s_ggml).transpose(1, 2), s_rec, atol=1e-5, rtol=0)
    assert not torch.equal(s_rec, init)


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


@pytest.mark.parametrize("device", [None, "cpu"])
def test_state_snapshot_restore(device: str | None) -> None:
    """A snapshot is a copy (also where it is already on `device`: checkpoints are taken to the host), restored
    in place; the CPU layout of the recurrent state (ggml's, a transposed view) survives the round trip."""
    ssm = torch.arange(32.0).reshape(2, 4, 4).transpose(1, 2)
    s = DeltaNetState(conv=torch.ones(3, 4), ssm=ssm, length=7)
    snap = s.snapshot(device)
    assert snap.ssm.stride() == ssm.stride() and snap.ssm.data_ptr() != ssm.data_ptr()
    s.conv.zero_()
    s.ssm.zero_()
    s.length = 9
    s.restore(snap)
    assert s.length == 7 and bool((s.conv == 1).all()) and s.ssm is ssm
    assert torch.equal(ssm, torch.arange(32.0).reshape(2, 4, 4).transpose(1, 2))
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
        run = engine.runner.run  # every step, through the CPU step graphs or the layers

        def counting_run(pieces: list[tuple[int, list[int]]], all_logits: bool = False) -> torch.Tensor:
            computed.append(sum(len(tokens) for _, tokens in pieces))
            return run(pieces, all_logits)

        engine.runner.run = counting_run  # type: ignore[method-assign]
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


def test_delta_net_layer_checks_but_does_not_count(tiny_qwen35moe_gguf: tuple[Path, Path]) -> None:
    """A delta-net layer refuses a sequence that does not continue where its state is, and counts nothing: the
    runner counts every step's tokens after it (KVCache.advance), which a replayed CUDA graph needs."""
    _, path = tiny_qwen35moe_gguf
    with tandem.LLM(path, device="cpu", cache_type="f32", threads=2, n_ctx=64) as llm:
        engine = llm.engine
        engine.feed(_prompt(9, 12))
        i = next(i for i, layer in enumerate(engine.cache.layers) if isinstance(layer, DeltaNetState))
        block, state, pool = engine.model.blocks[i], engine.cache.layers[i], engine.pool.layers[i]
        x = torch.randn(1, engine.model.cfg.hidden)
        conv = state.conv.clone()
        block.mixer(x, StepBatch.build([(0, 9, [5])], torch.device("cpu")), pool)
        assert state.length == 9 and not torch.equal(state.conv, conv)  # stepped in place, not counted
        with pytest.raises(StateOrderError):
            block.mixer(x, StepBatch.build([(0, 3, [5])], torch.device("cpu")), pool)
        engine.cache.advance([5])
        assert state.length == engine.cache.length == 10 and engine.cache.tokens[-1] == 5


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


@pytest.mark.parametrize("cpu_graph", ["1", "0"])
@pytest.mark.parametrize("arch", ["qwen35moe", "qwen3next"])
def test_logits_match_llama_cpp(
    arch: str, cpu_graph: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against llama.cpp reading the same GGUF (scripts/record_qwen35moe_fixture.py): a prefill in one batch
    (its chunked delta-net) and the last tokens decoded one at a time (its recurrent form); through the CPU step
    graphs (the default) and the layer path."""
    monkeypatch.setenv("TANDEM_CPU_GRAPH", cpu_graph)
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
