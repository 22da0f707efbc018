"""HF -> GGUF conversion: tensor names/shapes/types, metadata, tokenizer, quantization, error cases."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import MODEL_TENSOR as T
from gguf import GGMLQuantizationType as Q
from gguf import Keys

from tandem.convert import convert_hf
from tandem.convert.hf_to_gguf import gemma3_swa_layers, swa_period
from tandem.convert.vocab import parse_sentencepiece_model
from tandem.errors import ConversionError
from tandem.gguf.reader import GGUFFile, open_gguf

safetensors_torch = pytest.importorskip("safetensors.torch")
torch = pytest.importorskip("torch")

ARCH_FIXTURES = {"qwen3": "tiny_qwen3_gguf", "qwen3moe": "tiny_qwen3moe_gguf", "gemma3": "tiny_gemma3_gguf"}
OUT_QTYPE = {"f32": Q.F32, "f16": Q.F16, "q8_0": Q.Q8_0}
FILE_TYPE = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}

# per-block tensors each architecture's llama.cpp loader requires
BLOCK_TENSORS = {
    "qwen3": [T.ATTN_NORM, T.ATTN_Q, T.ATTN_K, T.ATTN_V, T.ATTN_OUT, T.ATTN_Q_NORM, T.ATTN_K_NORM,
              T.FFN_NORM, T.FFN_GATE, T.FFN_UP, T.FFN_DOWN],
    "qwen3moe": [T.ATTN_NORM, T.ATTN_Q, T.ATTN_K, T.ATTN_V, T.ATTN_OUT, T.ATTN_Q_NORM, T.ATTN_K_NORM,
                 T.FFN_NORM, T.FFN_GATE_INP, T.FFN_GATE_EXP, T.FFN_UP_EXP, T.FFN_DOWN_EXP],
    "gemma3": [T.ATTN_NORM, T.ATTN_Q, T.ATTN_K, T.ATTN_V, T.ATTN_OUT, T.ATTN_Q_NORM, T.ATTN_K_NORM,
               T.ATTN_POST_NORM, T.FFN_PRE_NORM, T.FFN_GATE, T.FFN_UP, T.FFN_DOWN, T.FFN_POST_NORM],
}


def tn(t: T, bid: int | None = None) -> str:
    """GGUF tensor name from gguf's own name table."""
    return gguf.TENSOR_NAMES[t].format(bid=bid) + ".weight"


def kv(key: str, arch: str) -> str:
    return key.format(arch=arch)


def hf_config(hf_dir: Path) -> dict:
    return json.loads((hf_dir / "config.json").read_text())


def hf_weights(hf_dir: Path) -> dict[str, np.ndarray]:
    tensors = safetensors_torch.load_file(hf_dir / "model.safetensors")
    return {k: v.float().numpy() for k, v in tensors.items()}


def array(g: GGUFFile, name: str) -> np.ndarray:
    t = g.tensors[name]
    return gguf.quants.dequantize(np.asarray(t.data), t.qtype).reshape(t.shape)


def expected_weights(arch: str, hf_dir: Path) -> dict[str, np.ndarray]:
    """What a few GGUF tensors must hold, computed from the HF weights independently of the converter."""
    w = hf_weights(hf_dir)
    cfg = hf_config(hf_dir)
    shift = 1.0 if arch == "gemma3" else 0.0  # Gemma3RMSNorm computes x * (1 + w)
    out = {
        tn(T.TOKEN_EMBD): w["model.embed_tokens.weight"],
        tn(T.OUTPUT_NORM): w["model.norm.weight"] + shift,
        tn(T.ATTN_Q, 1): w["model.layers.1.self_attn.q_proj.weight"],
        tn(T.ATTN_OUT, 1): w["model.layers.1.self_attn.o_proj.weight"],
        tn(T.ATTN_NORM, 0): w["model.layers.0.input_layernorm.weight"] + shift,
        tn(T.ATTN_Q_NORM, 0): w["model.layers.0.self_attn.q_norm.weight"] + shift,
    }
    if not cfg["tie_word_embeddings"]:
        out[tn(T.OUTPUT)] = w["lm_head.weight"]
    if arch == "gemma3":
        out[tn(T.ATTN_POST_NORM, 0)] = w["model.layers.0.post_attention_layernorm.weight"] + 1
        out[tn(T.FFN_PRE_NORM, 0)] = w["model.layers.0.pre_feedforward_layernorm.weight"] + 1
        out[tn(T.FFN_POST_NORM, 0)] = w["model.layers.0.post_feedforward_layernorm.weight"] + 1
    if arch == "qwen3moe":
        n = cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]
        pairs = ((T.FFN_GATE_EXP, "gate_proj"), (T.FFN_UP_EXP, "up_proj"), (T.FFN_DOWN_EXP, "down_proj"))
        for t, hf in pairs:
            out[tn(t, 1)] = np.stack([w[f"model.layers.1.mlp.experts.{x}.{hf}.weight"] for x in range(n)])
        out[tn(T.FFN_GATE_INP, 0)] = w["model.layers.0.mlp.gate.weight"]
    else:
        out[tn(T.FFN_DOWN, 1)] = w["model.layers.1.mlp.down_proj.weight"]
    return out


