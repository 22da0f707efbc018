"""What the weight loader builds per routed layer, recorded for tests that rebuild a layer's experts their own way."""

from __future__ import annotations

import pytest

from tandem.weights.loader import WeightLoader


def record_builds(monkeypatch: pytest.MonkeyPatch) -> list[tuple[WeightLoader, int, object]]:
    """(loader, layer, build) of every routed layer the models loaded from now on build, in order."""
    builds: list[tuple[WeightLoader, int, object]] = []
    real = WeightLoader.routed_experts

    def recording(loader, layer, build):  # type: ignore[no-untyped-def]
        builds.append((loader, layer, build))
        return real(loader, layer, build)

    monkeypatch.setattr(WeightLoader, "routed_experts", recording)
    return builds
