"""Gemma4ForCausalLM / Gemma4ForConditionalGeneration (text part) -> GGUF `gemma4`, as llama.cpp's
`conversion/gemma.py` (Gemma4Model) writes it.

* Norm weights are stored as they are (Gemma 4's RMSNorm multiplies by w, unlike Gemma 3's 1 + w).
* `experts.gate_up_proj` [E, 2F, D] stays fused as `ffn_gate_up_exps` (gate rows first), `experts.down_proj`
  [E, D, F] is `ffn_down_exps`; `router.proj` -> `ffn_gate_inp`, `router.scale` -> `ffn_gate_inp.scale`,
  `router.per_expert_scale` -> `ffn_down_exps.scale`, `layer_scalar` -> `layer_output_scale.weight`.
* Global layers' "proportional" rope (a fraction of the pairs rotated, frequencies relative to the full
  head size) becomes `rope.dimension_count` = the full head size plus a `rope_freqs` tensor: 1 for the
  rotated pairs, 1e30 (no rotation) for the rest.
* Head sizes and KV heads per layer kind: `key_length`/`value_length` (global), `*_swa` (sliding),
  `head_count_kv` as a per-layer array when they differ; `sliding_window_pattern` as a bool array.
* The vocabulary: `tokenizer.json` (Gemma 4's BPE with byte fallback) -> `tokenizer.ggml.model = "gemma4"`
  with merges, like llama.cpp; a checkpoint with only a SentencePiece `tokenizer.model` gets the
  SentencePiece vocabulary (`llama`) instead. Either way the channel and tool markers are USER_DEFINED, and no
  end-of-turn id is written: like llama.cpp, the loader makes `<turn|>` (and `<eos>`) end the generation by
  their text.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tandem.convert.arch_hooks import ArchHooks, PlanContext, layer_is_swa, write_attention_common
from tandem.convert.vocab import Vocab, load_spm_vocab, read_json_object
from tandem.errors import ConversionError

_MULTIMODAL = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.",
               "model.multi_modal_projector.")  # fmt: skip
_LM_PREFIX = "model.language_model."
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# tokens llama.cpp always renders (USER_DEFINED), so that its chat parser can read them
_VISIBLE_TOKENS = {"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                   "<tool_response|>", '<|"|>'}  # fmt: skip
_BYTE_RE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def head_dims(cfg: dict[str, Any]) -> tuple[int, int]:
    """(global head size, sliding head size): `global_head_dim`, else the first full layer's override."""
    swa = int(cfg.get("head_dim") or 256)
    full = cfg.get("global_head_dim") or _full_layer_override(cfg, "head_dim")
    return int(full or swa), swa


def _full_layer_override(cfg: dict[str, Any], key: str) -> Any:
    types = cfg.get("layer_types") or []
    for idx, override in sorted((cfg.get("per_layer_config") or {}).items(), key=lambda kv: int(kv[0])):
        if int(idx) < len(types) and types[int(idx)] == "full_attention" and key in override:
            return override[key]
    return None


