"""The placement plan: which device holds each tensor of the file. Every path obeys it."""

from tandem.placement.experts import ExpertCache
from tandem.placement.plan import (
    PlacementPlan,
    RuntimeShape,
    StagingSize,
    check_one_gpu,
    cpu_experts_by_layer,
    expert_layer,
    plan_placement,
    staging_size,
    streamable,
)
from tandem.placement.request import PlacementRequest
from tandem.placement.stats import ExpertStats

__all__ = [
    "ExpertCache",
    "ExpertStats",
    "PlacementPlan",
    "PlacementRequest",
    "RuntimeShape",
    "StagingSize",
    "check_one_gpu",
    "cpu_experts_by_layer",
    "expert_layer",
    "plan_placement",
    "staging_size",
    "streamable",
]
