"""gpt-oss and Gemma 4 beyond the shared logits runner: chat templates from the converted metadata, the
GGUF layout llama.cpp expects, Gemma 4's `tokenizer.json` vocabulary, the FFN split of Gemma 4, and Gemma 4's
logits against llama.cpp's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from llamacpp_logits import assert_logits_match_llama_cpp

import tandem
import tandem.api
from tandem.cli.main import main
from tandem.convert import convert_hf
from tandem.gguf import open_gguf
from tandem.layers.ffn import ParallelFFN
from tandem.runtime.sampling import SamplingParams
from tandem.tokenizer import chat_template_from_metadata, render_chat

CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What time is it?"},
    {"role": "assistant", "content": "It is half past four."},
    {"role": "user", "content": "Thank you!"},
]


def _hf_tokenizer(hf_dir: Path) -> Any:
    """transformers' tokenizer of the checkpoint. A SentencePiece-only one (the tiny Gemma 4) is loaded as
    transformers' SentencePiece backend: AutoTokenizer would convert it to a fast tokenizer, which needs
    protobuf, not a dependency here."""
    if (hf_dir / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(hf_dir)
    from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

    return SentencePieceBackend.from_pretrained(hf_dir)


def _hf_render(hf_tok: Any, messages: list[dict[str, str]], **kw: Any) -> str:
    """transformers' apply_chat_template of the checkpoint's own template (bos/eos from its tokenizer)."""
    return str(hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw))


@pytest.mark.parametrize("fixture", ["tiny_gpt_oss_gguf", "tiny_gemma4_gguf"])
def test_chat_template_from_gguf_metadata(fixture: str, request: pytest.FixtureRequest) -> None:
    """The template the converter copied from tokenizer_config renders like transformers' apply_chat_template,
    and every turn of the rendering opens with the turn's special token."""
    hf_dir, gguf_path = request.getfixturevalue(fixture)
    with tandem.LLM(gguf_path, cache_type="f32", threads=1, n_ctx=256) as llm:
        template = chat_template_from_metadata(llm.file.metadata)
        assert template == json.loads((hf_dir / "tokenizer_config.json").read_text())["chat_template"]
        md = llm.file.metadata
        bos = md["tokenizer.ggml.tokens"][md["tokenizer.ggml.bos_token_id"]]
        text = render_chat(template, CONVERSATION, bos_token=bos)
        assert text == _hf_render(_hf_tokenizer(hf_dir), CONVERSATION)
        tok = llm.tokenizer
        assert llm.apply_chat_template(CONVERSATION) == text
        ids = llm.tokenize(text, add_special=False)
        turn = "<|start|>" if llm.config.arch == "gpt-oss" else "<|turn>"
        assert ids.count(tok.vocab.token_to_id[turn]) == len(CONVERSATION) + 1  # + the generation prompt


# Gemma 4's turns for CONVERSATION, written out from its published format: the system message is a turn of its own
GEMMA4_TURNS = (
    "<bos><|turn>system\n{think}You answer briefly.<turn|>\n<|turn>user\nWhat time is it?<turn|>\n"
    "<|turn>model\nIt is half past four.<turn|>\n<|turn>user\nThank you!<turn|>\n<|turn>model\n"
)
NO_THOUGHT = "<|channel>thought\n<channel|>"  # thinking off: the generation prompt closes an empty thought


