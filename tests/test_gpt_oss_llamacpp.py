"""gpt-oss against llama.cpp where transformers is no reference: YaRN rope (the two read gpt-oss's YaRN
differently, see docs/yarn.md) and MXFP4 experts (llama.cpp runs the same ggml kernels; transformers needs
extra packages to load them). The reference logits come from scripts/record_gpt_oss_fixtures.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from llamacpp_logits import assert_logits_match_llama_cpp

from tandem.gguf import open_gguf
from tandem.layers.rope import Rope, RopeSpec, YarnSpec, yarn_corr_dims
from tandem.models import read_config

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("cpu_graph", ["1", "0"], ids=["step-graphs", "layer-path"])
@pytest.mark.parametrize("variant", ["yarn", "mxfp4"])
def test_logits_match_llama_cpp(
    variant: str, cpu_graph: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the CPU step graphs (the default) and the layer path."""
    monkeypatch.setenv("TANDEM_CPU_GRAPH", cpu_graph)
    _, gguf_path = request.getfixturevalue(f"tiny_gpt_oss_{variant}_gguf")
    fx = json.loads((FIXTURES / f"gpt_oss_{variant}_llamacpp.json").read_text(encoding="utf-8"))
    assert_logits_match_llama_cpp(gguf_path, fx["prompts"], fx["meta"]["gguf_sha256"], label=f"{variant} gpt-oss",
                                  script="scripts/record_gpt_oss_fixtures.py")  # fmt: skip


def test_mxfp4_experts_are_repacked_losslessly(tiny_gpt_oss_mxfp4_gguf: tuple[Path, Path]) -> None:
    """The GGUF's MXFP4 experts dequantize to exactly what transformers makes of the released blocks/scales."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from tandem.quant.dequant import dequantize

    hf_dir, gguf_path = tiny_gpt_oss_mxfp4_gguf
    st = load_file(hf_dir / "model.safetensors")
    tensors = open_gguf(gguf_path).tensors

    def ours(name: str) -> torch.Tensor:
        t = tensors[name]
        assert t.qtype.name == "MXFP4"
        return dequantize(torch.from_numpy(t.data.copy()), t.qtype, t.shape)

    for bid in (0, 1):
        stem = f"model.layers.{bid}.mlp.experts."
        gate_up = convert_moe_packed_tensors(st[stem + "gate_up_proj_blocks"], st[stem + "gate_up_proj_scales"],
                                             dtype=torch.float32)  # [E, D, 2F], gate/up interleaved  # fmt: skip
        down = convert_moe_packed_tensors(st[stem + "down_proj_blocks"], st[stem + "down_proj_scales"],
                                          dtype=torch.float32)  # [E, F, D]  # fmt: skip
        assert torch.equal(ours(f"blk.{bid}.ffn_gate_exps.weight"), gate_up[..., 0::2].transpose(1, 2))
        assert torch.equal(ours(f"blk.{bid}.ffn_up_exps.weight"), gate_up[..., 1::2].transpose(1, 2))
        assert torch.equal(ours(f"blk.{bid}.ffn_down_exps.weight"), down.transpose(1, 2))


def test_yarn_config_follows_llama_cpp(tiny_gpt_oss_yarn_gguf: tuple[Path, Path]) -> None:
    """factor 32 over 4096: ramp over pairs [2, 5] of the 8 (floor/ceil, as ggml), magnitude 1 + 0.1 ln 32."""
    _, gguf_path = tiny_gpt_oss_yarn_gguf
    cfg = read_config(open_gguf(gguf_path))
    rope = cfg.layers[0].rope
    assert rope == cfg.layers[1].rope
    assert rope.scale == pytest.approx(1 / 32)
    assert rope.yarn is not None and rope.yarn.n_ctx_orig == 4096 and rope.yarn.ext_factor == 1.0
    assert yarn_corr_dims(16, 4096, 150_000.0, 32.0, 1.0) == (2.0, 5.0)
    rot = Rope(rope)
    assert rot.mscale == pytest.approx(1 + 0.1 * np.log(32), rel=1e-6)


def test_yarn_without_extrapolation_is_linear_scaling() -> None:
    """ext_factor 0 leaves ggml's plain linear interpolation (and attn_factor as the only magnitude)."""
    linear = Rope(RopeSpec(base=10_000.0, dim=16, scale=0.25))
    yarn = Rope(RopeSpec(base=10_000.0, dim=16, scale=0.25, yarn=YarnSpec(n_ctx_orig=64, ext_factor=0.0)))
    x = torch.randn(5, 2, 16, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(5)
    torch.testing.assert_close(yarn.apply(x, pos), linear.apply(x, pos), atol=1e-6, rtol=0)
