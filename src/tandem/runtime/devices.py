"""Which plans this build can execute, checked before any weight is read or moved."""

from __future__ import annotations

import os

import torch

from tandem.errors import PlacementError, TandemError
from tandem.gguf import GGUFFile
from tandem.models.config import ModelConfig
from tandem.placement import PlacementPlan, check_one_gpu, cpu_experts_by_layer, streamable

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def default_device() -> str:
    """`cuda` when a GPU is visible, else `cpu`."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(device: str | None, n_gpu_layers: int | None = None) -> str:
    """--device as given; without it, the CPU for -ngl 0, else `default_device()`."""
    if device is not None:
        return device
    return "cpu" if n_gpu_layers == 0 else default_device()


# torch's caching allocator maps its blocks into segments that grow and shrink page by page: without them, the
# prefill's and the decode steps' blocks of other sizes stay cached in fixed segments beside the ones in use.
ALLOCATOR_SETTINGS = "expandable_segments:True"
ALLOCATOR_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def prefer_expandable_segments() -> None:
    """Give torch's CUDA allocator ALLOCATOR_SETTINGS, unless the user set its settings or this process has
    initialised CUDA already (its allocator then has the settings it read)."""
    if any(os.environ.get(name) for name in ALLOCATOR_ENV) or torch.cuda.is_initialized():
        return
    os.environ[ALLOCATOR_ENV[0]] = ALLOCATOR_SETTINGS


def check_executable(plan: PlacementPlan) -> None:
    """Raise a one-line PlacementError, naming the flag, for any part of the plan no path can run."""
    check_one_gpu(plan)
    req = plan.request
    if req.device == "cpu":
        return
    if not torch.cuda.is_available():
        raise PlacementError(f"--device {req.device}: no CUDA device is visible; use --device cpu")
    count = torch.cuda.device_count()
    if int(req.device.split(":")[1]) >= count:
        raise PlacementError(f"--device {req.device}: only {count} CUDA device(s) visible (cuda:0..cuda:{count - 1})")
    try:
        import triton  # noqa: F401
    except ImportError:
        raise PlacementError(f"--device {req.device}: the GPU kernels need triton; pip install triton") from None


def check_pcie_experts(plan: PlacementPlan, f: GGUFFile, cfg: ModelConfig, k: int) -> None:
    """Raise a one-line TandemError, naming the flag, unless --pcie-experts K can run with this plan: a GPU
    computes, some experts are in host RAM, their types have GPU kernels and K leaves the CPU some of each
    token's selected experts."""
    if k == 0:
        return
    if k < 0:
        raise TandemError(f"--pcie-experts {k}: must be 0 (off) or more")
    if plan.compute_device == "cpu":
        raise TandemError(f"--pcie-experts {k}: the GPU reads the experts, and --device is cpu; drop the flag")
    layers = cpu_experts_by_layer(f, plan.devices)
    if not layers:
        raise TandemError(
            f"--pcie-experts {k}: no routed experts are in host RAM; add --cpu-moe, --n-cpu-moe N or -ot"
        )
    n_active = cfg.moe.n_active if cfg.moe else 0
    if k >= n_active:
        raise TandemError(
            f"--pcie-experts {k}: this model selects {n_active} experts per token; leave the CPU some "
            f"(at most {n_active - 1})"
        )
    for layer, infos in sorted(layers.items()):
        if not streamable(infos):
            kinds = sorted({i.qtype.name for i in infos})
            raise TandemError(
                f"--pcie-experts {k}: layer {layer}'s experts ({', '.join(kinds)}) have no GPU kernel; "
                "run without --pcie-experts"
            )