def test_gemma4_chat_format(tiny_gemma4_gguf: tuple[Path, Path]) -> None:
    """The tiny Gemma 4's template renders Gemma 4's format, in tandem as in transformers, with thinking off
    (enable_thinking undefined, which is what LLM.apply_chat_template passes by default, or false) and on (through
    its chat_template_kwargs too); the rendered
    prompts tokenize as transformers tokenizes them, with every marker a single special token."""
    hf_dir, gguf_path = tiny_gemma4_gguf
    hf = _hf_tokenizer(hf_dir)
    user_only = CONVERSATION[1:2]
    developer = [{"role": "developer", "content": "  Be brief.\n"}, *user_only]
    cases: list[tuple[list[dict[str, str]], dict[str, Any], str]] = [
        (CONVERSATION, {}, GEMMA4_TURNS.format(think="") + NO_THOUGHT),
        (CONVERSATION, {"enable_thinking": False}, GEMMA4_TURNS.format(think="") + NO_THOUGHT),
        (CONVERSATION, {"enable_thinking": True}, GEMMA4_TURNS.format(think="<|think|>")),
        (user_only, {}, "<bos><|turn>user\nWhat time is it?<turn|>\n<|turn>model\n" + NO_THOUGHT),
        (user_only, {"enable_thinking": True},  # thinking opens a system turn of its own
         "<bos><|turn>system\n<|think|><turn|>\n<|turn>user\nWhat time is it?<turn|>\n<|turn>model\n"),
        (developer, {}, "<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nWhat time is it?<turn|>\n<|turn>model\n"
         + NO_THOUGHT),
    ]  # fmt: skip
    with tandem.LLM(gguf_path, cache_type="f32", threads=1, n_ctx=256) as llm:
        template = chat_template_from_metadata(llm.file.metadata)
        tok = llm.tokenizer
        for messages, kw, want in cases:
            text = render_chat(template, messages, bos_token=tok.piece_text(tok.bos_id), **kw)
            assert text == want, kw
            assert _hf_render(hf, messages, **kw) == want, kw
            assert llm.apply_chat_template(messages, chat_template_kwargs=kw) == want, kw  # --chat-template-kwargs
            ids = llm.tokenize(text, add_special=False)
            assert ids == hf(text, add_special_tokens=False)["input_ids"], kw
        assert llm.apply_chat_template(CONVERSATION) == cases[0][2]

        types = llm.file.metadata["tokenizer.ggml.token_type"]
        for marker in ("<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>"):
            tid = tok.vocab.token_to_id[marker]
            assert llm.tokenize(f"a{marker}b", add_special=False)[1] == tid, marker
            assert tid in hf(marker, add_special_tokens=False)["input_ids"], marker
            # as llama.cpp writes Gemma 4: the channel markers stay visible for chat parsers
            visible = marker in ("<|channel>", "<channel|>")
            assert types[tid] == (gguf.TokenType.USER_DEFINED if visible else gguf.TokenType.CONTROL), marker


