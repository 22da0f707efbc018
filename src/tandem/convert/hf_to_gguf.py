"""Convert a Hugging Face checkpoint (config.json + *.safetensors + tokenizer) to a GGUF file.

Supported: Qwen3ForCausalLM -> `qwen3`, Qwen3MoeForCausalLM -> `qwen3moe`, Gemma3ForCausalLM -> `gemma3`,
Qwen3_5MoeForCausalLM -> `qwen35moe` and Qwen3NextForCausalLM -> `qwen3next` (their specifics: qwen35moe.py),
GptOssForCausalLM -> `gpt-oss` (gpt_oss.py), Gemma4ForCausalLM / Gemma4ForConditionalGeneration -> `gemma4`
(gemma4.py; those two plug in through arch_hooks.py).
The output follows llama.cpp's `convert_hf_to_gguf.py`: the same tensor names (from `gguf`'s name maps),
the same metadata keys, experts stacked into `blk.N.ffn_{gate,up,down}_exps.weight` of shape
[n_expert, rows, cols], Gemma's RMSNorm weights stored as (1 + w), 1-D tensors, norms and the MoE router
in F32, and Q8_0 falling back to F16 for rows that are not whole 32-element blocks.

Tensors are written in two passes (shapes and types from the safetensors headers first, then the data one
tensor at a time), so peak memory is about one tensor, or one layer's experts, not the whole model.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tandem.convert import gemma4, gpt_oss
from tandem.convert import qwen35moe as hybrid
from tandem.convert.arch_hooks import ArchHooks, PlanContext
from tandem.convert.vocab import Vocab, load_bpe_vocab, load_spm_vocab, read_json_object, write_vocab
from tandem.errors import ConversionError, os_reason

Q = gguf.GGMLQuantizationType

OUTTYPES: dict[str, tuple[gguf.LlamaFileType, Q]] = {
    "f32": (gguf.LlamaFileType.ALL_F32, Q.F32),
    "f16": (gguf.LlamaFileType.MOSTLY_F16, Q.F16),
    "q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, Q.Q8_0),
}


@dataclass(frozen=True)
class _ArchSpec:
    arch: gguf.MODEL_ARCH
    vocab_kind: str  # "bpe" (tokenizer.json) or "spm" (tokenizer.model)
    norm_shift: float  # added to every HF `*norm.weight` (Gemma's RMSNorm computes x * (1 + w))
    activation: tuple[str, str]  # (config key, required value)
    hooks: ArchHooks | None = None  # families with their own tensor layout / metadata (convert/arch_hooks.py)


ARCHITECTURES: dict[str, _ArchSpec] = {
    "Qwen3ForCausalLM": _ArchSpec(gguf.MODEL_ARCH.QWEN3, "bpe", 0.0, ("hidden_act", "silu")),
    "Qwen3MoeForCausalLM": _ArchSpec(gguf.MODEL_ARCH.QWEN3MOE, "bpe", 0.0, ("hidden_act", "silu")),
    "Gemma3ForCausalLM": _ArchSpec(
        gguf.MODEL_ARCH.GEMMA3, "spm", 1.0, ("hidden_activation", "gelu_pytorch_tanh")
    ),
    # Qwen's zero-centred RMSNorm computes x * (1 + w) (all but the delta-net's gated norm: convert/qwen35moe.py)
    "Qwen3_5MoeForCausalLM": _ArchSpec(gguf.MODEL_ARCH.QWEN35MOE, "bpe", 1.0, ("hidden_act", "silu")),
    "Qwen3NextForCausalLM": _ArchSpec(gguf.MODEL_ARCH.QWEN3NEXT, "bpe", 1.0, ("hidden_act", "silu")),
    "GptOssForCausalLM": _ArchSpec(gguf.MODEL_ARCH.GPT_OSS, "bpe", 0.0, ("hidden_act", "silu"), gpt_oss.HOOKS),
    **dict.fromkeys(("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"), _ArchSpec(
        gguf.MODEL_ARCH.GEMMA4, "gemma4", 0.0, ("hidden_activation", "gelu_pytorch_tanh"), gemma4.HOOKS)),
}

# ---------------------------------------------------------------------------------------------------------
# safetensors (read directly: 8-byte header length, JSON header, raw little-endian data)
# ---------------------------------------------------------------------------------------------------------

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
              "U8": np.uint8}  # U8: packed quantized data (gpt-oss's MXFP4 experts), read with _Loader.raw


@dataclass(frozen=True)
class _STensor:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


def _read_safetensors_header(path: Path) -> dict[str, _STensor]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or 8 + n > size:
                raise ValueError("bad header length")
            header = json.loads(f.read(n))
        entries = {
            name: _STensor(path, str(info["dtype"]), tuple(int(d) for d in info["shape"]),
                           *(8 + n + int(x) for x in info["data_offsets"]))
            for name, info in header.items()
            if name != "__metadata__"
        }  # fmt: skip
    except (OSError, ValueError, RecursionError, AttributeError, KeyError, TypeError) as e:  # a malformed header too
        raise ConversionError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    out: dict[str, _STensor] = {}
    for name, t in entries.items():
        if t.dtype not in _ST_DTYPES:
            raise ConversionError(f"{path}: tensor '{name}' has unsupported dtype {t.dtype}")
        want = int(np.prod(t.shape, dtype=np.int64)) * np.dtype(_ST_DTYPES[t.dtype]).itemsize
        if t.end > size or t.end - t.start != want:
            raise ConversionError(f"{path}: tensor '{name}' data is out of bounds or mis-sized (truncated?)")
        out[name] = t
    return out


def _index_safetensors(hf_dir: Path) -> dict[str, _STensor]:
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted({hf_dir / f for f in weight_map.values()})
        except (OSError, ValueError, RecursionError, AttributeError, KeyError, TypeError) as e:
            raise ConversionError(f"{index}: unreadable shard index ({type(e).__name__}: {e})") from None
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ConversionError(f"{hf_dir}: safetensors shard(s) missing: {', '.join(missing)}")
    else:
        files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ConversionError(f"{hf_dir}: no *.safetensors weights found (only safetensors is supported)")
    tensors: dict[str, _STensor] = {}
    for f in files:
        tensors.update(_read_safetensors_header(f))
    return tensors


class _Loader:
    """Reads safetensors tensors as float32 arrays through one read-only memory map per file."""

    def __init__(self) -> None:
        self._maps: dict[Path, np.memmap] = {}

    def __call__(self, t: _STensor) -> np.ndarray:
        mm = self._maps.get(t.file)
        if mm is None:
            mm = self._maps[t.file] = np.memmap(t.file, dtype=np.uint8, mode="r")
        raw = np.asarray(mm[t.start : t.end]).view(_ST_DTYPES[t.dtype]).reshape(t.shape)
        if t.dtype == "BF16":  # bfloat16 is the top half of a float32
            return (raw.astype(np.uint32) << 16).view(np.float32)
        return raw.astype(np.float32)

    def raw(self, t: _STensor) -> np.ndarray:
        """The stored array as it is (no conversion to float32)."""
        mm = self._maps.get(t.file)
        if mm is None:
            mm = self._maps[t.file] = np.memmap(t.file, dtype=np.uint8, mode="r")
        return np.asarray(mm[t.start : t.end]).view(_ST_DTYPES[t.dtype]).reshape(t.shape)


# ---------------------------------------------------------------------------------------------------------
# tensor plan
# ---------------------------------------------------------------------------------------------------------


@dataclass
class _Planned:
    name: str
    shape: tuple[int, ...]  # PyTorch order (outermost first)
    qtype: Q
    load: Callable[[], np.ndarray]  # float32 data with every transform applied
    raw: bool = False  # `load` gives the finished `qtype` bytes (already quantized): written as they are

    @property
    def nbytes(self) -> int:
        if self.qtype == Q.F32 or self.qtype == Q.F16:
            return int(np.prod(self.shape, dtype=np.int64)) * (4 if self.qtype == Q.F32 else 2)
        return int(np.prod(gguf.quants.quant_shape_to_byte_shape(self.shape, self.qtype), dtype=np.int64))


_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(?:\.weight)?$")
_SKIP_SUFFIXES = ("rotary_emb.inv_freq",)


def _pick_qtype(name: str, shape: tuple[int, ...], want: Q, router_names: set[str]) -> Q:
    """llama.cpp's rules: 1-D, norms, the router and non-weights stay F32; Q8_0 needs whole 32-blocks."""
    if len(shape) <= 1 or name.endswith("_norm.weight") or name in router_names:
        return Q.F32
    if not name.endswith(".weight"):  # biases
        return Q.F32
    if want == Q.Q8_0 and shape[-1] % 32 != 0:
        return Q.F16
    return want