@pytest.fixture(params=list(ARCH_FIXTURES))
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def tiny(arch: str, request: pytest.FixtureRequest) -> tuple[Path, Path]:
    return request.getfixturevalue(ARCH_FIXTURES[arch])


# ---------------------------------------------------------------------------------------------------------
# tensors
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("outtype", ["f32", "f16", "q8_0"])
def test_tensor_names_shapes_types(arch: str, tiny: tuple[Path, Path], outtype: str, tmp_path: Path) -> None:
    hf_dir, _ = tiny
    cfg = hf_config(hf_dir)
    g = open_gguf(convert_hf(hf_dir, tmp_path / f"m-{outtype}.gguf", outtype))
    assert g.arch == arch
    assert g.require(Keys.General.FILE_TYPE) == FILE_TYPE[outtype]

    n_layer, hidden, vocab = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    want = {tn(T.TOKEN_EMBD), tn(T.OUTPUT_NORM)}
    want |= {tn(t, b) for t in BLOCK_TENSORS[arch] for b in range(n_layer)}
    if not cfg["tie_word_embeddings"]:
        want.add(tn(T.OUTPUT))
    assert set(g.tensors) == want

    head_dim, n_head, n_kv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    assert g.tensors[tn(T.TOKEN_EMBD)].shape == (vocab, hidden)
    assert g.tensors[tn(T.ATTN_Q, 0)].shape == (n_head * head_dim, hidden)
    assert g.tensors[tn(T.ATTN_K, 0)].shape == (n_kv * head_dim, hidden)
    assert g.tensors[tn(T.ATTN_OUT, 0)].shape == (hidden, n_head * head_dim)
    assert g.tensors[tn(T.ATTN_Q_NORM, 0)].shape == (head_dim,)
    if arch == "qwen3moe":
        n_exp, ff = cfg["num_local_experts"], cfg["moe_intermediate_size"]
        assert g.tensors[tn(T.FFN_GATE_EXP, 0)].shape == (n_exp, ff, hidden)
        assert g.tensors[tn(T.FFN_UP_EXP, 0)].shape == (n_exp, ff, hidden)
        assert g.tensors[tn(T.FFN_DOWN_EXP, 0)].shape == (n_exp, hidden, ff)
        assert g.tensors[tn(T.FFN_GATE_INP, 0)].shape == (n_exp, hidden)
    else:
        assert g.tensors[tn(T.FFN_GATE, 0)].shape == (cfg["intermediate_size"], hidden)
        assert g.tensors[tn(T.FFN_DOWN, 0)].shape == (hidden, cfg["intermediate_size"])

    for name, t in g.tensors.items():
        f32 = len(t.shape) == 1 or name.endswith("_norm.weight") or ".ffn_gate_inp." in name
        assert t.qtype == (Q.F32 if f32 else OUT_QTYPE[outtype]), name


def test_f32_tensors_equal_hf_weights(arch: str, tiny: tuple[Path, Path]) -> None:
    hf_dir, gguf_path = tiny
    g = open_gguf(gguf_path)
    for name, ref in expected_weights(arch, hf_dir).items():
        np.testing.assert_array_equal(array(g, name), ref.astype(np.float32), err_msg=name)


