"""The hybrid Qwen checkpoints: Qwen3_5MoeForCausalLM -> `qwen35moe`, Qwen3NextForCausalLM -> `qwen3next`.

What llama.cpp's converter does on top of the generic path (and so do we):
* metadata: `ssm.{conv_kernel,state_size,group_count,time_step_rank,inner_size}`,
  `attention.recurrent_layers` (from `layer_types`) and `full_attention_interval`,
  `rope.dimension_count` (head_dim * partial_rotary_factor), `expert_shared_feed_forward_length`,
  and for qwen35moe `rope.dimension_sections` (mrope_section padded to 4, default [11, 11, 10, 0]);
* delta-net tensors: A_log -> `ssm_a` = -exp(A_log); dt_bias -> `ssm_dt.bias`; conv1d [C, 1, K] ->
  `ssm_conv1d` [C, K] (F32); the gated norm -> `ssm_norm` without Qwen's +1 (it multiplies by w);
  Qwen3-Next's fused in_proj_qkvz (per key head q, k, v, z) -> `attn_qkv` (all q, all k, all v) and
  `attn_gate` (z); its in_proj_ba -> `ssm_ba` as is;
* qwen35moe with more value than key heads: the value heads are reordered from grouped (by key head)
  to tiled order in every tensor that has them (qkv's v rows, z, a, b, A_log, dt_bias, conv1d's v
  channels, out_proj's columns), so that ggml can broadcast the key heads.
MTP blocks (`mtp.*`) are not converted.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import gguf
import numpy as np

from tandem.errors import ConversionError

HYBRID_ARCHES = (gguf.MODEL_ARCH.QWEN35MOE, gguf.MODEL_ARCH.QWEN3NEXT)
QWEN35_DEFAULT_MROPE_SECTION = [11, 11, 10, 0]

# (GGUF name, shape in PyTorch order, float32 data)
Planned = tuple[str, tuple[int, ...], Callable[[], np.ndarray]]

_LINEAR_ATTN_RE = re.compile(r"^model\.layers\.(\d+)\.linear_attn\.(.+)$")


def check_config(cfg: dict[str, Any]) -> None:
    """Reject configurations llama.cpp's graph for these architectures cannot run."""
    for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
              "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size"):  # fmt: skip
        if not isinstance(cfg.get(k), int):
            raise ConversionError(f"config.json: '{k}' is missing or not an integer")
    if cfg["linear_num_value_heads"] % cfg["linear_num_key_heads"]:
        raise ConversionError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    if cfg["linear_key_head_dim"] != cfg["linear_value_head_dim"]:
        raise ConversionError("linear_key_head_dim != linear_value_head_dim is unsupported (as in llama.cpp)")
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
        raise ConversionError("dense MLP layers (mlp_only_layers, decoder_sparse_step) are unsupported")
    if not cfg.get("norm_topk_prob", True):
        raise ConversionError("norm_topk_prob=false is unsupported (llama.cpp always renormalises)")
    types = cfg.get("layer_types")
    if types is not None and (len(types) != cfg["num_hidden_layers"]
                              or not set(types) <= {"linear_attention", "full_attention"}):  # fmt: skip
        raise ConversionError(f"layer_types must list {cfg['num_hidden_layers']} of linear_attention/full_attention")