def _plan_tensors(
    spec: _ArchSpec, cfg: dict[str, Any], tensors: dict[str, _STensor], n_vocab: int, want: Q
) -> list[_Planned]:
    n_layer = int(cfg["num_hidden_layers"])
    tmap = gguf.get_tensor_name_map(spec.arch, n_layer)
    arch_name = gguf.MODEL_ARCH_NAMES[spec.arch]
    router_tmpl = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_GATE_INP]
    router_names = {router_tmpl.format(bid=b) + ".weight" for b in range(n_layer)}
    # llama.cpp keeps these F32 too: the shared-expert gate and the delta-net conv kernel
    router_names |= {gguf.TENSOR_NAMES[t].format(bid=b) + ".weight" for b in range(n_layer)
                     for t in (gguf.MODEL_TENSOR.FFN_GATE_INP_SHEXP, gguf.MODEL_TENSOR.SSM_CONV1D)}  # fmt: skip
    embd_names = {gguf.TENSOR_NAMES[t] + ".weight" for t in (gguf.MODEL_TENSOR.TOKEN_EMBD,
                                                             gguf.MODEL_TENSOR.OUTPUT)}
    load = _Loader()
    # A tied lm_head is a copy of the embeddings: leave it out, llama.cpp then reuses token_embd.
    # (transformers' default is tied for Gemma 3, untied for Qwen 3.)
    skip_lm_head = bool(cfg.get("tie_word_embeddings", spec.arch == gguf.MODEL_ARCH.GEMMA3))
    planned: list[_Planned] = []
    experts: dict[tuple[int, str], dict[int, _STensor]] = {}

    def hf_to_gguf_name(hf_name: str) -> str:
        new = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise ConversionError(f"cannot map tensor '{hf_name}' to a {arch_name} GGUF tensor")
        return new

    def add(new: str, shape: tuple[int, ...], fn: Callable[[], np.ndarray], raw_qtype: Q | None = None) -> None:
        if raw_qtype is not None:  # pre-quantized bytes from an arch hook
            planned.append(_Planned(new, shape, raw_qtype, fn, raw=True))
            return
        if new in embd_names:
            if shape[0] < n_vocab:
                raise ConversionError(f"'{new}' has {shape[0]} rows but the tokenizer has {n_vocab} tokens")
            if shape[0] > n_vocab:  # drop out-of-vocabulary rows, as llama.cpp does for Gemma 3
                shape, fn = (n_vocab, *shape[1:]), (lambda f=fn: f()[:n_vocab])
        planned.append(_Planned(new, shape, _pick_qtype(new, shape, want, router_names), fn))

    ctx = PlanContext(cfg=cfg, load=load, name_of=hf_to_gguf_name, add=add, tensors=tensors, load_raw=load.raw)
    for hf_name, t in tensors.items():
        if hf_name.endswith(_SKIP_SUFFIXES) or (hf_name == "lm_head.weight" and skip_lm_head):
            continue
        if spec.hooks is not None and spec.hooks.tensor(hf_name, t, ctx):
            continue
        if m := _EXPERT_RE.match(hf_name):
            experts.setdefault((int(m[1]), m[3]), {})[int(m[2])] = t
            continue
        if m := _FUSED_RE.match(hf_name):
            _plan_fused(int(m[1]), m[2], t, load, hf_to_gguf_name, add)
            continue
        if spec.arch in hybrid.HYBRID_ARCHES and (
            special := hybrid.plan_tensor(spec.arch, cfg, hf_name, t.shape, lambda t=t: load(t))
        ) is not None:
            for new, shape, fn in special:
                add(new, shape, fn)
            continue
        if spec.norm_shift and hf_name.endswith("norm.weight"):
            fn = lambda t=t: load(t) + np.float32(spec.norm_shift)  # noqa: E731
        else:
            fn = lambda t=t: load(t)  # noqa: E731
        add(hf_to_gguf_name(hf_name), t.shape, fn)

    if spec.hooks is not None:
        spec.hooks.extra_tensors(ctx)
    n_expert = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    for (bid, w), by_id in sorted(experts.items()):
        if sorted(by_id) != list(range(n_expert)):
            raise ConversionError(f"layer {bid}: expected {n_expert} '{w}' experts, found {len(by_id)}")
        parts = [by_id[x] for x in range(n_expert)]
        if len({p.shape for p in parts}) != 1:
            raise ConversionError(f"layer {bid}: '{w}' experts have differing shapes")
        new = hf_to_gguf_name(f"model.layers.{bid}.mlp.experts.{w}.weight")
        add(new, (n_expert, *parts[0].shape), lambda parts=parts: np.stack([load(p) for p in parts]))

    def order(p: _Planned) -> tuple[int, int, str]:
        # token_embd, then blocks in numeric order, then output_norm / output: as llama.cpp lays them out
        if p.name.startswith("blk."):
            return (1, int(p.name.split(".")[1]), p.name)
        return (0 if p.name.startswith("token_embd") else 2, 0, p.name)

    return sorted(planned, key=order)


