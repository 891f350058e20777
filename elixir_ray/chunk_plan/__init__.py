"""The plan both the engine and the planner speak: the `Plan` dataclass, the packing of parameters
into chunks, and the engine's buffer sizes the planner budgets.

A leaf: it imports nothing else of elixir_ray but `units`, so that the engine (which runs a plan)
and the planner (which searches one) depend on it and not on each other.
"""

from elixir_ray.chunk_plan.errors import PlanError
from elixir_ray.chunk_plan.plan import Plan

__all__ = ["Plan", "PlanError"]
