"""Tiny random-weight Hugging Face checkpoints (Qwen3, Qwen3-MoE, Gemma 3, Qwen3.5-MoE, Qwen3-Next, ...)
with real tokenizers.

Each `make_tiny_*` writes config.json, model.safetensors (float32) and tokenizer files into a directory
and returns it. Weights come from the `transformers` model classes under a fixed seed, so a given seed
always gives the same files; the tokenizers are trained on the built-in text below (no downloads).

* Qwen: byte-level BPE `tokenizer.json` (Qwen2 pre-tokenizer regex) with <|endoftext|>, <|im_start|>,
  <|im_end|> as the last three ids, plus tokenizer_config.json with a ChatML chat template.
* Gemma: SentencePiece BPE `tokenizer.model` (byte fallback) with <pad>, <eos>, <bos>, <unk> at ids 0..3
  and <start_of_turn>, <end_of_turn> as user-defined symbols (ids 4, 5), plus tokenizer_config.json with
  a Gemma chat template. Gemma 4 has its own turn markers instead (<|turn>, <turn|>, <|think|>, <|channel>,
  <channel|> at ids 4..8) and a reduced Gemma 4 chat template.
* Gemma 3 layers: 6 layers with a sliding window of 16 and the stock pattern of 6 (five sliding layers,
  then one global layer: layer 5). That is what llama.cpp assumes for gemma3 when the GGUF has no
  `gemma3.attention.sliding_window_pattern` key, so the file reads the same in any llama.cpp version.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

VOCAB_SIZE = 512

CORPUS = """\
The harbour was quiet in the early morning, and the fishing boats rocked gently against the wooden pier.
An old man sat on a coil of rope, mending a net with quick and patient fingers. Gulls circled overhead,
calling to one another, and the smell of salt and tar hung in the cool air. Far out on the water a single
sail caught the first light of the sun and turned from grey to gold.

In the city the markets opened at seven o'clock. Traders unloaded crates of apples, pears, cabbages and
onions, stacking them into bright pyramids. A baker carried trays of warm bread through the crowd, and
children ran between the stalls, laughing. Prices were shouted, argued over and agreed: 3 apples for 2
coins, 12 eggs for 5, a basket of cherries for 10. By noon most of the stalls were empty again.

Scientists measure the world with numbers. The speed of light is close to 299792458 metres per second,
water boils at 100 degrees at sea level, and the Earth turns once every 24 hours. Careful measurement,
repeated many times, lets us test an idea against reality; if the numbers disagree, the idea must change.
This simple rule has carried knowledge further than any single genius could.

Learning a language takes time. At first every sentence is a puzzle: which word is the verb, where does
the subject hide, why does this ending change? Then, slowly, patterns appear. Reading stories helps,
speaking with friends helps more, and making mistakes without fear helps most of all. One day you notice
that you understood a joke, and you realise that the language has become your own.

The mountain path climbed through pine forest, crossed a cold stream on flat stones and came out onto an
open ridge. From there the valley spread below like a map: green fields, a winding river, the roofs of a
small village and the thin white line of a road. Clouds moved slowly across the peaks, and their shadows
drifted over the meadows like grazing animals.

Computers follow instructions exactly. A program is a list of steps: read a value, compare it, add one,
repeat until done. Bugs appear when the steps say something other than what we meant. Good programmers
test their code, write clear names for things, and keep each function small enough to understand at a
glance. They also know when to stop adding features and start removing them.