def _plan_fused(
    bid: int,
    kind: str,
    t: _STensor,
    load: _Loader,
    name_of: Callable[[str], str],
    add: Callable[[str, tuple[int, ...], Callable[[], np.ndarray]], None],
) -> None:
    """transformers-5 in-memory layout: gate_up_proj [E, 2F, H] (gate rows first), down_proj [E, H, F]."""
    if len(t.shape) != 3:
        raise ConversionError(f"layer {bid}: fused experts '{kind}' must be 3-D, got {list(t.shape)}")
    if kind == "down_proj":
        add(name_of(f"model.layers.{bid}.mlp.experts.down_proj.weight"), t.shape, lambda: load(t))
        return
    e, two_f, h = t.shape
    if two_f % 2:
        raise ConversionError(f"layer {bid}: gate_up_proj has an odd row count {two_f}")
    f = two_f // 2
    gate, up = (name_of(f"model.layers.{bid}.mlp.experts.{w}.weight") for w in ("gate_proj", "up_proj"))
    add(gate, (e, f, h), lambda: np.ascontiguousarray(load(t)[:, :f, :]))
    add(up, (e, f, h), lambda: np.ascontiguousarray(load(t)[:, f:, :]))


# ---------------------------------------------------------------------------------------------------------
# metadata
# ---------------------------------------------------------------------------------------------------------