def _rope_dims(cfg: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    return int(head_dim * factor), rope


def write_hparams(w: gguf.GGUFWriter, arch: gguf.MODEL_ARCH, cfg: dict[str, Any]) -> None:
    """The keys the generic writer does not know (experts, shared expert, delta-net, layer kinds, rope dims)."""
    w.add_expert_count(int(cfg["num_experts"]))
    w.add_expert_used_count(int(cfg["num_experts_per_tok"]))
    w.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
    if cfg.get("shared_expert_intermediate_size") is not None:
        w.add_expert_shared_feed_forward_length(int(cfg["shared_expert_intermediate_size"]))
    w.add_ssm_conv_kernel(int(cfg["linear_conv_kernel_dim"]))
    w.add_ssm_state_size(int(cfg["linear_key_head_dim"]))
    w.add_ssm_group_count(int(cfg["linear_num_key_heads"]))
    w.add_ssm_time_step_rank(int(cfg["linear_num_value_heads"]))
    w.add_ssm_inner_size(int(cfg["linear_value_head_dim"]) * int(cfg["linear_num_value_heads"]))
    interval = int(cfg.get("full_attention_interval", 4))
    if (types := cfg.get("layer_types")) is not None:
        recurrent = [t == "linear_attention" for t in types]
        # gguf-py's add_recurrent_layers, spelled out for gguf versions that lack it
        w.add_array(f"{w.arch}.attention.recurrent_layers", recurrent)
        # transformers drops full_attention_interval from config.json once it made layer_types: recover it,
        # for readers that only know the interval
        periods = [n for n in range(1, len(types) + 1) if all(r == bool((i + 1) % n) for i, r in enumerate(recurrent))]
        interval = periods[0] if periods else interval
    w.add_full_attention_interval(interval)
    rope_dim, rope = _rope_dims(cfg)
    w.add_rope_dimension_count(rope_dim)
    if arch == gguf.MODEL_ARCH.QWEN35MOE:
        sections = list(rope.get("mrope_section") or QWEN35_DEFAULT_MROPE_SECTION)
        w.add_rope_dimension_sections((sections + [0, 0, 0, 0])[:4])


def _tile(x: np.ndarray, axis: int, n_k: int, n_v: int, head_dim: int) -> np.ndarray:
    """Value heads along `axis` from grouped order [k0: v0..v(r-1), k1: ...] to tiled [v0 of k0, v0 of k1, ...]."""
    r = n_v // n_k
    if r == 1:
        return x
    shape = list(x.shape)
    y = x.reshape(shape[:axis] + [n_k, r, head_dim] + shape[axis + 1 :])
    return np.ascontiguousarray(np.swapaxes(y, axis, axis + 1)).reshape(shape)


def plan_tensor(
    arch: gguf.MODEL_ARCH, cfg: dict[str, Any], hf_name: str, shape: tuple[int, ...], load: Callable[[], np.ndarray]
) -> list[Planned] | None:
    """The GGUF tensors for one HF tensor when it needs arch-specific handling; [] to drop it; None to
    leave it to the generic path (name map, Qwen's +1 on norms)."""
    if hf_name.startswith(("mtp.", "model.mtp.")):
        return []
    m = _LINEAR_ATTN_RE.match(hf_name)
    if m is None:
        return None
    p, what = f"blk.{m[1]}.", m[2]
    n_k, n_v = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    dk, dv = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
    if arch == gguf.MODEL_ARCH.QWEN35MOE:
        def tile(x: np.ndarray, axis: int, head_dim: int) -> np.ndarray:
            return _tile(x, axis, n_k, n_v, head_dim)
    else:  # qwen3next keeps the Hugging Face (grouped) order
        def tile(x: np.ndarray, axis: int, head_dim: int) -> np.ndarray:
            return x

    qk = 2 * n_k * dk  # q and k channels, ahead of v in qkv and in the conv
    if what == "A_log":
        return [(p + "ssm_a", shape, lambda: -np.exp(tile(load(), 0, 1)))]
    if what == "dt_bias":
        return [(p + "ssm_dt.bias", shape, lambda: tile(load(), 0, 1))]
    if what == "conv1d.weight":
        c, k = shape[0], shape[-1]

        def conv() -> np.ndarray:
            x = load().reshape(c, k)
            return np.concatenate([x[:qk], tile(x[qk:], 0, dv)])

        return [(p + "ssm_conv1d.weight", (c, k), conv)]
    if what == "norm.weight":  # RMSNormGated: x * w, no +1
        return [(p + "ssm_norm.weight", shape, load)]
    if what == "out_proj.weight":
        return [(p + "ssm_out.weight", shape, lambda: tile(load(), 1, dv))]
    if what == "in_proj_qkv.weight":
        return [(p + "attn_qkv.weight", shape, lambda: np.concatenate([load()[:qk], tile(load()[qk:], 0, dv)]))]
    if what == "in_proj_z.weight":
        return [(p + "attn_gate.weight", shape, lambda: tile(load(), 0, dv))]
    if what in ("in_proj_b.weight", "in_proj_a.weight"):
        name = "ssm_beta.weight" if what == "in_proj_b.weight" else "ssm_alpha.weight"
        return [(p + name, shape, lambda: tile(load(), 0, 1))]
    if what == "in_proj_ba.weight":
        return [(p + "ssm_ba.weight", shape, load)]
    if what == "in_proj_qkvz.weight":
        return _split_qkvz(p, shape, load, n_k, n_v, dk, dv)
    raise ConversionError(f"cannot map tensor '{hf_name}'")


def _split_qkvz(
    p: str, shape: tuple[int, ...], load: Callable[[], np.ndarray], n_k: int, n_v: int, dk: int, dv: int
) -> list[Planned]:
    """Qwen3-Next's in_proj_qkvz rows, per key head [q, k, v (r heads), z (r heads)], into `attn_qkv`
    [all q, all k, all v] and `attn_gate` [all z]."""
    hidden = shape[1]
    rv = n_v // n_k * dv
    if shape[0] != n_k * (2 * dk + 2 * rv):
        raise ConversionError(f"in_proj_qkvz has {shape[0]} rows, expected {n_k * (2 * dk + 2 * rv)}")

    def parts() -> list[np.ndarray]:
        x = load().reshape(n_k, 2 * dk + 2 * rv, hidden)
        bounds = np.cumsum([0, dk, dk, rv, rv])
        return [x[:, a:b].reshape(-1, hidden) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

    return [
        (p + "attn_qkv.weight", (n_k * (2 * dk + rv), hidden), lambda: np.concatenate(parts()[:3])),
        (p + "attn_gate.weight", (n_k * rv, hidden), lambda: np.ascontiguousarray(parts()[3])),
    ]