def test_q8_0_and_f16_dequantize_close_to_hf(arch: str, tiny: tuple[Path, Path], tmp_path: Path) -> None:
    hf_dir, _ = tiny
    q8 = open_gguf(convert_hf(hf_dir, tmp_path / "q8.gguf", "q8_0"))
    f16 = open_gguf(convert_hf(hf_dir, tmp_path / "f16.gguf", "f16"))
    n_q8 = 0
    for name, ref in expected_weights(arch, hf_dir).items():
        if q8.tensors[name].qtype == Q.Q8_0:
            n_q8 += 1
            # Q8_0: step d = max|block| / 127 per 32 values, stored as f16: error <= d/2 + 127 * d * 2**-11
            step = np.abs(ref.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
            err = np.abs(array(q8, name) - ref).reshape(-1, 32)
            assert np.all(err <= 0.57 * step + 1e-7), name
        np.testing.assert_allclose(array(f16, name), ref, rtol=1e-3, atol=1e-4, err_msg=name)
    assert n_q8 >= 4


# ---------------------------------------------------------------------------------------------------------
# metadata
# ---------------------------------------------------------------------------------------------------------


def test_metadata(arch: str, tiny: tuple[Path, Path]) -> None:
    hf_dir, gguf_path = tiny
    cfg = hf_config(hf_dir)
    g = open_gguf(gguf_path)
    m = g.metadata
    expect = {
        Keys.LLM.CONTEXT_LENGTH: cfg["max_position_embeddings"],
        Keys.LLM.EMBEDDING_LENGTH: cfg["hidden_size"],
        Keys.LLM.BLOCK_COUNT: cfg["num_hidden_layers"],
        Keys.LLM.FEED_FORWARD_LENGTH: cfg["intermediate_size"],
        Keys.Attention.HEAD_COUNT: cfg["num_attention_heads"],
        Keys.Attention.HEAD_COUNT_KV: cfg["num_key_value_heads"],
        Keys.Attention.KEY_LENGTH: cfg["head_dim"],
        Keys.Attention.VALUE_LENGTH: cfg["head_dim"],
    }
    for key, value in expect.items():
        assert m[kv(key, arch)] == value, key
    assert m[kv(Keys.Attention.LAYERNORM_RMS_EPS, arch)] == pytest.approx(cfg["rms_norm_eps"])
    assert m[Keys.General.ARCHITECTURE] == arch
    assert m[Keys.General.QUANTIZATION_VERSION] == gguf.GGML_QUANT_VERSION
    assert Keys.General.NAME in m

    if arch == "qwen3moe":
        assert m[kv(Keys.LLM.EXPERT_COUNT, arch)] == cfg["num_local_experts"]
        assert m[kv(Keys.LLM.EXPERT_USED_COUNT, arch)] == cfg["num_experts_per_tok"]
        assert m[kv(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, arch)] == cfg["moe_intermediate_size"]
        assert m[kv(Keys.LLM.EXPERT_WEIGHTS_NORM, arch)] is True
    if arch == "gemma3":
        rope = cfg["rope_parameters"]
        assert m[kv(Keys.Rope.FREQ_BASE, arch)] == rope["full_attention"]["rope_theta"]
        assert m[kv(Keys.Rope.FREQ_BASE_SWA, arch)] == rope["sliding_attention"]["rope_theta"]
        assert m[kv(Keys.Attention.SLIDING_WINDOW, arch)] == cfg["sliding_window"]
        assert m[Keys.Tokenizer.ADD_PREFIX] is False
        assert kv(Keys.Attention.SCALE, arch) not in m  # query_pre_attn_scalar == head_dim
        assert kv(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, arch) not in m
    else:
        assert m[kv(Keys.Rope.FREQ_BASE, arch)] == cfg["rope_parameters"]["rope_theta"]
        assert kv(Keys.Attention.SLIDING_WINDOW, arch) not in m


def llama_cpp_is_swa(pattern: int | list[bool], n_layer: int) -> list[bool]:
    """llama_hparams::set_swa_pattern(n, dense_first=false), or a per-layer array as stored."""
    if isinstance(pattern, list):
        return [bool(x) for x in pattern]
    return [pattern == 0 or (il % pattern < pattern - 1) for il in range(n_layer)]


def test_gemma3_sliding_window_pattern_matches_layer_types(tiny_gemma3_gguf: tuple[Path, Path]) -> None:
    hf_dir, gguf_path = tiny_gemma3_gguf
    cfg = hf_config(hf_dir)
    m = open_gguf(gguf_path).metadata
    pattern = m[kv(Keys.Attention.SLIDING_WINDOW_PATTERN, "gemma3")]
    assert pattern == 6  # llama.cpp's built-in default for gemma3, so older readers agree too
    hf_swa = [t == "sliding_attention" for t in cfg["layer_types"]]
    assert any(hf_swa) and not all(hf_swa)  # the tiny model exercises both kinds of layer
    assert llama_cpp_is_swa(pattern, cfg["num_hidden_layers"]) == hf_swa


@pytest.mark.parametrize("types", [
    ["sliding_attention", "full_attention"] * 2,
    ["sliding_attention"] * 3,
    ["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
])
def test_swa_pattern_encoding_roundtrips(types: list[str]) -> None:
    is_swa = gemma3_swa_layers({"num_hidden_layers": len(types), "layer_types": types})
    period = swa_period(is_swa)
    stored = period if period is not None else is_swa
    assert llama_cpp_is_swa(stored, len(types)) == is_swa
    # no layer_types: the (i + 1) % pattern rule of transformers' Gemma3TextConfig
    assert gemma3_swa_layers({"num_hidden_layers": 7, "sliding_window_pattern": 3}) == [
        True, True, False, True, True, False, True]


# ---------------------------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch_fixture", ["tiny_qwen3_gguf", "tiny_qwen3moe_gguf"])
def test_qwen_tokenizer_metadata(arch_fixture: str, request: pytest.FixtureRequest) -> None:
    hf_dir, gguf_path = request.getfixturevalue(arch_fixture)
    m = open_gguf(gguf_path).metadata
    tj = json.loads((hf_dir / "tokenizer.json").read_text())
    tc = json.loads((hf_dir / "tokenizer_config.json").read_text())
    tokens, types = m[Keys.Tokenizer.LIST], m[Keys.Tokenizer.TOKEN_TYPE]
    assert len(tokens) == len(types) == hf_config(hf_dir)["vocab_size"]
    assert m[Keys.Tokenizer.MODEL] == "gpt2" and m[Keys.Tokenizer.PRE] == "qwen2"
    for tok, i in tj["model"]["vocab"].items():
        assert tokens[i] == tok and types[i] == gguf.TokenType.NORMAL
    special = {t["content"]: t["id"] for t in tj["added_tokens"]}
    for content, i in special.items():
        assert tokens[i] == content and types[i] == gguf.TokenType.CONTROL
    assert len(m[Keys.Tokenizer.MERGES]) == len(tj["model"]["merges"])
    assert m[Keys.Tokenizer.EOS_ID] == special["<|im_end|>"]
    assert m[Keys.Tokenizer.BOS_ID] == special["<|endoftext|>"]
    assert m[Keys.Tokenizer.PAD_ID] == special["<|endoftext|>"]
    assert m[Keys.Tokenizer.ADD_BOS] is False
    assert m[Keys.Tokenizer.CHAT_TEMPLATE] == tc["chat_template"]


def test_gemma_tokenizer_metadata(tiny_gemma3_gguf: tuple[Path, Path]) -> None:
    spm = pytest.importorskip("sentencepiece")
    hf_dir, gguf_path = tiny_gemma3_gguf
    m = open_gguf(gguf_path).metadata
    tc = json.loads((hf_dir / "tokenizer_config.json").read_text())
    sp = spm.SentencePieceProcessor(model_file=str(hf_dir / "tokenizer.model"))
    tokens, scores, types = m[Keys.Tokenizer.LIST], m[Keys.Tokenizer.SCORES], m[Keys.Tokenizer.TOKEN_TYPE]
    assert len(tokens) == len(scores) == len(types) == sp.vocab_size() == hf_config(hf_dir)["vocab_size"]
    assert m[Keys.Tokenizer.MODEL] == "llama" and m[Keys.Tokenizer.PRE] == "default"
    overridden = {int(i) for i in tc["added_tokens_decoder"]}
    for i in range(sp.vocab_size()):
        assert tokens[i] == sp.id_to_piece(i)
        if i in overridden:  # tokenizer_config.json's specials: CONTROL with score -1000, as llama.cpp
            assert types[i] == gguf.TokenType.CONTROL and scores[i] == -1000.0
            continue
        assert scores[i] == pytest.approx(sp.get_score(i))
        assert types[i] == (gguf.TokenType.BYTE if sp.is_byte(i) else gguf.TokenType.NORMAL)
    assert tokens[:6] == ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    assert (m[Keys.Tokenizer.PAD_ID], m[Keys.Tokenizer.EOS_ID], m[Keys.Tokenizer.BOS_ID],
            m[Keys.Tokenizer.UNK_ID]) == (0, 1, 2, 3)
    assert m[Keys.Tokenizer.ADD_BOS] is True and m[Keys.Tokenizer.ADD_EOS] is False
    assert m[Keys.Tokenizer.CHAT_TEMPLATE] == tc["chat_template"]


def test_sentencepiece_parser_matches_library(tiny_gemma3_gguf: tuple[Path, Path]) -> None:
    spm = pytest.importorskip("sentencepiece")
    path = tiny_gemma3_gguf[0] / "tokenizer.model"
    sp = spm.SentencePieceProcessor(model_file=str(path))
    pieces = parse_sentencepiece_model(path.read_bytes())
    assert [p.decode() for p, _, _ in pieces] == [sp.id_to_piece(i) for i in range(sp.vocab_size())]
    assert [s for _, s, _ in pieces] == pytest.approx([sp.get_score(i) for i in range(sp.vocab_size())])
    assert [k == 6 for _, _, k in pieces] == [sp.is_byte(i) for i in range(sp.vocab_size())]
    assert [k == 4 for _, _, k in pieces][4:6] == [True, True]  # <start_of_turn>, <end_of_turn>


# ---------------------------------------------------------------------------------------------------------
# other checkpoint layouts
# ---------------------------------------------------------------------------------------------------------


def _copy_without_weights(hf_dir: Path, dst: Path) -> Path:
    shutil.copytree(hf_dir, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    return dst


def test_fused_expert_layout(tiny_qwen3moe_gguf: tuple[Path, Path], tmp_path: Path) -> None:
    """transformers-5 in-memory layout (experts.gate_up_proj [E, 2F, H], experts.down_proj [E, H, F])."""
    hf_dir, gguf_path = tiny_qwen3moe_gguf
    w = safetensors_torch.load_file(hf_dir / "model.safetensors")
    cfg = hf_config(hf_dir)
    fused = {k: v for k, v in w.items() if ".mlp.experts." not in k}
    for b in range(cfg["num_hidden_layers"]):
        e = [f"model.layers.{b}.mlp.experts.{x}" for x in range(cfg["num_local_experts"])]
        fused[f"model.layers.{b}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([w[f"{p}.gate_proj.weight"], w[f"{p}.up_proj.weight"]]) for p in e])
        fused[f"model.layers.{b}.mlp.experts.down_proj"] = torch.stack(
            [w[f"{p}.down_proj.weight"] for p in e])
    src = _copy_without_weights(hf_dir, tmp_path / "fused")
    safetensors_torch.save_file(fused, src / "model.safetensors")
    a, b = open_gguf(gguf_path), open_gguf(convert_hf(src, tmp_path / "fused.gguf", "f32"))
    assert set(a.tensors) == set(b.tensors)
    for name in a.tensors:
        assert a.tensors[name].shape == b.tensors[name].shape, name
        assert bytes(a.tensors[name].data) == bytes(b.tensors[name].data), name


def test_bf16_sharded_checkpoint(tiny_qwen3_gguf: tuple[Path, Path], tmp_path: Path) -> None:
    hf_dir, _ = tiny_qwen3_gguf
    w = safetensors_torch.load_file(hf_dir / "model.safetensors")
    src = _copy_without_weights(hf_dir, tmp_path / "bf16")
    names = sorted(w)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in shards.items():
        safetensors_torch.save_file({k: w[k].to(torch.bfloat16) for k in keys}, src / fname)
    index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    g = open_gguf(convert_hf(src, tmp_path / "bf16.gguf", "f32"))
    ref = w["model.layers.1.self_attn.q_proj.weight"].to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(array(g, tn(T.ATTN_Q, 1)), ref)

    (src / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ConversionError, match="shard"):
        convert_hf(src, tmp_path / "missing-shard.gguf", "f32")


# ---------------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------------


def _one_line(e: pytest.ExceptionInfo[ConversionError]) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg
    return msg


def test_unknown_architecture(tiny_qwen3_gguf: tuple[Path, Path], tmp_path: Path) -> None:
    src = tmp_path / "llama"
    shutil.copytree(tiny_qwen3_gguf[0], src)
    cfg = hf_config(src)
    cfg["architectures"] = ["LlamaForCausalLM"]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError) as e:
        convert_hf(src, tmp_path / "out.gguf")
    assert "LlamaForCausalLM" in _one_line(e) and "Qwen3ForCausalLM" in _one_line(e)
    assert not (tmp_path / "out.gguf").exists()


def test_missing_inputs(tiny_gemma3_gguf: tuple[Path, Path], tmp_path: Path) -> None:
    hf_dir = tiny_gemma3_gguf[0]
    src = _copy_without_weights(hf_dir, tmp_path / "noweights")
    with pytest.raises(ConversionError) as e:
        convert_hf(src, tmp_path / "a.gguf")
    assert "safetensors" in _one_line(e)

    src = tmp_path / "notok"
    shutil.copytree(hf_dir, src)
    (src / "tokenizer.model").unlink()
    with pytest.raises(ConversionError) as e:
        convert_hf(src, tmp_path / "b.gguf")
    assert "tokenizer.model" in _one_line(e)

    with pytest.raises(ConversionError, match="config.json"):
        convert_hf(tmp_path, tmp_path / "c.gguf")
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*tmp*"))  # nothing left behind


def test_bad_outtype(tiny_qwen3_gguf: tuple[Path, Path], tmp_path: Path) -> None:
    with pytest.raises(ConversionError) as e:
        convert_hf(tiny_qwen3_gguf[0], tmp_path / "out.gguf", "q4_k")
    assert "q4_k" in _one_line(e) and "q8_0" in _one_line(e)


def test_existing_output_and_input_protection(tiny_qwen3_gguf: tuple[Path, Path], tmp_path: Path) -> None:
    hf_dir, _ = tiny_qwen3_gguf
    out = tmp_path / "out.gguf"
    out.write_bytes(b"keep me")
    with pytest.raises(ConversionError) as e:
        convert_hf(hf_dir, out)
    assert "exists" in _one_line(e)
    assert out.read_bytes() == b"keep me"
    assert convert_hf(hf_dir, out, "f16", overwrite=True) == out
    assert open_gguf(out).arch == "qwen3"

    src = tmp_path / "ckpt"
    shutil.copytree(hf_dir, src)
    before = (src / "model.safetensors").read_bytes()
    for target in (src / "model.safetensors", src / "config.json", src):
        with pytest.raises(ConversionError):
            convert_hf(src, target, overwrite=True)
    assert (src / "model.safetensors").read_bytes() == before


def test_failed_write_leaves_nothing(
    tiny_qwen3_gguf: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def boom(data: np.ndarray, qtype: Q) -> np.ndarray:
        calls.append(qtype)
        if len(calls) == 3:  # fail mid-way through the tensor data
            raise ConversionError("simulated failure")
        return real(data, qtype)

    real = gguf.quants.quantize
    monkeypatch.setattr(gguf.quants, "quantize", boom)
    with pytest.raises(ConversionError, match="simulated"):
        convert_hf(tiny_qwen3_gguf[0], tmp_path / "out.gguf")
    assert list(tmp_path.iterdir()) == []
