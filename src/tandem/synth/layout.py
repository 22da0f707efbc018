"""What llama.cpp expects in a GGUF file of each preset's architecture: tensor names and shapes, metadata keys.

Tensor lists follow `load_arch_tensors` of llama.cpp's src/models/{qwen3moe,qwen35moe,gemma4,openai-moe}.cpp and
the tensors its converter (convert_hf_to_gguf.py / conversion/*.py) writes; metadata keys follow the models'
`load_arch_hparams`, llama_model_base::load_hparams and src/llama-arch.cpp. Shapes are in PyTorch order
(outermost first, the row last), as tandem's reader reports them: ggml's {n_embd, n_ff, n_expert} is
(n_expert, n_ff, n_embd) here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.synth.presets import Gemma4Preset, GptOssPreset, Preset, Qwen3MoePreset, Qwen35MoePreset

# How a tensor's values are made (see tandem.synth.blocks): random weights of std ~0.02, norm weights ~1.0,
# small biases, or arrays that must hold particular values for the model to compute sanely.
WEIGHT, NORM, BIAS, ONE, SSM_A, ROPE_FREQS = "weight", "norm", "bias", "one", "ssm_a", "rope_freqs"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # PyTorch order; shape[-1] is the row length (ggml ne[0])
    init: str = WEIGHT

    @property
    def layer(self) -> int | None:
        """The block index of a `blk.N.*` tensor, else None."""
        return int(self.name.split(".")[1]) if self.name.startswith("blk.") else None

    @property
    def n_elements(self) -> int:
        """Number of values (parameters) in the tensor."""
        n = 1
        for d in self.shape:
            n *= d
        return n


def tensors(p: Preset, n_layers: int) -> list[TensorSpec]:
    """Every tensor of an `n_layers`-layer model of preset `p`, in file order."""
    kinds = p.layer_kinds(n_layers)
    out = [TensorSpec("token_embd.weight", (p.n_vocab, p.hidden))]
    if isinstance(p, Gemma4Preset):
        # one table for every global layer: 1.0 on the rotated quarter, 1e30 (= no rotation) on the rest
        out.append(TensorSpec("rope_freqs.weight", (p.head_dim_full // 2,), ROPE_FREQS))
    for i, kind in enumerate(kinds):
        if isinstance(p, Qwen35MoePreset):
            out += _qwen35moe_layer(p, i, kind)
        elif isinstance(p, Qwen3MoePreset):
            out += _qwen3moe_layer(p, i)
        elif isinstance(p, Gemma4Preset):
            out += _gemma4_layer(p, i, kind)
        elif isinstance(p, GptOssPreset):
            out += _gpt_oss_layer(p, i)
        else:  # pragma: no cover - every preset class is handled above
            raise TypeError(f"no layout for {type(p).__name__}")
    out.append(TensorSpec("output_norm.weight", (p.hidden,), NORM))
    if not isinstance(p, Gemma4Preset):  # Gemma ties the output projection to token_embd
        out.append(TensorSpec("output.weight", (p.n_vocab, p.hidden)))
    return out


def _moe(p: Preset, i: int, fused_gate_up: bool = False) -> list[TensorSpec]:
    b, e, x, f = f"blk.{i}", p.hidden, p.n_experts, p.expert_ffn
    router = [TensorSpec(f"{b}.ffn_gate_inp.weight", (x, e))]
    down = [TensorSpec(f"{b}.ffn_down_exps.weight", (x, e, f))]
    if fused_gate_up:
        return router + [TensorSpec(f"{b}.ffn_gate_up_exps.weight", (x, 2 * f, e))] + down
    return router + [TensorSpec(f"{b}.ffn_gate_exps.weight", (x, f, e))] + down + [
        TensorSpec(f"{b}.ffn_up_exps.weight", (x, f, e))
    ]


def _qwen3moe_layer(p: Qwen3MoePreset, i: int) -> list[TensorSpec]:
    b, e, q, kv, d = f"blk.{i}", p.hidden, p.n_heads * p.head_dim, p.n_kv_heads * p.head_dim, p.head_dim
    return [
        TensorSpec(f"{b}.attn_norm.weight", (e,), NORM),
        TensorSpec(f"{b}.attn_q.weight", (q, e)),
        TensorSpec(f"{b}.attn_k.weight", (kv, e)),
        TensorSpec(f"{b}.attn_v.weight", (kv, e)),
        TensorSpec(f"{b}.attn_output.weight", (e, q)),
        TensorSpec(f"{b}.attn_k_norm.weight", (d,), NORM),
        TensorSpec(f"{b}.attn_q_norm.weight", (d,), NORM),
        TensorSpec(f"{b}.ffn_norm.weight", (e,), NORM),
        *_moe(p, i),
    ]


def _qwen35moe_layer(p: Qwen35MoePreset, i: int, kind: str) -> list[TensorSpec]:
    b, e, d, s = f"blk.{i}", p.hidden, p.head_dim, p.shared_ffn
    out = [TensorSpec(f"{b}.attn_norm.weight", (e,), NORM), TensorSpec(f"{b}.post_attention_norm.weight", (e,), NORM)]
    if kind == "full":  # gated attention: attn_q also carries the output gate, hence 2x
        q, kv = p.n_heads * d, p.n_kv_heads * d
        out += [
            TensorSpec(f"{b}.attn_q.weight", (2 * q, e)),
            TensorSpec(f"{b}.attn_k.weight", (kv, e)),
            TensorSpec(f"{b}.attn_v.weight", (kv, e)),
            TensorSpec(f"{b}.attn_output.weight", (e, q)),
            TensorSpec(f"{b}.attn_q_norm.weight", (d,), NORM),
            TensorSpec(f"{b}.attn_k_norm.weight", (d,), NORM),
        ]
    else:  # Gated DeltaNet
        hk, hv = p.linear_k_heads, p.linear_v_heads
        key_dim, value_dim = p.linear_head_dim * hk, p.linear_head_dim * hv
        out += [
            TensorSpec(f"{b}.attn_qkv.weight", (2 * key_dim + value_dim, e)),
            TensorSpec(f"{b}.attn_gate.weight", (value_dim, e)),
            TensorSpec(f"{b}.ssm_conv1d.weight", (2 * key_dim + value_dim, p.conv_kernel)),
            TensorSpec(f"{b}.ssm_dt.bias", (hv,), ONE),
            TensorSpec(f"{b}.ssm_a", (hv,), SSM_A),
            TensorSpec(f"{b}.ssm_beta.weight", (hv, e)),
            TensorSpec(f"{b}.ssm_alpha.weight", (hv, e)),
            TensorSpec(f"{b}.ssm_norm.weight", (p.linear_head_dim,), NORM),
            TensorSpec(f"{b}.ssm_out.weight", (e, value_dim)),
        ]
    return out + [
        *_moe(p, i),
        TensorSpec(f"{b}.ffn_gate_inp_shexp.weight", (e,)),
        TensorSpec(f"{b}.ffn_gate_shexp.weight", (s, e)),
        TensorSpec(f"{b}.ffn_up_shexp.weight", (s, e)),
        TensorSpec(f"{b}.ffn_down_shexp.weight", (e, s)),
    ]


def _gemma4_layer(p: Gemma4Preset, i: int, kind: str) -> list[TensorSpec]:
    b, e, f = f"blk.{i}", p.hidden, p.ffn
    full = kind == "full"
    d = p.head_dim_full if full else p.head_dim
    kv = (p.n_kv_heads_full if full else p.n_kv_heads) * d
    out = [
        TensorSpec(f"{b}.attn_norm.weight", (e,), NORM),
        TensorSpec(f"{b}.attn_q.weight", (p.n_heads * d, e)),
        TensorSpec(f"{b}.attn_k.weight", (kv, e)),
    ]
    if not (full and p.k_eq_v):  # global layers reuse K as V (attention_k_eq_v): no attn_v
        out.append(TensorSpec(f"{b}.attn_v.weight", (kv, e)))
    return out + [
        TensorSpec(f"{b}.attn_output.weight", (e, p.n_heads * d)),
        TensorSpec(f"{b}.attn_q_norm.weight", (d,), NORM),
        TensorSpec(f"{b}.attn_k_norm.weight", (d,), NORM),
        TensorSpec(f"{b}.post_attention_norm.weight", (e,), NORM),
        TensorSpec(f"{b}.layer_output_scale.weight", (1,), ONE),
        TensorSpec(f"{b}.ffn_norm.weight", (e,), NORM),
        TensorSpec(f"{b}.ffn_gate.weight", (f, e)),
        TensorSpec(f"{b}.ffn_up.weight", (f, e)),
        TensorSpec(f"{b}.ffn_down.weight", (e, f)),
        TensorSpec(f"{b}.post_ffw_norm.weight", (e,), NORM),
        TensorSpec(f"{b}.ffn_gate_inp.scale", (e,), ONE),
        TensorSpec(f"{b}.pre_ffw_norm_2.weight", (e,), NORM),
        TensorSpec(f"{b}.post_ffw_norm_1.weight", (e,), NORM),
        TensorSpec(f"{b}.post_ffw_norm_2.weight", (e,), NORM),
        *_moe(p, i, fused_gate_up=True),  # the HF checkpoint's experts.gate_up_proj is kept fused
        TensorSpec(f"{b}.ffn_down_exps.scale", (p.n_experts,), ONE),  # router.per_expert_scale
    ]


def _gpt_oss_layer(p: GptOssPreset, i: int) -> list[TensorSpec]:
    b, e, x, f = f"blk.{i}", p.hidden, p.n_experts, p.expert_ffn
    q, kv = p.n_heads * p.head_dim, p.n_kv_heads * p.head_dim
    return [
        TensorSpec(f"{b}.attn_norm.weight", (e,), NORM),
        TensorSpec(f"{b}.attn_q.weight", (q, e)),
        TensorSpec(f"{b}.attn_q.bias", (q,), BIAS),
        TensorSpec(f"{b}.attn_k.weight", (kv, e)),
        TensorSpec(f"{b}.attn_k.bias", (kv,), BIAS),
        TensorSpec(f"{b}.attn_v.weight", (kv, e)),
        TensorSpec(f"{b}.attn_v.bias", (kv,), BIAS),
        TensorSpec(f"{b}.attn_output.weight", (e, q)),
        TensorSpec(f"{b}.attn_output.bias", (e,), BIAS),
        TensorSpec(f"{b}.attn_sinks.weight", (p.n_heads,), BIAS),
        TensorSpec(f"{b}.post_attention_norm.weight", (e,), NORM),
        TensorSpec(f"{b}.ffn_gate_inp.weight", (x, e)),
        TensorSpec(f"{b}.ffn_gate_inp.bias", (x,), BIAS),
        TensorSpec(f"{b}.ffn_gate_exps.weight", (x, f, e)),
        TensorSpec(f"{b}.ffn_gate_exps.bias", (x, f), BIAS),
        TensorSpec(f"{b}.ffn_down_exps.weight", (x, e, f)),
        TensorSpec(f"{b}.ffn_down_exps.bias", (x, e), BIAS),
        TensorSpec(f"{b}.ffn_up_exps.weight", (x, f, e)),
        TensorSpec(f"{b}.ffn_up_exps.bias", (x, f), BIAS),
    ]


def metadata(p: Preset, n_layers: int) -> dict[str, Any]:
    """The `{arch}.*` hyper-parameter keys of an `n_layers`-layer model (int -> uint32, float -> float32)."""
    a = p.arch
    md: dict[str, Any] = {
        f"{a}.block_count": n_layers,
        f"{a}.context_length": p.context_length,
        f"{a}.embedding_length": p.hidden,
        f"{a}.attention.head_count": p.n_heads,
        f"{a}.attention.head_count_kv": p.n_kv_heads,
        f"{a}.attention.key_length": p.head_dim,
        f"{a}.attention.value_length": p.head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": float(p.rms_eps),
        f"{a}.rope.freq_base": float(p.rope_base),
        f"{a}.expert_count": p.n_experts,
        f"{a}.expert_used_count": p.n_experts_used,
        f"{a}.expert_feed_forward_length": p.expert_ffn,
    }
    if isinstance(p, Qwen3MoePreset):
        md[f"{a}.feed_forward_length"] = p.ffn
    elif isinstance(p, Qwen35MoePreset):
        md.update({
            f"{a}.expert_shared_feed_forward_length": p.shared_ffn,
            f"{a}.ssm.conv_kernel": p.conv_kernel,
            f"{a}.ssm.state_size": p.linear_head_dim,
            f"{a}.ssm.group_count": p.linear_k_heads,
            f"{a}.ssm.time_step_rank": p.linear_v_heads,
            f"{a}.ssm.inner_size": p.linear_head_dim * p.linear_v_heads,
            f"{a}.full_attention_interval": p.interval(n_layers),
            f"{a}.rope.dimension_count": p.rope_dim,
            f"{a}.rope.dimension_sections": list(p.rope_sections),
        })  # fmt: skip
    elif isinstance(p, Gemma4Preset):
        swa = [k == "sliding" for k in p.layer_kinds(n_layers)]
        md.update({
            f"{a}.feed_forward_length": p.ffn,
            f"{a}.attention.head_count_kv": [p.n_kv_heads if s else p.n_kv_heads_full for s in swa],
            f"{a}.attention.key_length": p.head_dim_full,
            f"{a}.attention.value_length": p.head_dim_full,
            f"{a}.attention.key_length_swa": p.head_dim,
            f"{a}.attention.value_length_swa": p.head_dim,
            f"{a}.attention.sliding_window": p.sliding_window,
            f"{a}.attention.sliding_window_pattern": swa,
            f"{a}.attention.shared_kv_layers": 0,
            f"{a}.embedding_length_per_layer_input": 0,
            f"{a}.rope.freq_base_swa": float(p.rope_base_swa),
            f"{a}.rope.dimension_count": p.head_dim_full,  # "proportional": rope_freqs disables 3/4 of it
            f"{a}.rope.dimension_count_swa": p.head_dim,
            f"{a}.final_logit_softcapping": float(p.final_logit_softcap),
        })  # fmt: skip
    elif isinstance(p, GptOssPreset):
        md.update({
            f"{a}.feed_forward_length": p.expert_ffn,
            f"{a}.attention.sliding_window": p.sliding_window,
            f"{a}.rope.scaling.type": "yarn",
            f"{a}.rope.scaling.factor": float(p.yarn_factor),
            f"{a}.rope.scaling.original_context_length": p.yarn_orig_ctx,
            f"{a}.rope.scaling.yarn_beta_fast": float(p.yarn_beta_fast),
            f"{a}.rope.scaling.yarn_beta_slow": float(p.yarn_beta_slow),
        })  # fmt: skip
    return md
