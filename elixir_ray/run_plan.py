"""The run's plan: what every worker does, decided once on the driver from all workers' profiles.

`make_run_plan` is a pure function from (config, profiles) to a `RunPlan`, so it can be tested
without a cluster. It holds the batch split and the engine's searched `Plan`, which every rank runs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Optional

from elixir_ray.config import RunConfig
from elixir_ray.units import parse_bytes

if TYPE_CHECKING:  # the profiles come from the workers (cluster/); this module is read by the planner too
    from elixir_ray.cluster.worker_profile import WorkerProfile
    from elixir_ray.planner.network import Network

PLAN_VERSION = 1


@dataclass
class RunPlan:
    version: int
    strategy: str  # "chunked": the chunk engine on every rank, gradients averaged over the group
    world_size: int
    micro_batch: int
    grad_accum: int
    dtype: str
    device_memory_bytes: int  # the smallest budget among the workers
    predicted_step_seconds: float  # the engine plan's prediction, at the slowest worker's measured rates
    notes: list = field(default_factory=list)
    engine: Optional[dict] = None  # the chunk engine's `Plan` (its to_dict())

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RunPlan":
        data = json.loads(text)
        if data.get("version") != PLAN_VERSION:
            raise ValueError(f"plan version {data.get('version')} is not supported (this build reads {PLAN_VERSION})")
        return cls(**data)


def updates_in_backward(cfg: RunConfig, dtype: str) -> bool:
    """Whether the trainer's CPU updates start in the last backward (it always declares its
    accumulation steps to the engine, see trainer.py)."""
    from elixir_ray.engine.optimizer import updates_start_in_backward

    return updates_start_in_backward(cfg.train.grad_accum, cfg.optim.max_grad_norm, dtype == "float16")


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


def slowest_kernels(profiles: list[WorkerProfile]) -> Optional[dict]:
    """Each kernel's time on the slowest worker, or None unless every worker timed the same kernels."""
    tables = [p.kernel_seconds for p in profiles]
    if not tables or not all(tables) or any(t.keys() != tables[0].keys() for t in tables):
        return None
    return {k: [max(t[k][0] for t in tables), all(t[k][1] for t in tables)] for k in tables[0]}


def node_names(profiles: list[WorkerProfile]) -> tuple[list[int], list[str]]:
    """(each rank's node number, each node's name): nodes told apart by Ray's node id (by host name
    for a profile without one), named by host name, with the start of the node id where two nodes
    share a host name (simulated nodes on one machine)."""
    keys = [p.node_id or p.hostname for p in profiles]
    order = list(dict.fromkeys(keys))
    host = {key: p.hostname for key, p in zip(keys, profiles)}
    shared = {h for h in host.values() if sum(v == h for v in host.values()) > 1}
    names = [f"{host[key]}/{key[:8]}" if host[key] in shared and key != host[key] else host[key] for key in order]
    return [order.index(key) for key in keys], names


def rank_network(profiles: list[WorkerProfile]) -> Optional["Network"]:
    """The ranks' node layout and their collectives' measured rates, each kind of group at its
    slowest; None for one rank."""
    from elixir_ray.planner.network import Network

    if len(profiles) < 2:
        return None
    node_of_rank, names = node_names(profiles)
    return Network.from_ranks(node_of_rank, names, [p.network for p in profiles])


def device_budget(cfg: RunConfig, profiles: list) -> int:
    """Each rank's device-memory budget: the least free among the profiles, within `engine.device_memory`."""
    budget = min(p.device_memory_free for p in profiles)
    if cfg.engine.device_memory is not None:
        budget = min(budget, parse_bytes(cfg.engine.device_memory))
    return budget


def make_run_plan(cfg: RunConfig, profiles: list[WorkerProfile], global_batch: Optional[int] = None) -> RunPlan:
    """Plan for the weakest worker: the smallest free memory and the slowest measured rates, each
    with the node it was measured on, and the collectives at the rates the ranks measured.

    `global_batch` (default: micro_batch x grad_accum x workers) stays fixed across restarts.
    The engine plan is searched here, on the driver, from a meta-device trace of the model.
    """
    import torch

    from elixir_ray.model.factory import build_model, sample_inputs, trace_loss
    from elixir_ray.planner.api import Profiling, default_host_budget, search_module, search_settings
    from elixir_ray.planner.for_config import config_hints
    from elixir_ray.planner.hardware import HardwareProfile, slowest_nodes

    if not profiles:
        raise ValueError("make_run_plan needs at least one worker profile")
    world = len(profiles)
    if global_batch is None:
        global_batch = cfg.train.micro_batch * cfg.train.grad_accum * world
    micro, accum = split_global_batch(global_batch, world, cfg.train.micro_batch)
    device_type = profiles[0].device.split(":")[0]
    dtype = resolve_dtype(cfg.train.dtype, device_type)
    budget = device_budget(cfg, profiles)
    rates = HardwareProfile.slowest([p.rates for p in profiles])
    per_host = {h: sum(p.hostname == h for p in profiles) for h in {p.hostname for p in profiles}}
    host_budget = min(default_host_budget(per_host[p.hostname], p.host_memory_free) for p in profiles)
    kernels = slowest_kernels(profiles)
    network = rank_network(profiles)
    node_of_rank, names = node_names(profiles)
    kernel_totals = [sum(s for s, _ in p.kernel_seconds.values()) for p in profiles] if kernels else None
    bounds = slowest_nodes([p.rates for p in profiles], [names[n] for n in node_of_rank], kernel_totals)
    with config_hints(cfg):
        settings = search_settings(rates, budget, world, getattr(torch, dtype), grad_accum=accum,
                                   host_budget=host_budget, updates_in_backward=updates_in_backward(cfg, dtype),
                                   replicate=cfg.engine.replicate, memory_margin=cfg.engine.memory_margin,
                                   network=network, slowest_nodes=bounds)
        profiling = Profiling(loss_fn=trace_loss(cfg), search_checkpointing=cfg.engine.search_checkpointing,
                              kernel_seconds=kernels)
        engine_plan, _ = search_module(build_model(cfg, device="meta"), sample_inputs(cfg, micro), settings, profiling)
    return RunPlan(
        version=PLAN_VERSION,
        strategy="chunked",
        world_size=world,
        micro_batch=micro,
        grad_accum=accum,
        dtype=dtype,
        device_memory_bytes=int(budget),
        predicted_step_seconds=engine_plan.predicted_step_seconds,
        notes=[f"rates: the slowest of {world} worker(s)",
               "compute: the model's kernels as the workers timed them, each at the slowest worker"
               if any("distinct kernels timed" in n for n in engine_plan.notes)
               else "compute: traced FLOPs at the slowest matmul rate (no kernel times from the workers for this "
                    "micro-batch)"],
        engine=engine_plan.to_dict(),
    )