def _rope_params(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    rp = cfg.get("rope_parameters") or {}
    full = dict(rp.get("full_attention") or {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                               "rope_theta": 1_000_000.0})  # fmt: skip
    swa = dict(rp.get("sliding_attention") or {"rope_type": "default", "rope_theta": 10_000.0})
    return full, swa


class Gemma4Hooks(ArchHooks):
    """Tensor renames, the rope_freqs tensor, per-layer-kind metadata and the `gemma4` vocabulary."""

    def tensor(self, hf_name: str, t: Any, ctx: PlanContext) -> bool:
        if hf_name.startswith(_MULTIMODAL):
            return True  # the vision/audio towers belong to the mmproj file, not here
        name = "model." + hf_name[len(_LM_PREFIX):] if hf_name.startswith(_LM_PREFIX) else hf_name
        m = _LAYER_RE.match(name)
        bid, rest = (int(m[1]), m[2]) if m else (-1, "")
        if rest == "router.scale":
            new = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_GATE_INP].format(bid=bid) + ".scale"
        elif rest == "router.per_expert_scale":
            new = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_DOWN_EXP].format(bid=bid) + ".scale"
        elif rest in ("layer_scalar", "experts.gate_up_proj", "experts.down_proj"):
            new = ctx.name_of(name + ".weight")
        elif name != hf_name:
            new = ctx.name_of(name)
        else:
            return False
        ctx.add(new, t.shape, lambda: ctx.load(t))
        return True

    def extra_tensors(self, ctx: PlanContext) -> None:
        full, _ = _rope_params(ctx.cfg)
        if not any(not s for s in layer_is_swa(ctx.cfg, 6)) or full.get("rope_type", "default") == "default":
            return
        head_full, _ = head_dims(ctx.cfg)
        n_rot = int(head_full * float(full.get("partial_rotary_factor", 1.0)) / 2)
        factors = np.array([1.0] * n_rot + [1e30] * (head_full // 2 - n_rot), dtype=np.float32)
        ctx.add(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors.shape, lambda: factors)

    def write_hparams(self, w: gguf.GGUFWriter, cfg: dict[str, Any], ftype: gguf.LlamaFileType) -> None:
        n_layers = int(cfg["num_hidden_layers"])
        is_swa = layer_is_swa(cfg, 6)
        if len(is_swa) != n_layers:
            raise ConversionError(f"gemma4: layer_types must list {n_layers} entries")
        head_full, head_swa = head_dims(cfg)
        cfg = {**cfg, "max_position_embeddings": cfg.get("max_position_embeddings", 131072)}
        write_attention_common(w, cfg, head_full)
        w.add_key_length_swa(head_swa)
        w.add_value_length_swa(head_swa)
        kv_swa = int(cfg.get("num_key_value_heads") or 4)
        kv_full = cfg.get("num_global_key_value_heads") or _full_layer_override(cfg, "num_key_value_heads")
        if kv_full is not None and int(kv_full) != kv_swa:
            w.add_head_count_kv([kv_swa if s else int(kv_full) for s in is_swa])
        else:
            w.add_head_count_kv(kv_swa)
        full, swa = _rope_params(cfg)
        if full.get("rope_type", "default") not in ("default", "proportional") or float(full.get("factor", 1.0)) != 1.0:
            raise ConversionError(f"gemma4: global-layer rope {full} is unsupported (default or proportional)")
        if swa.get("rope_type", "default") != "default":
            raise ConversionError(f"gemma4: sliding-layer rope {swa} is unsupported (default only)")
        w.add_rope_freq_base(float(full.get("rope_theta", 1_000_000.0)))
        w.add_rope_freq_base_swa(float(swa.get("rope_theta", 10_000.0)))
        w.add_rope_dimension_count(head_full)  # partial rotation is expressed by rope_freqs
        w.add_rope_dimension_count_swa(int(head_swa * float(swa.get("partial_rotary_factor", 1.0))))
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
        w.add_sliding_window(int(cfg.get("sliding_window") or 512))
        w.add_sliding_window_pattern(is_swa)
        if cfg.get("enable_moe_block") and cfg.get("num_experts"):
            w.add_expert_count(int(cfg["num_experts"]))
            w.add_expert_used_count(int(cfg["top_k_experts"]))
            w.add_expert_feed_forward_length(int(cfg.get("expert_intermediate_size") or cfg["moe_intermediate_size"]))
        n_shared = int(cfg.get("num_kv_shared_layers") or 0)
        w.add_shared_kv_layers(n_shared)
        w.add_embedding_length_per_layer_input(int(cfg.get("hidden_size_per_layer_input") or 0))
        if cfg.get("use_double_wide_mlp"):
            n_ff = int(cfg["intermediate_size"])
            w.add_feed_forward_length([n_ff if i < n_layers - n_shared else 2 * n_ff for i in range(n_layers)])
        if cfg.get("use_bidirectional_attention") == "all":
            raise ConversionError("gemma4 with use_bidirectional_attention='all' is unsupported")
        w.add_file_type(ftype)

    def load_vocab(self, cfg: dict[str, Any], hf_dir: Path) -> Vocab | None:
        if (hf_dir / "tokenizer.json").is_file():
            return load_gemma4_vocab(hf_dir)
        vocab = load_spm_vocab(hf_dir, int(cfg["vocab_size"]))
        _show_visible_tokens(vocab.tokens, vocab.toktypes)
        return vocab

    def after_vocab(self, w: gguf.GGUFWriter, vocab: Vocab) -> None:
        w.add_add_space_prefix(False)
        if vocab.model == "gemma4":
            w.add_add_bos_token(True)  # llama.cpp's converter forces it


def _special_texts(hf_dir: Path) -> set[str]:
    """transformers' `all_special_tokens`: the named specials and the additional/extra special tokens."""
    path = hf_dir / "tokenizer_config.json"
    config = read_json_object(path) if path.is_file() else {}
    out: set[str] = set()
    for key, value in config.items():
        if key.endswith("_token") or key in ("additional_special_tokens", "extra_special_tokens"):
            items = value if isinstance(value, list) else list(value.values()) if isinstance(value, dict) else [value]
            for v in items:
                text = v.get("content") if isinstance(v, dict) else v
                if isinstance(text, str):
                    out.add(text)
    return out


def _show_visible_tokens(tokens: list[bytes], toktypes: list[int]) -> None:
    """Mark the channel and tool markers USER_DEFINED (shown in the text, for chat parsers), as llama.cpp does."""
    for i, tok in enumerate(tokens):
        if tok.decode("utf-8", errors="replace") in _VISIBLE_TOKENS:
            toktypes[i] = gguf.TokenType.USER_DEFINED


def load_gemma4_vocab(hf_dir: Path) -> Vocab:
    """Tokens and types from `tokenizer.json` as llama.cpp's Gemma4Model.set_vocab (LlamaHfVocab) gets them:
    base vocabulary in id order (`<0xXX>` BYTE, specials CONTROL, else NORMAL), then the added tokens beyond
    it (specials CONTROL, else USER_DEFINED); every score -1000; the tool/channel markers USER_DEFINED."""
    tj = read_json_object(hf_dir / "tokenizer.json")
    model = tj.get("model") or {}
    if model.get("type") != "BPE" or not model.get("byte_fallback") or not isinstance(model.get("vocab"), dict):
        raise ConversionError(f"{hf_dir}/tokenizer.json: expected Gemma 4's BPE tokenizer with byte fallback")
    by_id = {int(i): tok for tok, i in model["vocab"].items()}
    n_base = len(by_id)
    if sorted(by_id) != list(range(n_base)):
        raise ConversionError(f"{hf_dir}/tokenizer.json: the BPE vocabulary ids are not 0..{n_base - 1}")
    added = sorted((int(e["id"]), str(e["content"])) for e in tj.get("added_tokens") or [])
    for i, text in added:
        if i < n_base:
            by_id[i] = text
    specials = _special_texts(hf_dir)
    special_ids = {i for i, text in by_id.items() if text in specials}
    special_ids |= {i for i, text in added if text in specials}
    tokens: list[bytes] = []
    toktypes: list[int] = []
    for i in range(n_base):
        text = by_id[i]
        tokens.append(text.encode("utf-8"))
        if _BYTE_RE.fullmatch(text):
            toktypes.append(gguf.TokenType.BYTE)
        else:
            toktypes.append(gguf.TokenType.CONTROL if i in special_ids else gguf.TokenType.NORMAL)
    for i, text in added:
        if i < n_base:
            continue
        if i != len(tokens):
            raise ConversionError(f"{hf_dir}/tokenizer.json: added token ids are not contiguous at {i}")
        tokens.append(text.encode("utf-8"))
        toktypes.append(gguf.TokenType.CONTROL if i in special_ids else gguf.TokenType.USER_DEFINED)
    _show_visible_tokens(tokens, toktypes)
    return Vocab(model="gemma4", pre="gemma4", tokens=tokens, toktypes=[int(t) for t in toktypes],
                 scores=[-1000.0] * len(tokens))  # fmt: skip


HOOKS = Gemma4Hooks()
