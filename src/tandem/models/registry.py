"""Architecture lookup by GGUF `general.architecture`, with a small alias table.

Adding a family is adding a file with `read_config` (and, for unusual layers, `build_block`) and
one line here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from tandem.errors import GGUFFormatError, UnsupportedModelError
from tandem.gguf import GGUFFile, metadata_errors
from tandem.gguf.header import quote
from tandem.models import gemma3, gemma4, gpt_oss, qwen3, qwen3moe, qwen35moe
from tandem.models.blocks import BlockBuilder, standard_block
from tandem.models.config import LayerSpec, ModelConfig


@dataclass(frozen=True)
class Architecture:
    read_config: Callable[[GGUFFile], ModelConfig]
    build_block: BlockBuilder = standard_block


_ARCHITECTURES: dict[str, Architecture] = {
    "qwen3": Architecture(qwen3.read_config),
    "qwen3moe": Architecture(qwen3moe.read_config),
    "gemma3": Architecture(gemma3.read_config),
    "gpt-oss": Architecture(gpt_oss.read_config, gpt_oss.build_block),
    "gemma4": Architecture(gemma4.read_config, gemma4.build_block),
    "qwen35moe": Architecture(qwen35moe.read_config, qwen35moe.build_block),
    "qwen3next": Architecture(qwen35moe.read_config, qwen35moe.build_block),  # same file, small differences
}
_ALIASES: dict[str, str] = {}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_ARCHITECTURES))


def architecture(f: GGUFFile) -> Architecture:
    """The Architecture of a GGUF file, or a one-line UnsupportedModelError."""
    spec = _ARCHITECTURES.get(_ALIASES.get(f.arch, f.arch))
    if spec is None:
        raise UnsupportedModelError(
            f"{f.path.name}: architecture {quote(f.arch)} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return spec


def read_config(f: GGUFFile) -> ModelConfig:
    """The ModelConfig of a GGUF file, checked against its tensors' shapes (metadata that cannot make one, or
    tensors that do not fit it: a one-line error)."""
    spec = architecture(f)
    with metadata_errors(f.path, f.arch):
        cfg = spec.read_config(f)
    check_tensor_shapes(f, cfg)
    return cfg


# The shape (PyTorch order) of every tensor whose sizes the metadata fixes, as llama.cpp's loader creates them: per
# axis, what it is and the sizes allowed, or a letter for a size the metadata leaves free, which must then be the same
# wherever that letter appears in one layer (the FFN size of the gate, up and down matrices). A tensor may have
# several allowed shapes (the shared expert's gate is stored as [hidden] or [1, hidden]).
Axis = tuple[str, tuple[int, ...] | str]
Shape = tuple[Axis, ...]

_NORMS = ("attn_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm", "post_ffw_norm_1", "post_ffw_norm_2",
          "pre_ffw_norm_2")  # fmt: skip


def _layer_shapes(cfg: ModelConfig, spec: LayerSpec) -> dict[str, tuple[Shape, ...]]:
    """The shapes of one layer's tensors, by name after `blk.N.`."""
    head_dim = spec.head_dim or cfg.head_dim
    value_dim = spec.head_dim or cfg.value_dim  # a layer with its own head size has values of that size (Gemma 4)
    n_kv = spec.n_kv_heads or cfg.n_kv_heads
    q_rows = cfg.n_heads * head_dim
    h: Axis = ("width", (cfg.hidden,))
    q: Axis = ("heads x head size", (q_rows,))
    k: Axis = ("KV heads x head size", (n_kv * head_dim,))
    v: Axis = ("KV heads x value size", (n_kv * value_dim,))
    ffn: Axis = ("FFN size", "F")
    shapes: dict[str, tuple[Shape, ...]] = {
        **dict.fromkeys([f"{n}.weight" for n in _NORMS], ((h,),)),
        # twice the rows where the query carries its output gate (Qwen3.5/3.6)
        "attn_q.weight": ((("heads x head size", (q_rows, 2 * q_rows)), h),),
        "attn_k.weight": ((k, h),),
        "attn_v.weight": ((v, h),),
        "attn_output.weight": ((h, ("heads x value size", (cfg.n_heads * value_dim,))),),
        "attn_q.bias": ((q,),),
        "attn_k.bias": ((k,),),
        "attn_v.bias": ((v,),),
        "attn_output.bias": ((h,),),
        "attn_q_norm.weight": ((("head size", (head_dim,)),),),
        "attn_k_norm.weight": ((("head size", (head_dim,)),),),
        "attn_sinks.weight": ((("query heads", (cfg.n_heads,)),),),
        "ffn_gate.weight": ((ffn, h),),
        "ffn_up.weight": ((ffn, h),),
        "ffn_down.weight": ((h, ffn),),
        "layer_output_scale.weight": ((("one scale", (1,)),),),
    }
    if cfg.moe is not None:
        e: Axis = ("expert count", (cfg.moe.n_experts,))
        f: Axis = ("expert FFN size", (cfg.moe.expert_ffn_dim,))
        shapes |= {
            "ffn_gate_inp.weight": ((e, h),),
            "ffn_gate_inp.bias": ((e,),),
            "ffn_gate_inp.scale": ((h,),),
            "ffn_gate_exps.weight": ((e, f, h),),
            "ffn_up_exps.weight": ((e, f, h),),
            "ffn_gate_up_exps.weight": ((e, ("expert FFN size", (2 * cfg.moe.expert_ffn_dim,)), h),),
            "ffn_down_exps.weight": ((e, h, f),),
            "ffn_gate_exps.bias": ((e, f),),
            "ffn_up_exps.bias": ((e, f),),
            "ffn_down_exps.bias": ((e, h),),
            "ffn_down_exps.scale": ((e,),),
        }
    shared = getattr(cfg, "shared_expert_ffn_dim", None)
    if shared is not None:
        s: Axis = ("shared expert FFN size", (shared,))
        shapes |= {
            "ffn_gate_inp_shexp.weight": ((h,), (("one gate", (1,)), h)),
            "ffn_gate_shexp.weight": ((s, h),),
            "ffn_up_shexp.weight": ((s, h),),
            "ffn_down_shexp.weight": ((h, s),),
        }
    net = getattr(cfg, "delta_net", None)
    if net is not None:
        keys, values = net.n_k_heads * net.head_k_dim, net.n_v_heads * net.head_v_dim
        conv: Axis = ("ssm q, k and v size", (2 * keys + values,))  # q, k and v through the short convolution
        val: Axis = ("ssm value heads x size", (values,))
        heads: Axis = ("ssm value heads", (net.n_v_heads,))
        shapes |= {
            "attn_qkv.weight": ((conv, h),),
            "attn_gate.weight": ((val, h),),
            "ssm_beta.weight": ((heads, h),),
            "ssm_alpha.weight": ((heads, h),),
            "ssm_ba.weight": ((("2 x ssm value heads", (2 * net.n_v_heads,)), h),),
            "ssm_conv1d.weight": ((conv, ("ssm conv kernel", (net.conv_kernel,))),),
            "ssm_dt.bias": ((heads,),),
            "ssm_a": ((heads,),),
            "ssm_norm.weight": ((("ssm value head size", (net.head_v_dim,)),),),
            "ssm_out.weight": ((h, val),),
        }
    return shapes


