"""Shared by the delta-net kernel tests (Triton's interpreter and the GPU): a `GatedDeltaNet` whose projections
return tensors the test sets, so that the fused one-token step (cuda/delta_net.py) and the torch path
(`causal_conv1d`, `l2_normalize`, `recurrent_gated_delta_rule`, `rms_norm` * silu) read the same projection
outputs; and the comparison both kinds of test make."""

from __future__ import annotations

import torch

from tandem.layers.delta_net import (
    DeltaNetPool,
    DeltaNetShape,
    DeltaNetState,
    FusedBetaAlpha,
    GatedDeltaNet,
    SplitBetaAlpha,
)
from tandem.state.batch import SeqSpan, StepBatch

HIDDEN = 8  # the layer input's width: the fixed projections ignore it


class Fixed:
    """A projection whose output is `y` [1, N] whatever its input: the test writes new values in place (a
    captured CUDA graph reads the same tensor at each replay)."""

    def __init__(self, y: torch.Tensor) -> None:
        self.y = y

    @property
    def out_features(self) -> int:
        return self.y.shape[-1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.y


class Identity:
    """The out projection: returns the gated-normed o [1, Hv*Dv] itself."""

    def __init__(self, n: int) -> None:
        self.out_features = n

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x


def make_layer(
    shape: DeltaNetShape, dtype: torch.dtype, device: str, seed: int, fused_beta_alpha: bool = False
) -> GatedDeltaNet:
    """Random weights of the scales a checkpoint has (decays exp(g) mostly in 0.5..1), zero projections.
    fused_beta_alpha: Qwen3-Next's one `ssm_ba` projection, whose beta and alpha are strided views (or copies)."""
    g = torch.Generator().manual_seed(seed)
    c, hv = shape.conv_channels, shape.n_v_heads

    def zeros(n: int) -> Fixed:
        return Fixed(torch.zeros(1, n, dtype=dtype, device=device))

    if fused_beta_alpha:
        beta_alpha: SplitBetaAlpha | FusedBetaAlpha = FusedBetaAlpha(proj=zeros(2 * hv), n_k_heads=shape.n_k_heads)
    else:
        beta_alpha = SplitBetaAlpha(beta=zeros(hv), alpha=zeros(hv))
    return GatedDeltaNet(
        shape=shape,
        qkv=zeros(c),
        gate=zeros(shape.value_dim),
        beta_alpha=beta_alpha,
        conv_weight=(torch.randn(c, shape.conv_kernel, generator=g) * 0.5).to(device),
        dt_bias=(torch.randn(hv, generator=g) - 2.0).to(device),
        a=-torch.exp(torch.randn(hv, generator=g) * 0.5).to(device),
        norm=(1.0 + 0.2 * torch.randn(shape.head_v_dim, generator=g)).to(device),
        out=Identity(shape.value_dim),
        eps=1e-6,
    )


def _projections(layer: GatedDeltaNet) -> list[Fixed]:
    ba = layer.beta_alpha
    projections = [layer.qkv, layer.gate, *((ba.beta, ba.alpha) if isinstance(ba, SplitBetaAlpha) else (ba.proj,))]
    assert all(isinstance(p, Fixed) for p in projections)
    return projections  # type: ignore[return-value]


def set_inputs(layer: GatedDeltaNet, g: torch.Generator) -> None:
    """New projection outputs, written in place (rounded to their dtype)."""
    for proj in _projections(layer):
        proj.y.copy_(torch.randn(proj.y.shape, generator=g) * 2.0)


def random_state(shape: DeltaNetShape, device: str, seed: int) -> DeltaNetState:
    """A state in the middle of a sequence: earlier conv inputs and a recurrent state of O(1) entries."""
    g = torch.Generator().manual_seed(seed)
    state = DeltaNetPool.allocate(1, shape, "cpu").slot(0)
    state.conv.copy_(torch.randn(state.conv.shape, generator=g) * 2.0)
    state.ssm.copy_(torch.randn(state.ssm.shape, generator=g))
    # contiguous [Hv, Dk, Dv], as a GPU pool holds it (the kernels address it so; the CPU's pool keeps ggml's layout)
    return DeltaNetState(state.conv.to(device), state.ssm.to(device).contiguous())


def layer_to(layer: GatedDeltaNet, device: str) -> GatedDeltaNet:
    """The same layer with every tensor copied to `device` (the projections' outputs too)."""
    ba = layer.beta_alpha
    qkv, gate, *rest = (Fixed(p.y.to(device)) for p in _projections(layer))
    if isinstance(ba, SplitBetaAlpha):
        beta_alpha: SplitBetaAlpha | FusedBetaAlpha = SplitBetaAlpha(beta=rest[0], alpha=rest[1])
    else:
        beta_alpha = FusedBetaAlpha(proj=rest[0], n_k_heads=ba.n_k_heads)
    return GatedDeltaNet(
        shape=layer.shape,
        qkv=qkv,
        gate=gate,
        beta_alpha=beta_alpha,
        conv_weight=layer.conv_weight.to(device),
        dt_bias=layer.dt_bias.to(device),
        a=layer.a.to(device),
        norm=layer.norm.to(device),
        out=layer.out,
        eps=layer.eps,
    )


# f32: the fused step and the torch path compute the same f32 operations, differently ordered and rounded
# (sum orders, exp and sqrt implementations); over a few steps that stays within a few 1e-6 relative, since the
# delta rule does not amplify errors (decays <= 1, |k| = 1, beta in (0, 1)). 16-bit outputs: the two f32 values
# before the final rounding differ as much, which can move the rounding by one unit in the last place.
REL_TOL = 1e-5
_BITS = {torch.bfloat16: 8, torch.float16: 11}


def assert_close(y: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Elementwise: |y - ref| <= REL_TOL * |ref| (floored at REL_TOL * max|ref|, for entries near 0 under
    cancellation), plus one unit in the last place of a 16-bit y."""
    bits = _BITS.get(y.dtype)
    y, ref = y.double().cpu(), ref.double().cpu()
    err = (y - ref).abs()
    bound = torch.clamp(REL_TOL * ref.abs(), min=REL_TOL * ref.abs().max().item())
    if bits is not None:
        _, e = torch.frexp(ref)
        bound = bound + torch.ldexp(torch.ones_like(ref), e - bits)
    assert bool((err <= bound).all()), f"{what}: max excess {(err / bound).max().item():.3g}"


def step(layer: GatedDeltaNet, x: torch.Tensor, state: DeltaNetState, pooled: bool = False) -> torch.Tensor:
    """`layer` over x [T, D] continuing one sequence's `state`, as the runner calls it: a one-slot pool around
    the state (views: the step updates `state` itself), then the position count. `pooled`: a decode step the
    way a GPU runs it (every row by slot, the fused kernels), else the sequence's own path."""
    t = x.shape[0]
    pool = DeltaNetPool(state.conv.unsqueeze(0), state.ssm.unsqueeze(0), [state])
    batch = StepBatch(
        ids=torch.zeros(t, dtype=torch.long),
        positions=torch.arange(state.length, state.length + t, device=x.device),
        spans=(SeqSpan(0, state.length, t, 0),),
        decode=t == 1,
        slots=torch.zeros(1, dtype=torch.long, device=x.device) if pooled else None,
    )
    out = layer(x, batch, pool)
    state.length += x.shape[0]
    return out
