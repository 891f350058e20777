"""The run's plan: what every worker does, decided once on the driver from all workers' profiles.

`make_plan` is a pure function from (config, profiles) to a `Plan`, so it can be tested without a
cluster and replaced by the searched plan of the planner without touching the driver or workers.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Optional

from elixir_ray.config import RunConfig
from elixir_ray.profile import WorkerProfile
from elixir_ray.units import parse_bytes

PLAN_VERSION = 1


@dataclass
class Plan:
    version: int
    strategy: str  # "data_parallel": every rank holds the model; gradients averaged over the group
    world_size: int
    micro_batch: int
    grad_accum: int
    dtype: str
    device_memory_bytes: int  # the smallest budget among the workers
    predicted_step_seconds: float  # from the slowest worker's measured micro-step
    notes: list = field(default_factory=list)
    engine: Optional[dict] = None  # the chunk engine's plan, when the engine runs the step

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        data = json.loads(text)
        if data.get("version") != PLAN_VERSION:
            raise ValueError(f"plan version {data.get('version')} is not supported (this build reads {PLAN_VERSION})")
        return cls(**data)


def resolve_dtype(requested: str, device_type: str) -> str:
    if requested != "auto":
        return requested
    return "bfloat16" if device_type == "cuda" else "float32"


def make_plan(cfg: RunConfig, profiles: list[WorkerProfile]) -> Plan:
    """Plan for the weakest worker: the smallest free memory and the slowest measured step."""
    if not profiles:
        raise ValueError("make_plan needs at least one worker profile")
    device_type = profiles[0].device.split(":")[0]
    budget = min(p.device_memory_free for p in profiles)
    if cfg.engine.device_memory is not None:
        budget = min(budget, parse_bytes(cfg.engine.device_memory))
    slowest = max(profiles, key=lambda p: p.micro_step_seconds)
    notes = [f"slowest worker: rank {slowest.rank} on {slowest.hostname} ({slowest.micro_step_seconds * 1e3:.1f} ms per micro-step)"]
    return Plan(
        version=PLAN_VERSION,
        strategy="data_parallel",
        world_size=len(profiles),
        micro_batch=cfg.train.micro_batch,
        grad_accum=cfg.train.grad_accum,
        dtype=resolve_dtype(cfg.train.dtype, device_type),
        device_memory_bytes=int(budget),
        predicted_step_seconds=slowest.micro_step_seconds * cfg.train.grad_accum,
        notes=notes,
    )
