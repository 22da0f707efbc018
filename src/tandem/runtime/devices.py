"""Which plans this build can execute, checked before any weight is read or moved."""

from __future__ import annotations

from tandem.errors import PlacementError
from tandem.placement import PlacementPlan


def check_executable(plan: PlacementPlan) -> None:
    """Raise a one-line PlacementError, naming the flag, for any part of the plan no path can run."""
    req = plan.request
    if req.tp > 1:
        raise PlacementError(f"--tp {req.tp}: tensor-parallel execution is not built yet; use --tp 1")
    used = set(plan.devices.values()) | {req.device}
    gpus = sorted(d for d in used if d != "cpu")
    if gpus:
        raise PlacementError(
            f"--device/-ot {gpus[0]}: CUDA execution is not built yet; use --device cpu "
            f"(`tandem inspect` can still show a GPU plan as a dry run)"
        )
