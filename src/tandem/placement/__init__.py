"""The placement plan: which device holds each tensor of the file. Every path obeys it."""

from tandem.placement.plan import PlacementPlan, RuntimeShape, expert_layer, plan_placement
from tandem.placement.request import PlacementRequest

__all__ = ["PlacementPlan", "PlacementRequest", "RuntimeShape", "expert_layer", "plan_placement"]
