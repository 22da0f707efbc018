"""The placement plan: which device holds each tensor of the file. Every path obeys it."""

from tandem.placement.plan import PlacementPlan, plan_placement

__all__ = ["PlacementPlan", "plan_placement"]
