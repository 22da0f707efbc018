"""Which ggml type each tensor gets, as `llama-quantize` would choose it (llama.cpp src/llama-quant.cpp).

Q4_K_M: Q4_K by default; output (and a tied token_embd) Q6_K; attn_v / attn_qkv and ffn_down* Q6_K in the
"use_more_bits" layers (the first and last eighth and every third in between); rows not divisible by 256
fall back to Q5_0 / Q5_1 / Q8_0 (and F16 when not divisible by 32 either). Q8_0: every quantizable tensor
Q8_0. F16: every quantizable tensor F16. Tensors llama-quantize never quantizes (1-D, norms, biases, the
router `ffn_gate_inp`, `ssm_conv1d`) stay F32, as llama.cpp's converter writes them. A preset may pin its
expert tensors to one type whatever the mix (gpt-oss: MXFP4, as its GGUFs ship).
"""

from __future__ import annotations

from collections.abc import Sequence

from gguf import GGMLQuantizationType as Q
from gguf import LlamaFileType
from gguf.constants import GGML_QUANT_SIZES

from tandem.synth.layout import TensorSpec
from tandem.synth.presets import SynthError

MIXES: dict[str, tuple[Q, LlamaFileType]] = {
    "Q4_K_M": (Q.Q4_K, LlamaFileType.MOSTLY_Q4_K_M),
    "Q8_0": (Q.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "F16": (Q.F16, LlamaFileType.MOSTLY_F16),
}

# tensor_type_fallback(): a 256-block type on rows it does not divide goes to this 32-block type
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


def check_mix(mix: str) -> str:
    """The canonical mix name, or a SynthError listing the supported ones."""
    key = mix.upper()
    if key not in MIXES:
        raise SynthError(f"unknown --quant '{mix}' (supported: {', '.join(MIXES)})")
    return key


def is_quantizable(t: TensorSpec) -> bool:
    """tensor_allows_quantization(): 2-D and 3-D `*weight` tensors except norms, the router and conv1d."""
    name = t.name
    return (
        len(t.shape) >= 2
        and name.endswith("weight")
        and "_norm.weight" not in name
        and "ffn_gate_inp.weight" not in name
        and "ssm_conv1d" not in name
    )


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _category(name: str) -> str:
    # tensor_get_category(): substring tests, in llama.cpp's order
    if name == "output.weight":
        return "output"
    if name == "token_embd.weight":
        return "token_embd"
    for key in ("attn_qkv.weight", "attn_v.weight", "attn_k.weight", "attn_q.weight", "attn_output.weight"):
        if key in name:
            return "attn_v" if key == "attn_qkv.weight" else key.split(".")[0]  # attn_qkv is "attention-v-like"
    for key in ("ffn_up", "ffn_gate", "ffn_down"):
        if key in name:
            return key
    return "other"


def _fallback(qtype: Q, row: int) -> Q:
    block = GGML_QUANT_SIZES[qtype][0]
    if row % block == 0:
        return qtype
    qtype = _FALLBACK.get(qtype, qtype)
    return qtype if row % GGML_QUANT_SIZES[qtype][0] == 0 else Q.F16


def choose_types(specs: Sequence[TensorSpec], mix: str, n_layers: int, expert_qtype: str | None = None) -> list[Q]:
    """The ggml type of every tensor in `specs` (file order matters: llama-quantize counts attn_v in order)."""
    default, _ = MIXES[check_mix(mix)]
    names = [t.name for t in specs]
    tied = "output.weight" not in names
    n_attn_v = sum(_category(n) == "attn_v" for n in names)
    i_attn_v = 0
    out: list[Q] = []
    for t in specs:
        if not is_quantizable(t):
            out.append(Q.F32)
            continue
        row = t.shape[-1]
        cat = _category(t.name)
        if expert_qtype is not None and len(t.shape) == 3 and "_exps." in t.name:
            out.append(Q[expert_qtype])
            continue
        if default == Q.F16:
            out.append(Q.F16)
            continue
        qtype = default
        if cat == "output" or (tied and cat == "token_embd"):
            # the 32-block Q8_0 stays; a 256-block type gets Q6_K, or Q8_0 when the row does not fit it
            if row % GGML_QUANT_SIZES[default][0] != 0:
                qtype = Q.Q8_0
            elif default != Q.Q8_0:
                qtype = Q.Q6_K
        elif default == Q.Q4_K and cat == "attn_v":
            if _use_more_bits(i_attn_v, n_attn_v):
                qtype = Q.Q6_K
        elif default == Q.Q4_K and cat == "ffn_down":
            layer = t.layer  # with experts llama.cpp takes the layer from the name, out of n_layer_all
            if layer is not None and _use_more_bits(layer, n_layers):
                qtype = Q.Q6_K
        if cat == "attn_v":
            i_attn_v += 1
        out.append(_fallback(qtype, row))
    return out


def tensor_nbytes(t: TensorSpec, qtype: Q) -> int:
    """Bytes of `t` stored as `qtype`."""
    block, size = GGML_QUANT_SIZES[qtype]
    if t.shape[-1] % block:
        raise SynthError(f"internal error: '{t.name}' row {t.shape[-1]} does not fit {qtype.name} blocks")
    return t.n_elements // block * size
