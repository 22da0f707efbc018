"""The placement plan: which device holds each tensor of the file. Every path obeys it."""

from tandem.placement.plan import (
    PlacementPlan,
    RuntimeShape,
    StagingSize,
    cpu_experts_by_layer,
    expert_layer,
    plan_placement,
    staging_size,
    streamable,
)
from tandem.placement.request import PlacementRequest

__all__ = [
    "PlacementPlan",
    "PlacementRequest",
    "RuntimeShape",
    "StagingSize",
    "cpu_experts_by_layer",
    "expert_layer",
    "plan_placement",
    "staging_size",
    "streamable",
]
