"""The placement plan, computed once from the flags before any weight moves."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.errors import PlacementError
from tandem.gguf import GGUFFile


@dataclass(frozen=True)
class PlacementPlan:
    """tensor name -> device ("cpu" or "cuda:N")."""

    devices: dict[str, str]

    def device_of(self, name: str) -> str:
        return self.devices[name]

    def bytes_per_device(self, f: GGUFFile) -> dict[str, int]:
        totals: dict[str, int] = {}
        for name, device in self.devices.items():
            totals[device] = totals.get(device, 0) + f.tensors[name].n_bytes
        return totals


def plan_placement(f: GGUFFile, device: str = "cpu") -> PlacementPlan:
    """Place every tensor on `device`. Only the CPU executes models so far."""
    if device != "cpu":
        raise PlacementError(
            f"--device {device}: only the CPU path is built so far; use --device cpu"
        )
    return PlacementPlan(devices={name: "cpu" for name in f.tensors})
