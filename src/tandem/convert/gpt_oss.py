"""GptOssForCausalLM -> GGUF `gpt-oss`, as llama.cpp's `conversion/gpt_oss.py` writes it.

transformers keeps each layer's experts fused and transposed: `mlp.experts.gate_up_proj` [E, D, 2F] with
gate and up *interleaved* along the last axis (gate = columns 0, 2, 4, ..., up = 1, 3, 5, ...), its bias
[E, 2F] interleaved the same way, and `down_proj` [E, F, D]. llama.cpp splits them into
`ffn_{gate,up}_exps` [E, F, D] (+ `.bias` [E, F]) and `ffn_down_exps` [E, D, F] (+ `.bias` [E, D]).
`self_attn.sinks` becomes `attn_sinks.weight`.

The original release stores the experts as MXFP4: `*_blocks` [E, N, K/32, 16] (two e2m1 values per byte,
element 2i in the low nibble) and `*_scales` [E, N, K/32] (e8m0), rows already [out, in] (gate and up rows
interleaved). Like llama.cpp, these are repacked losslessly into ggml's MXFP4 blocks (scale byte, then
element j in the low and j + 16 in the high nibble of byte j), whatever the outtype.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tandem.convert.arch_hooks import ArchHooks, PlanContext, layer_is_swa, write_attention_common
from tandem.convert.vocab import Vocab, load_bpe_vocab
from tandem.errors import ConversionError

_EXPERTS_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")
_MXFP4_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)_(blocks|scales)$")
DEFAULT_SLIDING_PERIOD = 2  # transformers and llama.cpp: even layers slide


class GptOssHooks(ArchHooks):
    """Expert splitting, sinks naming, YaRN metadata and the o200k (`gpt-4o`) BPE vocabulary."""

    def tensor(self, hf_name: str, t: Any, ctx: PlanContext) -> bool:
        if hf_name.endswith("self_attn.sinks"):
            ctx.add(ctx.name_of(hf_name + ".weight"), t.shape, lambda: ctx.load(t))
            return True
        if m := _MXFP4_RE.match(hf_name):
            _plan_mxfp4(int(m[1]), m[2], m[3], hf_name, ctx)
            return True
        m = _EXPERTS_RE.match(hf_name)
        if m is None:
            return False
        bid, kind, bias = int(m[1]), m[2], m[3] is not None
        stem = f"model.layers.{bid}.mlp.experts."
        suffix = ".bias" if bias else ".weight"
        if kind == "down_proj":
            if bias:  # [E, D]
                ctx.add(ctx.name_of(stem + "down_proj.bias"), t.shape, lambda: ctx.load(t))
            else:  # [E, F, D] -> [E, D, F]
                e, f, d = t.shape
                ctx.add(ctx.name_of(stem + "down_proj.weight"), (e, d, f),
                        lambda: np.ascontiguousarray(ctx.load(t).transpose(0, 2, 1)))  # fmt: skip
            return True
        if t.shape[-1] % 2:
            raise ConversionError(f"'{hf_name}' has an odd last dimension {t.shape[-1]}")
        for name, start in (("gate_proj", 0), ("up_proj", 1)):
            new = ctx.name_of(stem + name + suffix)
            if bias:  # [E, 2F] -> [E, F]
                ctx.add(new, (t.shape[0], t.shape[1] // 2),
                        lambda s=start: np.ascontiguousarray(ctx.load(t)[:, s::2]))  # fmt: skip
            else:  # [E, D, 2F] -> [E, 2F, D] -> rows s, s+2, ... -> [E, F, D]
                e, d, two_f = t.shape
                ctx.add(new, (e, two_f // 2, d),
                        lambda s=start: np.ascontiguousarray(ctx.load(t).transpose(0, 2, 1)[:, s::2, :]))  # fmt: skip
        return True

    def write_hparams(self, w: gguf.GGUFWriter, cfg: dict[str, Any], ftype: gguf.LlamaFileType) -> None:
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
        write_attention_common(w, cfg, head_dim)
        w.add_head_count_kv(int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]))
        _write_rope(w, cfg)
        w.add_expert_count(int(cfg.get("num_local_experts") or cfg["num_experts"]))
        w.add_expert_used_count(int(cfg["num_experts_per_tok"]))
        w.add_expert_feed_forward_length(int(cfg["intermediate_size"]))
        w.add_sliding_window(int(cfg["sliding_window"]))
        is_swa = layer_is_swa(cfg, DEFAULT_SLIDING_PERIOD)
        if is_swa != [i % 2 == 0 for i in range(len(is_swa))]:
            # llama.cpp assumes the period of 2 unless the file says otherwise
            w.add_sliding_window_pattern(is_swa)
        for key, want in (("swiglu_alpha", 1.702), ("swiglu_limit", 7.0)):
            if float(cfg.get(key, want)) != want:  # llama.cpp hard-codes both
                raise ConversionError(f"gpt-oss with {key}={cfg[key]} is unsupported (llama.cpp uses {want})")
        w.add_file_type(ftype)

    def load_vocab(self, cfg: dict[str, Any], hf_dir: Path) -> Vocab | None:
        # o200k_harmony splits text like GPT-4o; llama.cpp identifies it by hashing a probe text
        return load_bpe_vocab(hf_dir, int(cfg["vocab_size"]), pre="gpt-4o")


def repack_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """OpenAI MXFP4 (`blocks` [..., B, 16], `scales` [..., B]) -> ggml block_mxfp4 bytes [..., B * 17]."""
    elems = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)  # element order
    qs = elems[..., :16] | (elems[..., 16:] << 4)
    out = np.concatenate([scales[..., None], qs], axis=-1).astype(np.uint8)  # [..., B, 17]
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * 17)


def _plan_mxfp4(bid: int, kind: str, part: str, hf_name: str, ctx: PlanContext) -> None:
    """Plan an MXFP4 expert tensor from its blocks (its scales are read along; alone they are skipped)."""
    other = hf_name[: -len(part)] + ("scales" if part == "blocks" else "blocks")
    if other not in ctx.tensors:
        raise ConversionError(f"'{hf_name}' has no matching '{other}'")
    if part == "scales":
        return
    assert ctx.load_raw is not None
    load_raw = ctx.load_raw
    blocks_t, scales_t = ctx.tensors[hf_name], ctx.tensors[other]
    e, n, nb, sixteen = blocks_t.shape
    if sixteen != 16 or blocks_t.dtype != "U8" or scales_t.dtype != "U8" or tuple(scales_t.shape) != (e, n, nb):
        raise ConversionError(f"'{hf_name}': unexpected MXFP4 layout {blocks_t.shape} / {scales_t.shape}")
    stem = f"model.layers.{bid}.mlp.experts."
    if kind == "down_proj":
        parts = [("down_proj", slice(None))]
    else:  # gate and up rows interleaved
        parts = [("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))]
    for name, rows in parts:
        n_rows = len(range(n)[rows])
        ctx.add(ctx.name_of(stem + name + ".weight"), (e, n_rows, nb * 32),
                lambda rows=rows: repack_mxfp4(load_raw(blocks_t)[:, rows], load_raw(scales_t)[:, rows]),
                raw_qtype=gguf.GGMLQuantizationType.MXFP4)  # fmt: skip


def _write_rope(w: gguf.GGUFWriter, cfg: dict[str, Any]) -> None:
    """rope_theta and, for YaRN, the scaling keys llama.cpp's converter writes (it drops `truncate`)."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = rope.get("rope_theta", cfg.get("rope_theta"))
    if theta is not None:
        w.add_rope_freq_base(float(theta))
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return
    if kind != "yarn" or rope.get("factor") is None:
        raise ConversionError(f"gpt-oss with rope type {kind!r} is unsupported (supported: default, yarn)")
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(float(rope["factor"]))
    w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    if (ext := rope.get("extrapolation_factor")) is not None:
        w.add_rope_scaling_yarn_ext_factor(float(ext))
    if (attn := rope.get("attention_factor", rope.get("attn_factor"))) is not None:
        w.add_rope_scaling_yarn_attn_factor(float(attn))
    if (fast := rope.get("beta_fast")) is not None:
        w.add_rope_scaling_yarn_beta_fast(float(fast))
    if (slow := rope.get("beta_slow")) is not None:
        w.add_rope_scaling_yarn_beta_slow(float(slow))


HOOKS = GptOssHooks()
