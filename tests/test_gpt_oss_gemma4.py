"""gpt-oss and Gemma 4 beyond the shared logits runner: chat templates from the converted metadata, the
GGUF layout llama.cpp expects, Gemma 4's `tokenizer.json` vocabulary, and the FFN split of Gemma 4."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import pytest
import torch

import tandem
from tandem.convert import convert_hf
from tandem.gguf import open_gguf
from tandem.layers.ffn import ParallelFFN
from tandem.tokenizer import chat_template_from_metadata, render_chat

CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What time is it?"},
    {"role": "assistant", "content": "It is half past four."},
    {"role": "user", "content": "Thank you!"},
]


def _hf_render(hf_dir: Path) -> str:
    """transformers' own rendering of the checkpoint's template (what apply_chat_template does)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    config = json.loads((hf_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    rendered, _ = render_jinja_template(
        [CONVERSATION], chat_template=config["chat_template"], add_generation_prompt=True,
        bos_token=config.get("bos_token") or "", eos_token=config.get("eos_token") or "",
    )  # fmt: skip
    return rendered[0]


@pytest.mark.parametrize("fixture", ["tiny_gpt_oss_gguf", "tiny_gemma4_gguf"])
def test_chat_template_from_gguf_metadata(fixture: str, request: pytest.FixtureRequest) -> None:
    """The template the converter copied from tokenizer_config renders like transformers' own, and the
    rendered turns tokenize to the special tokens."""
    hf_dir, gguf_path = request.getfixturevalue(fixture)
    with tandem.LLM(gguf_path, cache_type="f32", threads=1, n_ctx=256) as llm:
        template = chat_template_from_metadata(llm.file.metadata)
        assert template == json.loads((hf_dir / "tokenizer_config.json").read_text())["chat_template"]
        md = llm.file.metadata
        bos = md["tokenizer.ggml.tokens"][md["tokenizer.ggml.bos_token_id"]]
        text = render_chat(template, CONVERSATION, bos_token=bos)
        assert text == _hf_render(hf_dir)
        tok = llm.tokenizer
        assert llm.apply_chat_template(CONVERSATION) == text
        ids = llm.tokenize(text, add_special=False)
        turn = "<|start|>" if llm.config.arch == "gpt-oss" else "<start_of_turn>"
        assert ids.count(tok.vocab.token_to_id[turn]) == len(CONVERSATION) + 1 - (fixture == "tiny_gemma4_gguf")


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
        cache = llm.model.new_cache(64, torch.float32, 64)
        assert [tuple(kv.k.shape[1:]) for kv in cache.layers] == [(2, 16), (1, 32), (2, 16), (1, 32)]
        block = llm.model.blocks[1]
        assert isinstance(block.ffn, ParallelFFN) and block.ffn_norm is None
        x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(block.ffn(x), block.ffn.dense(x) + block.ffn.sparse(x))


def test_cpu_experts_run_as_one_ggml_graph(
    tiny_gpt_oss_gguf: tuple[Path, Path], tiny_gemma4_gguf: tuple[Path, Path], tmp_path: Path
) -> None:
    """On the CPU, gpt-oss's experts (biases, clamped SwiGLU) and a quantized Gemma 4's (fused gate_up, ggml's
    table GEGLU, per-expert scale) run as one ggml graph per layer; a float Gemma 4 keeps transformers' tanh
    formula, which no ggml op computes, and runs its products one by one."""
    gemma4_q8 = convert_hf(tiny_gemma4_gguf[0], tmp_path / "gemma4-q8_0.gguf", "q8_0")
    for path, one_graph in ((tiny_gpt_oss_gguf[1], True), (gemma4_q8, True), (tiny_gemma4_gguf[1], False)):
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