Questions and answers: What time is it? It is half past four. Where are you going? To the library, then
home. How many books can I borrow? Up to six at once, for three weeks. Is the museum open on Monday? No,
it is closed on Mondays, but it opens late on Thursday evenings. Thank you! You're welcome.
"""

# Qwen2 / Qwen3 pre-tokenizer split (llama.cpp's "qwen2" pre-tokenizer implements the same regex)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")
GEMMA_USER_SYMBOLS = ("<start_of_turn>", "<end_of_turn>")
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') "
    "+ message['content'] | trim + '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

GEMMA4_USER_SYMBOLS = ("<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>")
# A reduced Gemma 4 format (no tools, media or reasoning history): a leading system/developer message and the
# thinking switch <|think|> open a system turn; without thinking, the generation prompt closes an empty
# thought channel so that the model answers at once.
GEMMA4_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set thinking = enable_thinking is defined and enable_thinking -%}"
    "{%- set has_system = messages and messages[0]['role'] in ['system', 'developer'] -%}"
    "{%- if thinking or has_system -%}"
    "{{- '<|turn>system\\n' + ('<|think|>' if thinking else '') "
    "+ (messages[0]['content'] | trim if has_system else '') + '<turn|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in (messages[1:] if has_system else messages) -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<|turn>' + role + '\\n' + message['content'] | trim + '<turn|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|turn>model\\n' -}}"
    "{%- if not thinking -%}{{- '<|channel>thought\\n<channel|>' -}}{%- endif -%}{%- endif -%}"
)


def _lines() -> list[str]:
    return [line for line in CORPUS.splitlines() if line.strip()]


def _added_token(content: str) -> dict[str, Any]:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------------------
# tokenizers
# ---------------------------------------------------------------------------------------------------------


def write_qwen_tokenizer(out_dir: Path, vocab_size: int = VOCAB_SIZE) -> dict[str, int]:
    """Byte-level BPE with exactly `vocab_size` ids (the specials last); returns the special ids."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    n_bpe = vocab_size - len(QWEN_SPECIALS)
    trainer = trainers.BpeTrainer(vocab_size=n_bpe, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_lines(), trainer)
    if tok.get_vocab_size() != n_bpe:
        raise RuntimeError(f"BPE training reached {tok.get_vocab_size()} tokens, wanted {n_bpe}")
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in QWEN_SPECIALS])
    tok.save(str(out_dir / "tokenizer.json"))
    ids = {s: n_bpe + i for i, s in enumerate(QWEN_SPECIALS)}
    _write_json(out_dir / "tokenizer_config.json", {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(i): _added_token(s) for s, i in ids.items()},
        "bos_token": None,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 512,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    })
    return ids


def write_gemma_tokenizer(
    out_dir: Path,
    vocab_size: int = VOCAB_SIZE,
    user_symbols: tuple[str, ...] = GEMMA_USER_SYMBOLS,
    chat_template: str = GEMMA_TEMPLATE,
) -> dict[str, int]:
    """SentencePiece BPE `tokenizer.model` with Gemma's special ids, then `user_symbols` (ids 4...) as special
    tokens; returns the special ids."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_lines()), model_writer=buf, model_type="bpe", vocab_size=vocab_size,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
        user_defined_symbols=list(user_symbols), byte_fallback=True, character_coverage=1.0,
        normalization_rule_name="identity", add_dummy_prefix=False, remove_extra_whitespaces=False,
        split_digits=True, allow_whitespace_only_pieces=True, num_threads=1, minloglevel=2,
    )
    (out_dir / "tokenizer.model").write_bytes(buf.getvalue())
    ids = {s: i for i, s in enumerate(GEMMA_SPECIALS + user_symbols)}
    _write_json(out_dir / "tokenizer_config.json", {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": {str(i): _added_token(s) for s, i in ids.items()},
        "bos_token": "<bos>",
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<eos>",
        "model_max_length": 512,
        "pad_token": "<pad>",
        "spaces_between_special_tokens": False,
        "tokenizer_class": "GemmaTokenizer",
        "unk_token": "<unk>",
    })
    return ids


# ---------------------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------------------


def _save(model: Any, out_dir: Path, seed: int) -> None:
    """Perturb the norm weights (HF initialises them to constants) so that norm handling is testable."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out_dir)


def _build(config: Any, model_cls: Any, seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    return model_cls(config).to(torch.float32).eval()


def make_tiny_qwen3(out_dir: Path, seed: int = 0) -> Path:
    """Qwen3ForCausalLM: 2 layers, hidden 64, 4 heads / 2 KV heads of 32, tied embeddings, vocab 512."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = write_qwen_tokenizer(out_dir)
    config = Qwen3Config(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True, initializer_range=0.05,
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
    )
    _save(_build(config, Qwen3ForCausalLM, seed), out_dir, seed)
    return out_dir


def make_tiny_qwen3moe(out_dir: Path, seed: int = 0) -> Path:
    """Qwen3MoeForCausalLM: 2 layers, hidden 128, 8 experts (top-2, renormalised) of 32, vocab 512."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = write_qwen_tokenizer(out_dir)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=512, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=False, initializer_range=0.05,
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
    )
    _save(_build(config, Qwen3MoeForCausalLM, seed), out_dir, seed)
    return out_dir


