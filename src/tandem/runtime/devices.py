"""Which plans this build can execute, checked before any weight is read or moved."""

from __future__ import annotations

import torch

from tandem.errors import PlacementError
from tandem.placement import PlacementPlan

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def default_device() -> str:
    """`cuda` when a GPU is visible, else `cpu`."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(device: str | None, n_gpu_layers: int | None = None) -> str:
    """--device as given; without it, the CPU for -ngl 0, else `default_device()`."""
    if device is not None:
        return device
    return "cpu" if n_gpu_layers == 0 else default_device()


def check_executable(plan: PlacementPlan) -> None:
    """Raise a one-line PlacementError, naming the flag, for any part of the plan no path can run."""
    req = plan.request
    if req.tp > 1:
        raise PlacementError(f"--tp {req.tp}: tensor-parallel execution is not built yet; use --tp 1")
    gpus = sorted({d for d in plan.devices.values() if d != "cpu"} | ({req.device} - {"cpu"}))
    if not gpus:
        return
    if req.device == "cpu":
        raise PlacementError(
            f"-ot/--override-tensor {gpus[0]}: with --device cpu every tensor must stay on the CPU; "
            f"use --device cuda to compute on the GPU"
        )
    if not torch.cuda.is_available():
        raise PlacementError(f"--device {req.device}: no CUDA device is visible; use --device cpu")
    count = torch.cuda.device_count()
    for d in gpus:
        if int(d.split(":")[1]) >= count:
            raise PlacementError(f"--device/-ot {d}: only {count} CUDA device(s) visible (cuda:0..cuda:{count - 1})")
    if len(gpus) > 1 or gpus[0] != req.device:
        raise PlacementError(
            f"-ot/--override-tensor {', '.join(gpus)}: tensors on a GPU other than --device {req.device} need "
            f"tensor parallelism (--tp), which is not built yet"
        )
    try:
        import triton  # noqa: F401
    except ImportError:
        raise PlacementError(f"--device {req.device}: the GPU kernels need triton; pip install triton") from None
