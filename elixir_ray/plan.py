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

    def to_dict(self) -> dict:
        return asdict(self)

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


def split_global_batch(global_batch: int, world_size: int, max_micro_batch: int) -> tuple[int, int]:
    """(micro_batch, grad_accum) so that world_size ranks together still take global_batch samples.

    Keeping the global batch fixed when the world size changes keeps the loss curve and the data
    position meaningful across an elastic restart.
    """
    if global_batch % world_size:
        raise ValueError(f"a global batch of {global_batch} cannot be split evenly over {world_size} workers")
    per_rank = global_batch // world_size
    micro = max(d for d in range(1, min(per_rank, max_micro_batch) + 1) if per_rank % d == 0)
    return micro, per_rank // micro


def make_plan(cfg: RunConfig, profiles: list[WorkerProfile], global_batch: Optional[int] = None) -> Plan:
    """Plan for the weakest worker: the smallest free memory and the slowest measured step.

    `global_batch` (default: micro_batch x grad_accum x workers) stays fixed across restarts.
    """
    if not profiles:
        raise ValueError("make_plan needs at least one worker profile")
    world = len(profiles)
    if global_batch is None:
        global_batch = cfg.train.micro_batch * cfg.train.grad_accum * world
    micro, accum = split_global_batch(global_batch, world, cfg.train.micro_batch)
    device_type = profiles[0].device.split(":")[0]
    budget = min(p.device_memory_free for p in profiles)
    if cfg.engine.device_memory is not None:
        budget = min(budget, parse_bytes(cfg.engine.device_memory))
    slowest = max(profiles, key=lambda p: p.micro_step_seconds)
    notes = [f"slowest worker: rank {slowest.rank} on {slowest.hostname} ({slowest.micro_step_seconds * 1e3:.1f} ms per micro-step)"]
    return Plan(
        version=PLAN_VERSION,
        strategy="data_parallel",
        world_size=world,
        micro_batch=micro,
        grad_accum=accum,
        dtype=resolve_dtype(cfg.train.dtype, device_type),
        device_memory_bytes=int(budget),
        predicted_step_seconds=slowest.micro_step_seconds * accum * micro / max(1, cfg.train.micro_batch),
        notes=notes,
    )