def make_tiny_gemma3(out_dir: Path, seed: int = 0) -> Path:
    """Gemma3ForCausalLM (text): 6 layers (5 sliding of window 16, then 1 global), hidden 64, vocab 512."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = write_gemma_tokenizer(out_dir)
    n_layers = 6
    config = Gemma3TextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=n_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
        sliding_window=16, max_position_embeddings=512, rms_norm_eps=1e-6,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n_layers)],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        final_logit_softcapping=None, attn_logit_softcapping=None, tie_word_embeddings=True,
        initializer_range=0.05,
        pad_token_id=ids["<pad>"], eos_token_id=ids["<eos>"], bos_token_id=ids["<bos>"],
    )
    _save(_build(config, Gemma3ForCausalLM, seed), out_dir, seed)
    return out_dir


# Qwen3.5-style template: ChatML with a <think> block; earlier turns' reasoning is dropped
QWEN35_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- set content = m['content'] if m['content'] is string else '' -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- set reasoning = m.get('reasoning_content') or '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.last_user and reasoning -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}{{- '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}{{- '<think>\\n' -}}{%- endif -%}{%- endif -%}"
)

HYBRID_LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def _hybrid_kwargs(ids: dict[str, int]) -> dict[str, Any]:
    """Shared by the Qwen3.5-MoE and Qwen3-Next tiny configs: 4 layers (delta-net, attention, x2), hidden 64,
    4 heads / 2 KV heads of 32 with rope on a quarter of each head, delta-net 2 key / 4 value heads of 16,
    8 experts (top-2) of 32 plus a shared expert of 48, vocab 512."""
    return dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=4, layer_types=HYBRID_LAYER_TYPES,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.05,
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
    )


def _moderate_decay(model: Any, seed: int) -> None:
    """Per-token decays exp(g) of about 0.6..0.99 (the init draws A up to 16, which forgets within a token
    or two): the recurrent state then carries information across 64-token chunks, which the tests need."""
    import torch

    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.A_log"):
                # the logarithm in Python, not torch's (MKL's vectorised log rounds by CPU: the file and the
                # recorded fixtures' hashes would change from machine to machine)
                a = torch.empty(p.shape).uniform_(0.02, 0.5, generator=gen)
                p.copy_(torch.tensor([math.log(v) for v in a.flatten().tolist()]).reshape(p.shape))
            elif name.endswith("linear_attn.dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))


def make_tiny_qwen35moe(out_dir: Path, seed: int = 0) -> Path:
    """Qwen3_5MoeForCausalLM (text): see `_hybrid_kwargs`; interleaved-MRoPE sections [2, 1, 1] (all equal
    positions for text), a Qwen3.5-style thinking chat template."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = write_qwen_tokenizer(out_dir)
    tok_cfg = json.loads((out_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    _write_json(out_dir / "tokenizer_config.json", {**tok_cfg, "chat_template": QWEN35_TEMPLATE})
    config = Qwen3_5MoeTextConfig(
        **_hybrid_kwargs(ids),
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    )
    model = _build(config, Qwen3_5MoeForCausalLM, seed)
    _moderate_decay(model, seed)
    _save(model, out_dir, seed)
    return out_dir


def make_tiny_qwen3next(out_dir: Path, seed: int = 0) -> Path:
    """Qwen3NextForCausalLM: see `_hybrid_kwargs` (fused in_proj_qkvz / in_proj_ba), ChatML template."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = write_qwen_tokenizer(out_dir)
    config = Qwen3NextConfig(
        **_hybrid_kwargs(ids), intermediate_size=96, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25},
    )
    model = _build(config, Qwen3NextForCausalLM, seed)
    _moderate_decay(model, seed)
    _save(model, out_dir, seed)
    return out_dir


# ---------------------------------------------------------------------------------------------------------
# gpt-oss and Gemma 4 (MoE)
# ---------------------------------------------------------------------------------------------------------

# o200k (GPT-4o) pre-tokenizer split, which gpt-oss's o200k_harmony uses (llama.cpp's "gpt-4o")
O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
HARMONY_SPECIALS = ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>",
                    "<|start|>", "<|end|>", "<|message|>", "<|call|>")  # fmt: skip
# A reduced harmony format: the real template adds a system preamble, channels and tool calls.
HARMONY_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}"
)


def write_harmony_tokenizer(out_dir: Path, vocab_size: int = VOCAB_SIZE) -> dict[str, int]:
    """Byte-level BPE with the o200k split and gpt-oss's harmony specials (last ids); returns their ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    n_bpe = vocab_size - len(HARMONY_SPECIALS)
    trainer = trainers.BpeTrainer(vocab_size=n_bpe, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_lines(), trainer)
    if tok.get_vocab_size() != n_bpe:
        raise RuntimeError(f"BPE training reached {tok.get_vocab_size()} tokens, wanted {n_bpe}")
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in HARMONY_SPECIALS])
    tok.save(str(out_dir / "tokenizer.json"))
    ids = {s: n_bpe + i for i, s in enumerate(HARMONY_SPECIALS)}
    _write_json(out_dir / "tokenizer_config.json", {
        "added_tokens_decoder": {str(i): _added_token(s) for s, i in ids.items()},
        "bos_token": "<|startoftext|>",
        "chat_template": HARMONY_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|return|>",
        "model_max_length": 512,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    })
    return ids


GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 150_000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}  # fmt: skip


def openai_mxfp4(w: Any) -> tuple[Any, Any]:
    """A float32 array [..., K] as gpt-oss's released MXFP4: (blocks [..., K/32, 16] uint8 with element 2i
    in the low nibble, scales [..., K/32] uint8 e8m0), quantized by gguf-py's (= ggml's) MXFP4 rounding."""
    import gguf
    import numpy as np

    lead, k = w.shape[:-1], w.shape[-1]
    q = gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32).reshape(-1, k), gguf.GGMLQuantizationType.MXFP4)
    q = q.reshape(*lead, k // 32, 17)
    scales, qs = q[..., 0], q[..., 1:]
    elems = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # ggml: element j low, j + 16 high
    blocks = (elems[..., 0::2] | (elems[..., 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(blocks), np.ascontiguousarray(scales)


def _mxfp4_experts(out_dir: Path) -> None:
    """Rewrite model.safetensors with the experts as MXFP4 blocks/scales ([out, in] rows), as released."""
    from safetensors.numpy import load_file, save_file

    path = out_dir / "model.safetensors"
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors.pop(name).transpose(0, 2, 1)  # transformers' [E, in, out] -> [E, out, in]
        tensors[name + "_blocks"], tensors[name + "_scales"] = openai_mxfp4(w)
    save_file(tensors, path, metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text(encoding="utf-8"))
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    _write_json(out_dir / "config.json", config)


def make_tiny_gpt_oss(out_dir: Path, seed: int = 0, yarn: bool = False, mxfp4: bool = False) -> Path:
    """GptOssForCausalLM: 2 layers (sliding window 8, then full), hidden 64, 4 heads / 2 KV heads of 16,
    4 experts (top-2) of 32, vocab 512; plain rope, or gpt-oss's YaRN (factor 32 over 4096) with `yarn`;
    with `mxfp4`, the experts stored as MXFP4 blocks and scales like the released checkpoints.

    The init leaves the biases at zero and the expert activations far below the SwiGLU clamp (7): every
    bias, sink and router bias is redrawn, and the gate/up weights are scaled so that some activations
    exceed the clamp on both sides."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = write_harmony_tokenizer(out_dir)
    config = GptOssConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=131072 if yarn else 512,  # YaRN: gpt-oss's 32 x 4096
        rms_norm_eps=1e-5, rope_parameters=GPT_OSS_YARN if yarn else {"rope_type": "default", "rope_theta": 150_000.0},
        tie_word_embeddings=False, initializer_range=0.05,
        bos_token_id=ids["<|startoftext|>"], eos_token_id=ids["<|return|>"], pad_token_id=ids["<|endoftext|>"],
    )
    model = _build(config, GptOssForCausalLM, seed)
    gen = torch.Generator().manual_seed(seed + 3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("experts.gate_up_proj"):
                p.copy_(0.6 * torch.randn(p.shape, generator=gen))
    _save(model, out_dir, seed)
    if mxfp4:
        _mxfp4_experts(out_dir)
    return out_dir


def make_tiny_gemma4(out_dir: Path, seed: int = 0) -> Path:
    """Gemma4ForCausalLM with the 26B-A4B's features, tiny: 4 layers (sliding window 16 / global, twice),
    hidden 64, 4 query heads; sliding layers 2 KV heads of 16, global layers 1 KV head of 32 with K = V and
    proportional rope on a quarter of it; a dense GEGLU MLP of 64 beside 4 experts (top-2) of 32 in every
    layer; final softcap 30; vocab 512 (the SentencePiece tokenizer of the Gemma 3 one, with Gemma 4's turn and
    channel markers and a reduced Gemma 4 chat template).

    The router scales, per-expert scales and layer scalars start at one: they are redrawn."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = write_gemma_tokenizer(out_dir, user_symbols=GEMMA4_USER_SYMBOLS, chat_template=GEMMA4_TEMPLATE)
    config = Gemma4TextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=16,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=True,
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
        hidden_size_per_layer_input=0, num_kv_shared_layers=0, final_logit_softcapping=30.0,
        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.05,
        pad_token_id=ids["<pad>"], eos_token_id=ids["<eos>"], bos_token_id=ids["<bos>"],
    )
    model = _build(config, Gemma4ForCausalLM, seed)
    gen = torch.Generator().manual_seed(seed + 3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("router.scale", "router.per_expert_scale")):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
        for layer in model.model.layers:
            layer.layer_scalar.copy_(0.5 + torch.rand(1, generator=gen))
    _save(model, out_dir, seed)
    return out_dir