def _rope_params(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(global rope parameters, sliding-layer rope parameters) for transformers 4 and 5 config layouts."""
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict):
        if "full_attention" in rp or "sliding_attention" in rp:
            return dict(rp.get("full_attention") or {}), rp.get("sliding_attention")
        return dict(rp), None
    full = dict(cfg.get("rope_scaling") or {})
    if "type" in full and "rope_type" not in full:
        full["rope_type"] = full["type"]
    if cfg.get("rope_theta") is not None:
        full["rope_theta"] = cfg["rope_theta"]
    local = cfg.get("rope_local_base_freq")
    return full, ({"rope_theta": local, "rope_type": "default"} if local is not None else None)


def _write_rope(w: gguf.GGUFWriter, rope: dict[str, Any], default_theta: float | None) -> None:
    theta = rope.get("rope_theta", default_theta)
    if theta is not None:
        w.add_rope_freq_base(float(theta))
    kind = rope.get("rope_type") or "default"
    if kind == "default":
        return
    factor = rope.get("factor")
    if kind == "linear" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(factor))
    elif kind == "yarn" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(factor))
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        if (attn := rope.get("attention_factor", rope.get("attn_factor"))) is not None:
            w.add_rope_scaling_yarn_attn_factor(float(attn))
        for key, add in (("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow),
                         ("extrapolation_factor", w.add_rope_scaling_yarn_ext_factor)):
            if rope.get(key) is not None:
                add(float(rope[key]))
    else:
        raise ConversionError(f"unsupported rope scaling {kind!r} (supported: default, linear, yarn)")


def gemma3_swa_layers(cfg: dict[str, Any]) -> list[bool]:
    """Per layer: True for sliding-window attention, from `layer_types` or the sliding-window pattern."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        period = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        return [bool((i + 1) % period) for i in range(n)]
    if len(types) != n or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ConversionError(f"layer_types must list {n} of 'sliding_attention'/'full_attention'")
    return [t == "sliding_attention" for t in types]


def swa_period(is_swa: list[bool]) -> int | None:
    """Smallest p with is_swa[i] == (i % p < p - 1) for all i (llama.cpp's set_swa_pattern), else None."""
    n = len(is_swa)
    for p in range(1, n + 2):
        if all(s == (i % p < p - 1) for i, s in enumerate(is_swa)):
            return p
    return None


def _write_hparams(
    w: gguf.GGUFWriter, spec: _ArchSpec, cfg: dict[str, Any], ftype: gguf.LlamaFileType
) -> None:
    if spec.hooks is not None:
        spec.hooks.write_hparams(w, cfg, ftype)
        return
    gemma = spec.arch == gguf.MODEL_ARCH.GEMMA3
    arch_name = gguf.MODEL_ARCH_NAMES[spec.arch]
    # defaults where config.json may omit a value: llama.cpp's for Gemma 3, transformers' for Qwen 3
    head_dim = cfg.get("head_dim") or (256 if gemma else cfg["hidden_size"] // cfg["num_attention_heads"])
    head_dim = int(head_dim)
    n_head = int(cfg.get("num_attention_heads", 8))
    w.add_block_count(int(cfg["num_hidden_layers"]))
    if gemma or "max_position_embeddings" in cfg:
        w.add_context_length(int(cfg.get("max_position_embeddings", 131072)))
    w.add_embedding_length(int(cfg["hidden_size"]))
    if "intermediate_size" in cfg:  # Qwen3.5-MoE has none
        w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_head_count(n_head)
    w.add_head_count_kv(int(cfg.get("num_key_value_heads") or (4 if gemma else n_head)))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    full_rope, swa_rope = _rope_params(cfg)
    _write_rope(w, full_rope, 1_000_000.0 if gemma else None)

    if spec.arch == gguf.MODEL_ARCH.QWEN3MOE:
        if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
            raise ConversionError("qwen3moe with dense MLP layers (mlp_only_layers, decoder_sparse_step) "
                                  "is unsupported")
        w.add_expert_count(int(cfg.get("num_experts") or cfg["num_local_experts"]))
        w.add_expert_used_count(int(cfg["num_experts_per_tok"]))
        w.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
        # llama.cpp's qwen3moe graph always renormalizes the top-k weights and ignores this key; it is
        # recorded so that a reader can tell a norm_topk_prob=False checkpoint apart.
        w.add_expert_weights_norm(bool(cfg.get("norm_topk_prob", True)))
    elif spec.arch in hybrid.HYBRID_ARCHES:
        hybrid.write_hparams(w, spec.arch, cfg)
    elif cfg.get("use_sliding_window"):
        raise ConversionError(f"{arch_name} with use_sliding_window=true is unsupported")

    if gemma:
        is_swa = gemma3_swa_layers(cfg)
        if any(is_swa):
            if not cfg.get("sliding_window"):
                raise ConversionError("gemma3: sliding layers present but config.json has no sliding_window")
            w.add_sliding_window(int(cfg["sliding_window"]))
            period = swa_period(is_swa)
            # llama.cpp reads this key as a period (default 6) or as a per-layer bool array
            w.add_sliding_window_pattern(period if period is not None else is_swa)
        if swa_rope is not None:
            if (swa_rope.get("rope_type") or "default") != "default":
                raise ConversionError("gemma3: rope scaling on sliding-window layers is unsupported")
            if swa_rope.get("rope_theta") is not None:
                w.add_rope_freq_base_swa(float(swa_rope["rope_theta"]))
        scalar = cfg.get("query_pre_attn_scalar")
        if scalar is not None and int(scalar) != head_dim:
            w.add_attention_scale(float(scalar) ** -0.5)
        if cfg.get("use_bidirectional_attention"):
            raise ConversionError("gemma3 with use_bidirectional_attention=true is unsupported")
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
    if cfg.get("attn_logit_softcapping"):
        w.add_attn_logit_softcapping(float(cfg["attn_logit_softcapping"]))
    w.add_file_type(ftype)


# ---------------------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------------------


def _load_config(hf_dir: Path) -> tuple[dict[str, Any], _ArchSpec, str]:
    if not hf_dir.is_dir():
        raise ConversionError(f"{hf_dir}: not a directory")
    path = hf_dir / "config.json"
    if not path.is_file():
        raise ConversionError(f"{hf_dir}: config.json is missing")
    cfg = read_json_object(path)
    if isinstance(cfg.get("text_config"), dict):  # multimodal checkpoints: the text model's keys at the top
        cfg = {**cfg, **cfg["text_config"]}
    archs = cfg.get("architectures") or []
    hf_arch = archs[0] if archs else None
    if hf_arch not in ARCHITECTURES:
        raise ConversionError(
            f"unsupported architecture {hf_arch!r} in {path} (supported: {', '.join(ARCHITECTURES)})"
        )
    spec = ARCHITECTURES[hf_arch]
    key, want = spec.activation
    got = cfg.get(key, want)
    if got != want:
        raise ConversionError(f"{hf_arch} with {key}={got!r} is unsupported (expected {want!r})")
    hybrid_arch = spec.arch in hybrid.HYBRID_ARCHES
    for k in ("num_hidden_layers", "hidden_size", "vocab_size") + (() if hybrid_arch else ("intermediate_size",)):
        if not isinstance(cfg.get(k), int):
            raise ConversionError(f"{path}: '{k}' is missing or not an integer")
    if hybrid_arch:
        hybrid.check_config(cfg)
    return cfg, spec, hf_arch


def _load_vocab(spec: _ArchSpec, cfg: dict[str, Any], hf_dir: Path) -> Vocab:
    if spec.hooks is not None and (vocab := spec.hooks.load_vocab(cfg, hf_dir)) is not None:
        return vocab
    if spec.vocab_kind == "bpe":
        # Qwen's pre-tokenizer regex; llama.cpp identifies it by hashing a probe text, we know it by arch
        return load_bpe_vocab(hf_dir, int(cfg["vocab_size"]), pre="qwen2")
    return load_spm_vocab(hf_dir, int(cfg["vocab_size"]))


def convert_hf(hf_dir: Path, out_path: Path, outtype: str = "f16", *, overwrite: bool = False) -> Path:
    """Convert the Hugging Face checkpoint in `hf_dir` to a GGUF file at `out_path` and return that path.

    `outtype` is one of f32, f16, q8_0 (1-D tensors, norms and the MoE router stay F32 whatever it is).
    Raises ConversionError (one-line message) for an unsupported architecture or outtype, missing or bad
    input files, an output that already exists (unless `overwrite`), or an output that is an input file.
    The file is written under a temporary name and renamed into place, so a failed conversion leaves
    nothing behind.
    """
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    key = str(outtype).lower()
    if key not in OUTTYPES:
        raise ConversionError(f"unknown outtype {outtype!r} (expected one of: {', '.join(OUTTYPES)})")
    ftype, want = OUTTYPES[key]
    cfg, spec, _ = _load_config(hf_dir)

    # Never replace an input: only a .gguf may be overwritten inside the checkpoint directory.
    target = out_path.resolve()
    if target == hf_dir.resolve() or (target.parent == hf_dir.resolve() and target.exists()
                                      and target.suffix != ".gguf"):
        raise ConversionError(f"{out_path}: refusing to write over a file of the input checkpoint")
    if out_path.is_dir():
        raise ConversionError(f"{out_path}: is a directory")
    if out_path.exists() and not overwrite:
        raise ConversionError(f"{out_path}: already exists (pass --overwrite, or overwrite=True, to replace it)")

    tensors = _index_safetensors(hf_dir)
    vocab = _load_vocab(spec, cfg, hf_dir)
    planned = _plan_tensors(spec, cfg, tensors, len(vocab.tokens), want)

    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[spec.arch])
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(hf_dir.resolve().name)  # llama.cpp's fallback name: the checkpoint directory
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _write_hparams(writer, spec, cfg, ftype)
        write_vocab(writer, vocab, hf_dir)
        if spec.hooks is not None:
            spec.hooks.after_vocab(writer, vocab)
        if spec.arch == gguf.MODEL_ARCH.GEMMA3:
            writer.add_add_space_prefix(False)
        for p in planned:
            writer.add_tensor_info(p.name, p.shape, np.dtype(np.float32), p.nbytes, raw_dtype=p.qtype)
        total, shared, expert, n_expert = writer.get_total_parameter_count()
        writer.add_size_label(gguf.size_label(total, shared, expert, n_expert))  # e.g. "8x257K", as llama.cpp
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for p in planned:
            data = p.load() if p.raw else gguf.quants.quantize(p.load(), p.qtype)
            if data.nbytes != p.nbytes:  # a bug, not bad input: the plan disagrees with the data
                raise ConversionError(f"internal error: '{p.name}' is {data.nbytes} B, planned {p.nbytes} B")
            writer.write_tensor_data(data)
        writer.close()
        os.replace(tmp, out_path)
    except BaseException as e:
        writer.close()
        with contextlib.suppress(OSError):  # e.g. its folder could not be made: the first error is the one to tell
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):  # disk full, permissions: report it like any other conversion failure
            raise ConversionError(f"{out_path}: cannot write ({os_reason(e)})") from None
        raise
    return out_path