def test_cli_chat_template_kwargs(tiny_gemma4_gguf: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """`--chat-template-kwargs JSON` reaches the template (thinking on: Gemma 4 prompts no empty thought, so the
    reply differs from the one with thinking off); what cannot be template variables is a one-line error, exit 2,
    before the model loads."""
    model = str(tiny_gemma4_gguf[1])
    base = ["run", "-m", model, "-p", "What time is it?", "-n", "4", "--temp", "0", "-t", "1", "-c", "128"]
    base += ["-ctk", "f32", "--chat"]  # as the LLM below
    with tandem.LLM(model, cache_type="f32", threads=1, n_ctx=128) as llm:
        msgs = [{"role": "user", "content": "What time is it?"}]
        replies = {
            on: llm.chat(msgs, chat_template_kwargs={"enable_thinking": on}, max_tokens=4, temperature=0)
            for on in (0, 1)
        }
    assert replies[0] != replies[1]  # else the CLI rows below could not tell whether the variable got through
    for on in (0, 1):
        assert main([*base, "--chat-template-kwargs", f'{{"enable_thinking": {"true" if on else "false"}}}']) == 0
        assert capsys.readouterr().out == replies[on] + "\n"
    bad = {
        "{enable_thinking: true}": "is not JSON",
        "[1, 2]": "must be a JSON object",
        '{"messages": []}': "may not set messages",
    }
    for text, message in bad.items():
        assert main([*base, "--chat-template-kwargs", text]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert main([*base[:-1], "--chat-template-kwargs", "{}"]) == 2
    assert "needs --chat" in capsys.readouterr().err


def test_gemma4_turn_end_stops_generation(tiny_gemma4_gguf: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """`<turn|>` ends a model turn: like llama.cpp, the converter writes no end-of-turn id for Gemma 4 and the
    loader makes `<turn|>` end the generation by its text (CONTROL type), next to `<eos>`; a chat reply stops
    there."""
    gguf_path = tiny_gemma4_gguf[1]
    with tandem.LLM(gguf_path, cache_type="f32", threads=1, n_ctx=256) as llm:
        md, tok = llm.file.metadata, llm.tokenizer
        assert "tokenizer.ggml.eot_token_id" not in md
        assert md["tokenizer.ggml.tokens"][md["tokenizer.ggml.eos_token_id"]] == "<eos>"
        assert {tok.vocab.tokens[i] for i in tok.stop_ids} == {"<eos>", "<turn|>"}
        turn_end, word = tok.vocab.token_to_id["<turn|>"], tok.vocab.token_to_id["The"]

        class Scripted:  # the sampler: one word, then the end of the turn, then more (never reached)
            def __init__(self, params: object) -> None:
                self.tokens = iter([word, turn_end, word])
                self.params = SamplingParams(temperature=1.0)  # not plain greedy: the engine asks this sampler

            def __call__(self, logits: torch.Tensor, history: list[int]) -> int:
                return next(self.tokens)

        monkeypatch.setattr(tandem.api, "Sampler", Scripted)
        assert llm.chat(CONVERSATION, max_tokens=5) == "The"


def test_gpt_oss_gguf_layout(tiny_gpt_oss_gguf: tuple[Path, Path]) -> None:
    """llama.cpp's names and shapes: split experts [E, F, D] / [E, D, F] with biases, sinks, YaRN-free rope."""
    f = open_gguf(tiny_gpt_oss_gguf[1])
    t = f.tensors
    assert t["blk.0.ffn_gate_exps.weight"].shape == (4, 32, 64)
    assert t["blk.0.ffn_up_exps.weight"].shape == (4, 32, 64)
    assert t["blk.0.ffn_down_exps.weight"].shape == (4, 64, 32)
    assert t["blk.0.ffn_gate_exps.bias"].shape == (4, 32)
    assert t["blk.0.ffn_down_exps.bias"].shape == (4, 64)
    assert t["blk.1.attn_sinks.weight"].shape == (4,)
    assert {"blk.0.attn_q.bias", "blk.0.ffn_gate_inp.bias", "blk.0.post_attention_norm.weight"} <= set(t)
    assert f.arch_get("attention.sliding_window") == 8 and f.arch_get("expert_feed_forward_length") == 32
    assert f.arch_get("rope.scaling.type") is None
    assert f.get("tokenizer.ggml.pre") == "gpt-4o"


def test_gpt_oss_interleaved_experts_are_split_like_llama_cpp(tiny_gpt_oss_gguf: tuple[Path, Path]) -> None:
    """gate = even columns of transformers' gate_up_proj [E, D, 2F], up = odd ones, both transposed."""
    from safetensors import safe_open

    hf_dir, gguf_path = tiny_gpt_oss_gguf
    with safe_open(hf_dir / "model.safetensors", "pt") as st:
        fused = st.get_tensor("model.layers.1.mlp.experts.gate_up_proj")  # [E, D, 2F]
        fused_bias = st.get_tensor("model.layers.1.mlp.experts.gate_up_proj_bias")
    t = open_gguf(gguf_path).tensors

    def read(name: str) -> torch.Tensor:
        return torch.from_numpy(t[name].data.view("<f4").reshape(t[name].shape).copy())

    torch.testing.assert_close(read("blk.1.ffn_gate_exps.weight"), fused[..., 0::2].transpose(1, 2))
    torch.testing.assert_close(read("blk.1.ffn_up_exps.weight"), fused[..., 1::2].transpose(1, 2))
    torch.testing.assert_close(read("blk.1.ffn_up_exps.bias"), fused_bias[:, 1::2])


def test_gemma4_gguf_layout_and_parallel_ffn(tiny_gemma4_gguf: tuple[Path, Path]) -> None:
    """Per-kind head sizes and KV heads, K = V on global layers, proportional rope factors, and an FFN
    whose dense branch is computed apart from the routed experts."""
    f = open_gguf(tiny_gemma4_gguf[1])
    assert f.arch_get("attention.head_count_kv") == [2, 1, 2, 1]
    assert (f.arch_get("attention.key_length"), f.arch_get("attention.key_length_swa")) == (32, 16)
    assert "blk.1.attn_v.weight" not in f.tensors and "blk.0.attn_v.weight" in f.tensors
    assert f.tensors["blk.0.ffn_gate_up_exps.weight"].shape == (4, 64, 64)
    freqs = f.tensors["rope_freqs.weight"].data.view("<f4")
    assert list(freqs[:4]) == [1.0] * 4 and (freqs[4:] == 1e30).all()
    with tandem.LLM(tiny_gemma4_gguf[1], cache_type="f32", threads=1, n_ctx=64) as llm:
        cache = llm.model.new_pool(1, 64, torch.float32, 64).caches[0]
        assert [tuple(kv.k.shape[1:]) for kv in cache.layers] == [(2, 16), (1, 32), (2, 16), (1, 32)]
        block = llm.model.blocks[1]
        assert isinstance(block.ffn, ParallelFFN) and block.ffn_norm is None
        x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(block.ffn(x), block.ffn.dense(x) + block.ffn.sparse(x))


GEMMA4_LLAMA_CPP = Path(__file__).parent / "fixtures" / "gemma4_llamacpp.json"


@pytest.mark.parametrize("cpu_graph", ["1", "0"], ids=["step-graphs", "layer-path"])
def test_gemma4_logits_match_llama_cpp(
    tiny_gemma4_q8_0_gguf: tuple[Path, Path], cpu_graph: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny Gemma 4 in Q8_0 against llama.cpp reading the same GGUF (scripts/record_qwen35moe_fixture.py
    --fixture gemma4): a prefill in one batch and the last tokens decoded one at a time, on 7 and 80 tokens
    (past the sliding window of 16), through the CPU step graphs (the default) and the layer path. Quantized, so
    that both GEGLUs read ggml's f16 GELU table in tandem as in llama.cpp; a float file keeps transformers' tanh
    formula, ~1e-3 from llama.cpp (docs/gemma4_gelu.md)."""
    monkeypatch.setenv("TANDEM_CPU_GRAPH", cpu_graph)
    fx = json.loads(GEMMA4_LLAMA_CPP.read_text(encoding="utf-8"))
    model = fx["models"]["gemma4"]
    with tandem.LLM(tiny_gemma4_q8_0_gguf[1], cache_type="f32", threads=1, n_ctx=64) as llm:
        assert llm.config.activation == "gelu_tanh_ggml"
    assert_logits_match_llama_cpp(tiny_gemma4_q8_0_gguf[1], model["prompts"], model["gguf_sha256"],
                                  label="gemma4 Q8_0", script="scripts/record_qwen35moe_fixture.py --fixture gemma4",
                                  columns=fx["columns"], decode_steps=fx["decode_steps"])  # fmt: skip


def test_cpu_experts_run_as_one_ggml_graph(
    tiny_gpt_oss_gguf: tuple[Path, Path], tiny_gemma4_gguf: tuple[Path, Path], tiny_gemma4_q8_0_gguf: tuple[Path, Path]
) -> None:
    """On the CPU, gpt-oss's experts (biases, clamped SwiGLU) and a quantized Gemma 4's (fused gate_up, ggml's
    table GEGLU, per-expert scale) run as one ggml graph per layer; a float Gemma 4 keeps transformers' tanh
    formula, which no ggml op computes, and runs its products one by one."""
    for path, one_graph in (
        (tiny_gpt_oss_gguf[1], True),
        (tiny_gemma4_q8_0_gguf[1], True),
        (tiny_gemma4_gguf[1], False),
    ):
        with tandem.LLM(path, cache_type="f32", threads=1, n_ctx=64) as llm:
            ffns = [b.ffn.sparse if isinstance(b.ffn, ParallelFFN) else b.ffn for b in llm.model.blocks]
            experts = [ffn.experts for ffn in ffns if hasattr(ffn, "experts")]
            assert experts and all((e._graph is not None) == one_graph for e in experts), path.name
            assert len(llm.generate_ids([2, 300, 301], max_tokens=3, temperature=0)) == 3


def _gemma4_tokenizer_json(out_dir: Path) -> None:
    """A Gemma-4-style tokenizer.json: BPE over raw UTF-8 with byte fallback, spaces as U+2581."""
    from tiny_models import _lines
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials + bytes_, show_progress=False)
    tok.train_from_iterator(_lines(), trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in ("<|turn>", "<turn|>")])
    tok.add_tokens([AddedToken("<|tool_call>", special=False, normalized=False)])
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "extra_special_tokens": ["<|turn>", "<turn|>"], "chat_template": "{{ bos_token }}",
        "tokenizer_class": "GemmaTokenizer",
    }))  # fmt: skip


def test_gemma4_tokenizer_json_vocabulary(tiny_gemma4_gguf: tuple[Path, Path], tmp_path: Path) -> None:
    """A checkpoint with Gemma 4's tokenizer.json converts to llama.cpp's `gemma4` vocabulary."""
    hf_dir = tmp_path / "hf"
    shutil.copytree(tiny_gemma4_gguf[0], hf_dir)
    for name in ("tokenizer.model", "tokenizer_config.json"):
        (hf_dir / name).unlink()
    _gemma4_tokenizer_json(hf_dir)
    md = open_gguf(convert_hf(hf_dir, tmp_path / "g4.gguf", "f32")).metadata
    tokens = md["tokenizer.ggml.tokens"]
    types = md["tokenizer.ggml.token_type"]
    assert md["tokenizer.ggml.model"] == "gemma4" and md["tokenizer.ggml.merges"]
    assert md["tokenizer.ggml.add_bos_token"] is True and md["tokenizer.ggml.add_space_prefix"] is False
    kind = {text: types[i] for i, text in enumerate(tokens)}
    assert kind["<0x41>"] == gguf.TokenType.BYTE
    assert kind["<bos>"] == kind["<|turn>"] == gguf.TokenType.CONTROL
    assert kind["<|tool_call>"] == gguf.TokenType.USER_DEFINED
    assert set(md["tokenizer.ggml.scores"]) == {-1000.0}
    assert md["tokenizer.ggml.bos_token_id"] == tokens.index("<bos>")


def test_gemma4_multimodal_checkpoint_converts_its_text_model(tiny_gemma4_gguf: tuple[Path, Path],
                                                             tmp_path: Path) -> None:  # fmt: skip
    """Gemma4ForConditionalGeneration: text_config at the top, `model.language_model.*` tensors, the vision
    tower left out: the same tensors as the text-only checkpoint."""
    from safetensors.numpy import load_file, save_file

    src, text_gguf = tiny_gemma4_gguf
    hf_dir = tmp_path / "hf"
    shutil.copytree(src, hf_dir)
    tensors = {k.replace("model.", "model.language_model.", 1): v
               for k, v in load_file(src / "model.safetensors").items()}  # fmt: skip
    tensors["model.vision_tower.encoder.layers.0.mlp.up_proj.weight"] = tensors["model.language_model.norm.weight"]
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    text_config = json.loads((src / "config.json").read_text())
    config = {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": {**text_config, "model_type": "gemma4_text"},
        "vision_config": {"hidden_size": 8},
    }
    (hf_dir / "config.json").write_text(json.dumps(config))
    ours, ref = open_gguf(convert_hf(hf_dir, tmp_path / "mm.gguf", "f32")), open_gguf(text_gguf)
    assert sorted(ours.tensors) == sorted(ref.tensors)
    for name, t in ref.tensors.items():
        assert bytes(ours.tensors[name].data) == bytes(t.data), name
