"""The shapes and hyper-parameters of real MoE models, one dataclass instance per preset.

Every figure is the published model's (its Hugging Face `config.json`, which for Qwen3.5/3.6 equals the
documented defaults of transformers' `Qwen3_5MoeTextConfig`); each preset says where its figures come from.
How llama.cpp stores them (GGUF keys, tensor names and shapes) lives in `tandem.synth.layout`.

`layer_kinds(n)` gives the kind of each of the first `n` layers: "full" (global attention), "sliding"
(sliding-window attention) or "linear" (Gated DeltaNet). With fewer layers than the real model the real
pattern is kept, and a truncated model always keeps at least one global-attention layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.errors import TandemError


class SynthError(TandemError):
    """`tandem synth` cannot make the requested model."""


class UnknownPresetError(SynthError):
    """--like names no preset."""


class BadLayersError(SynthError):
    """--layers is not between 1 and the real layer count."""


@dataclass(frozen=True)
class ChatTokens:
    """Special tokens placed at their real ids, and a chat template using them."""

    bos: int
    eos: int
    pad: int | None
    add_bos: bool
    specials: dict[int, str]  # id -> text, typed CONTROL
    chat_template: str


@dataclass(frozen=True)
class Preset:
    """Figures shared by every architecture."""

    name: str
    arch: str  # GGUF general.architecture
    source: str  # where the figures come from
    n_vocab: int
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    n_experts_used: int
    expert_ffn: int
    context_length: int
    rms_eps: float
    rope_base: float
    tokenizer_pre: str  # tokenizer.ggml.pre (the model is always "gpt2")
    tokens: ChatTokens
    expert_qtype: str | None = None  # the expert tensors' type whatever the mix (gpt-oss ships MXFP4 experts)

    def check_layers(self, n: int | None) -> int:
        """The layer count to build: `n`, or the real count when None; BadLayersError when out of range."""
        if n is None:
            return self.n_layers
        if not 1 <= n <= self.n_layers:
            raise BadLayersError(f"--layers must be between 1 and {self.n_layers} for {self.name}, got {n}")
        return n

    def layer_kinds(self, n: int) -> tuple[str, ...]:
        """The kind of each layer of an `n`-layer model: "full", "sliding" or "linear"."""
        return ("full",) * n


@dataclass(frozen=True)
class Qwen3MoePreset(Preset):
    """qwen3moe: Qwen3 attention (q/k norms), every layer routed experts, no shared expert."""

    ffn: int = 0  # `intermediate_size`, written as feed_forward_length (unused by the MoE layers)


@dataclass(frozen=True)
class Qwen35MoePreset(Preset):
    """qwen35moe: 3 Gated DeltaNet layers then 1 gated-attention layer, routed + one shared expert."""

    shared_ffn: int = 0
    full_attention_interval: int = 4
    rope_dim: int = 64  # head_dim * partial_rotary_factor (0.25)
    rope_sections: tuple[int, int, int, int] = (11, 11, 10, 0)  # mrope_section, padded to 4 as llama.cpp's converter
    conv_kernel: int = 4  # linear_conv_kernel_dim
    linear_k_heads: int = 16  # linear_num_key_heads  -> ssm.group_count
    linear_v_heads: int = 32  # linear_num_value_heads -> ssm.time_step_rank
    linear_head_dim: int = 128  # linear_key_head_dim == linear_value_head_dim -> ssm.state_size

    def interval(self, n: int) -> int:
        """full_attention_interval of an `n`-layer model: the real one, shortened so one attention layer stays."""
        return min(self.full_attention_interval, n)

    def layer_kinds(self, n: int) -> tuple[str, ...]:
        k = self.interval(n)
        return tuple("full" if (i + 1) % k == 0 else "linear" for i in range(n))


@dataclass(frozen=True)
class Gemma4Preset(Preset):
    """gemma4 (MoE variant): 5 sliding layers then 1 global; every layer has a dense MLP and routed experts."""

    ffn: int = 0  # dense MLP (intermediate_size)
    sliding_window: int = 1024
    swa_period: int = 6  # layer_types: 5 x sliding_attention, 1 x full_attention
    n_kv_heads_full: int = 2  # num_global_key_value_heads
    head_dim_full: int = 512  # global_head_dim
    rope_base_swa: float = 10_000.0
    partial_rotary_full: float = 0.25  # full layers: "proportional" rope on a quarter of the head
    final_logit_softcap: float = 30.0
    k_eq_v: bool = True  # attention_k_eq_v: global layers have no v projection

    def layer_kinds(self, n: int) -> tuple[str, ...]:
        kinds = ["full" if (i + 1) % self.swa_period == 0 else "sliding" for i in range(n)]
        kinds[-1] = "full"  # Gemma 4 requires a global last layer (transformers forces it too)
        return tuple(kinds)


@dataclass(frozen=True)
class GptOssPreset(Preset):
    """gpt-oss: alternating sliding/full attention with sinks and biases, MXFP4 routed experts."""

    sliding_window: int = 128
    yarn_factor: float = 32.0
    yarn_orig_ctx: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0

    def layer_kinds(self, n: int) -> tuple[str, ...]:
        # llama.cpp's default for gpt-oss (load_swa_pattern(ml, 2)): even layers sliding, odd layers full
        return tuple("sliding" if i % 2 == 0 else "full" for i in range(n))


_CHATML = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
_GEMMA4_TEMPLATE = (
    "{{- bos_token -}}{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<|turn>' + role + '\\n' + message['content'] + '<turn|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|turn>model\\n' }}{%- endif -%}"
)
_HARMONY_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|start|>assistant' }}{%- endif -%}"
)

_QWEN3_TOKENS = ChatTokens(
    bos=151643, eos=151645, pad=151643, add_bos=False, chat_template=_CHATML,
    specials={151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"},
)  # fmt: skip
_QWEN35_TOKENS = ChatTokens(
    bos=248044, eos=248046, pad=248044, add_bos=False, chat_template=_CHATML,
    specials={248044: "<|endoftext|>", 248045: "<|im_start|>", 248046: "<|im_end|>"},
)  # fmt: skip
_GEMMA4_TOKENS = ChatTokens(
    bos=2, eos=1, pad=0, add_bos=True, chat_template=_GEMMA4_TEMPLATE,
    specials={0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 105: "<|turn>", 106: "<turn|>"},
)  # fmt: skip
_GPT_OSS_TOKENS = ChatTokens(
    bos=199998, eos=200002, pad=199999, add_bos=False, chat_template=_HARMONY_TEMPLATE,
    specials={199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200005: "<|channel|>",
              200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>"},
)  # fmt: skip

# Qwen/Qwen3-30B-A3B config.json: hidden_size 2048, num_hidden_layers 48, num_attention_heads 32,
# num_key_value_heads 4, head_dim 128, num_experts 128, num_experts_per_tok 8, moe_intermediate_size 768,
# intermediate_size 6144, vocab_size 151936, max_position_embeddings 40960, rope_theta 1e6, rms_norm_eps 1e-6.
QWEN3_30B_A3B = Qwen3MoePreset(
    name="qwen3-30b-a3b", arch="qwen3moe", source="Qwen/Qwen3-30B-A3B config.json",
    n_vocab=151936, hidden=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
    n_experts=128, n_experts_used=8, expert_ffn=768, ffn=6144,
    context_length=40960, rms_eps=1e-6, rope_base=1e6, tokenizer_pre="qwen2", tokens=_QWEN3_TOKENS,
)  # fmt: skip

# Qwen/Qwen3.6-35B-A3B text_config = transformers' Qwen3_5MoeTextConfig defaults ("Qwen/Qwen3.5-35B-A3B"):
# hidden_size 2048, 40 layers (10 x [3 DeltaNet + 1 attention]), 16 q / 2 kv heads of 256, partial_rotary 0.25,
# linear attention 16 qk / 32 v heads of 128, conv kernel 4, 256 experts top-8 of 512, shared expert 512,
# vocab 248320; rope_theta 1e7, mrope_section [11, 11, 10], max_position_embeddings 262144 (model card).
QWEN36_35B_A3B = Qwen35MoePreset(
    name="qwen3.6-35b-a3b", arch="qwen35moe",
    source="Qwen/Qwen3.6-35B-A3B config.json (= transformers Qwen3_5MoeTextConfig defaults) and model card",
    n_vocab=248320, hidden=2048, n_layers=40, n_heads=16, n_kv_heads=2, head_dim=256,
    n_experts=256, n_experts_used=8, expert_ffn=512, shared_ffn=512, linear_v_heads=32,
    context_length=262144, rms_eps=1e-6, rope_base=1e7, tokenizer_pre="qwen35", tokens=_QWEN35_TOKENS,
)  # fmt: skip

# Qwen/Qwen3.5-122B-A10B config.json / model card: hidden_size 3072, 48 layers (12 x [3 DeltaNet + 1 attention]),
# 32 q / 2 kv heads of 256, linear attention 16 qk / 64 v heads of 128, 256 experts top-8 of 1024, shared
# expert 1024, vocab 248320, rope_theta 1e7, 262144 context. (Sum of the shapes: 122.1B parameters.)
QWEN35_122B_A10B = Qwen35MoePreset(
    name="qwen3.5-122b-a10b", arch="qwen35moe", source="Qwen/Qwen3.5-122B-A10B config.json and model card",
    n_vocab=248320, hidden=3072, n_layers=48, n_heads=32, n_kv_heads=2, head_dim=256,
    n_experts=256, n_experts_used=8, expert_ffn=1024, shared_ffn=1024, linear_v_heads=64,
    context_length=262144, rms_eps=1e-6, rope_base=1e7, tokenizer_pre="qwen35", tokens=_QWEN35_TOKENS,
)  # fmt: skip

# google/gemma-4-26B-A4B-it config.json (text_config), as restated by THUDM/slime's gemma4-26B-A4B.sh, NVIDIA
# Megatron-Bridge's Gemma4 provider and transformers' Gemma4TextConfig: hidden_size 2816, 30 layers (5 sliding :
# 1 full), 16 heads; sliding layers 8 kv heads of 256, full layers num_global_key_value_heads 2 of
# global_head_dim 512 with attention_k_eq_v; intermediate_size 2112 (dense MLP beside the experts), 128 experts
# top-8 of moe_intermediate_size 704, sliding_window 1024, vocab 262144, rope_theta 1e6 (full, proportional
# 0.25) / 1e4 (sliding), final_logit_softcapping 30, tied embeddings, no per-layer embeddings.
# (Sum of the shapes: 25.2B parameters, as published; KV cache 210 KiB/token at f16, as published.)
GEMMA4_26B_A4B = Gemma4Preset(
    name="gemma4-26b-a4b", arch="gemma4", source="google/gemma-4-26B-A4B-it config.json (text_config)",
    n_vocab=262144, hidden=2816, n_layers=30, n_heads=16, n_kv_heads=8, head_dim=256,
    n_experts=128, n_experts_used=8, expert_ffn=704, ffn=2112,
    context_length=262144, rms_eps=1e-6, rope_base=1e6,
    # llama.cpp's Gemma 4 tokenizer is its own "gemma4" model; the synthetic one is byte-level BPE ("gpt2"),
    # which llama.cpp accepts with the plain "default" pre-tokenizer.
    tokenizer_pre="default", tokens=_GEMMA4_TOKENS,
)  # fmt: skip

# openai/gpt-oss-20b config.json: hidden_size 2880, 24 layers (sliding/full alternating, window 128),
# 64 heads / 8 kv heads of 64, attention_bias, 32 experts (num_local_experts) top-4 of intermediate_size 2880,
# vocab 201088, rope_theta 150000 with yarn factor 32 from 4096, rms_norm_eps 1e-5, 131072 context.
GPT_OSS_20B = GptOssPreset(
    name="gpt-oss-20b", arch="gpt-oss", source="openai/gpt-oss-20b config.json",
    n_vocab=201088, hidden=2880, n_layers=24, n_heads=64, n_kv_heads=8, head_dim=64,
    n_experts=32, n_experts_used=4, expert_ffn=2880,
    context_length=131072, rms_eps=1e-5, rope_base=150000.0, tokenizer_pre="gpt-4o", tokens=_GPT_OSS_TOKENS,
    expert_qtype="MXFP4",
)  # fmt: skip

# openai/gpt-oss-120b config.json: as gpt-oss-20b but 36 layers and 128 experts (top-4).
GPT_OSS_120B = GptOssPreset(
    name="gpt-oss-120b", arch="gpt-oss", source="openai/gpt-oss-120b config.json",
    n_vocab=201088, hidden=2880, n_layers=36, n_heads=64, n_kv_heads=8, head_dim=64,
    n_experts=128, n_experts_used=4, expert_ffn=2880,
    context_length=131072, rms_eps=1e-5, rope_base=150000.0, tokenizer_pre="gpt-4o", tokens=_GPT_OSS_TOKENS,
    expert_qtype="MXFP4",
)  # fmt: skip

PRESETS: dict[str, Preset] = {
    p.name: p for p in (QWEN3_30B_A3B, QWEN36_35B_A3B, QWEN35_122B_A10B, GEMMA4_26B_A4B, GPT_OSS_20B, GPT_OSS_120B)
}


def get_preset(name: str) -> Preset:
    """The preset called `name`, or an UnknownPresetError that lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise UnknownPresetError(f"unknown preset '{name}' (known: {', '.join(PRESETS)})") from None


