"""Shared building blocks: norms, rope, attention, MLPs, MoE routing and experts."""