def _mismatch(shape: tuple[int, ...], expected: Shape, letters: dict[str, int]) -> str | None:
    """Why `shape` is not `expected` (None: it is); binds the letters it meets for the first time."""
    if len(shape) != len(expected):
        return f"the metadata gives {len(expected)} dimensions"
    bound = dict(letters)
    for i, (size, (what, allowed)) in enumerate(zip(shape, expected, strict=True)):
        if isinstance(allowed, str):
            if bound.setdefault(allowed, size) != size:
                return f"the layer's other tensors give {what} {bound[allowed]} (axis {i})"
        elif size not in allowed:
            return f"the metadata's {what} is {' or '.join(map(str, allowed))} (axis {i})"
    letters.update(bound)
    return None


def check_tensor_shapes(f: GGUFFile, cfg: ModelConfig) -> None:
    """Every tensor whose sizes the metadata fixes, against the config, as llama.cpp checks them at load: the
    vocabulary and the residual stream's width in the embedding and the output head, and each layer's norms,
    projections, biases, sinks, q/k norms, routed and shared experts and delta-net tensors. A tensor that disagrees
    is a one-line error before any weight is read, not a failure deep in a forward pass. Also, the tokenizer's
    tokens must be ids of the model's vocabulary."""
    tokens = f.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) > cfg.n_vocab:
        raise GGUFFormatError(
            f"{f.path.name}: the tokenizer has {len(tokens)} tokens for a vocabulary of {cfg.n_vocab}"
        )
    vocab: Axis = ("vocabulary", (cfg.n_vocab,))
    width: Axis = ("width", (cfg.hidden,))
    model_wide: dict[str, tuple[Shape, ...]] = {
        "token_embd.weight": ((vocab, width),),
        "output.weight": ((vocab, width),),
        "output_norm.weight": ((width,),),
    }
    layers = [_layer_shapes(cfg, spec) for spec in cfg.layers]
    gated = getattr(cfg, "delta_net", None) is not None  # Qwen3.5/3.6 and Qwen3-Next: queries carry their gate
    letters: list[dict[str, int]] = [{} for _ in cfg.layers]
    for name, info in f.tensors.items():
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
        if m is None:
            table, bound = model_wide, {}
        elif int(m.group(1)) < cfg.n_layers:  # later blocks (MTP) are not run
            table, bound = layers[int(m.group(1))], letters[int(m.group(1))]
            name = m.group(2)
        else:
            continue
        reasons = [_mismatch(info.shape, shape, bound) for shape in table.get(name, ())]
        if reasons and None not in reasons:  # the reason given is that of the shape with as many dimensions
            reason = next((r for r in reasons if r and "dimensions" not in r), reasons[0])
            raise GGUFFormatError(f"{f.path.name}: tensor {quote(info.name)} has shape {info.shape}; {reason}")
        if m is not None and name == "attn_q.weight" and not gated:
            spec = cfg.layers[int(m.group(1))]
            if info.shape[0] != (rows := cfg.n_heads * (spec.head_dim or cfg.head_dim)):
                raise GGUFFormatError(
                    f"{f.path.name}: tensor {quote(info.name)} has shape {info.shape}; the metadata's heads x head "
                    f"size is {rows} (axis 0): twice that is a gated query, which {cfg.arch} does not have"
                )
