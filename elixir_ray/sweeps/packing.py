"""What one trial reserves, and how `trials_per_gpu` packs several trials onto one GPU.

A trial is one placement group: a bundle for its driver (the Ray Tune trainable that runs the
controller) and one per rank. With `trials_per_gpu: k` each rank reserves 1/k of a GPU and is
given a device-memory budget of 1/k of the GPU's free memory: the engine never exceeds its
budget, so k trials share a GPU without risking an out-of-memory error. A k the model cannot be
planned within is refused before any trial starts, naming the largest k that fits. On a CPU-only
cluster a rank's "device" is a slot of `cluster.cpus_per_worker` CPUs (one with `auto`): each rank reserves 1/k of
them, and its budget is 1/k of the host memory free. The budget is recorded in the sweep's
directory (`packing.json`), and a resumed sweep keeps it while it still fits in what is free then:
its continued trials run the plans they started with.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Optional

from elixir_ray.config import RunConfig
from elixir_ray.errors import ConfigError
from elixir_ray.units import format_bytes, parse_bytes

PACKING_FILE = "packing.json"  # in the sweep's directory: the budget its trials started with
TRIAL_DRIVER_CPUS = 1.0  # the trial's driver: Tune's trainable, the controller and its checkpoint writes
RESOURCE_STEPS = 10_000  # Ray counts a fractional resource in steps of 0.0001


def _share(amount: float, k: int) -> float:
    """amount / k, rounded down to a step Ray can reserve: k of them still fit in `amount`."""
    return math.floor(amount * RESOURCE_STEPS / k) / RESOURCE_STEPS


@dataclass(frozen=True)
class TrialResources:
    num_workers: int
    use_gpu: bool
    rank_bundle: dict  # what each rank reserves: {"CPU": c, "GPU": 1/k}, or {"CPU": c/k} on a CPU-only cluster
    driver_bundle: dict
    trials_per_gpu: int
    device_memory: Optional[int] = None  # each rank's budget in bytes when packed (k > 1); None: the engine's own
    device_free: Optional[int] = None  # the free memory of a GPU (or the host) the budget was cut from
    budget_kept: bool = False  # a resumed sweep's budget, the one its trials started with (device_free: free now)

    @property
    def bundles(self) -> list[dict]:
        """The trial's placement group: its driver's bundle first, then one per rank."""
        return [dict(self.driver_bundle)] + [dict(self.rank_bundle) for _ in range(self.num_workers)]

    def cpus(self) -> float:
        return sum(b.get("CPU", 0) for b in self.bundles)

    def describe(self) -> str:
        per = ", ".join(f"{v:g} {k}" for k, v in self.rank_bundle.items())
        cut = (f"the one its trials started with, within 1/{self.trials_per_gpu} of {format_bytes(self.device_free)} "
               f"free now" if self.budget_kept else f"1/{self.trials_per_gpu} of {format_bytes(self.device_free)} free")
        budget = f", a device-memory budget of {format_bytes(self.device_memory)} each ({cut})" \
            if self.device_memory else ""
        return f"a driver ({TRIAL_DRIVER_CPUS:g} CPU) and {self.num_workers} rank(s) of {per}{budget}"


def trial_resources(cfg: RunConfig, trials_per_gpu: int, cluster: dict) -> TrialResources:
    """The bundles of one trial of `cfg` on a cluster with `cluster` resources (ray.cluster_resources())."""
    from elixir_ray.cluster.placement import resolve_worker_shape

    shape = resolve_worker_shape(cfg, cluster)
    k = trials_per_gpu
    if k > RESOURCE_STEPS:
        raise ConfigError(f"trials_per_gpu={k}: Ray reserves a GPU (or CPU) in steps of 1/{RESOURCE_STEPS}, so at "
                          f"most {RESOURCE_STEPS} trials can share one")
    if shape.use_gpu:
        rank = {"CPU": float(shape.cpus_per_worker), "GPU": _share(1, k)}
    else:
        rank = {"CPU": _share(shape.cpus_per_worker, k)}
    rank.update(shape.resources)
    return TrialResources(num_workers=shape.num_workers, use_gpu=shape.use_gpu, rank_bundle=rank,
                          driver_bundle={"CPU": TRIAL_DRIVER_CPUS}, trials_per_gpu=k)


def free_device_memory(resources: TrialResources, timeout_s: float) -> int:
    """The free memory of one GPU of the cluster (or of a node's host memory, on a CPU-only
    cluster), measured by a task that reserves what a rank would."""
    import ray

    from elixir_ray.errors import ClusterError

    @ray.remote(max_retries=0)
    def measure(use_gpu: bool) -> int:
        if not use_gpu:  # as a rank's profile reads it, without importing torch
            from elixir_ray.host_ram import available_host_bytes

            return available_host_bytes()
        import torch

        from elixir_ray.cluster.worker_profile import device_memory

        return device_memory(torch.device("cuda", 0))[1]

    task = measure.options(num_cpus=resources.rank_bundle.get("CPU", 0), num_gpus=1 if resources.use_gpu else 0)
    ref = task.remote(resources.use_gpu)
    ready, _ = ray.wait([ref], timeout=timeout_s)
    if not ready:
        ray.cancel(ref, force=True)
        raise ClusterError(f"trials_per_gpu: could not measure a free {'GPU' if resources.use_gpu else 'CPU slot'} "
                           f"within cluster.placement_timeout_s={timeout_s:g}s: other work holds them")
    return int(ray.get(ref))


def packed(cfg: RunConfig, resources: TrialResources, free: int, *, started_with: Optional[dict] = None
           ) -> TrialResources:
    """`resources` with each rank's budget, 1/k of `free` (within the config's own
    engine.device_memory, if smaller); refused when the model has no plan within it. A resumed
    sweep passes the packing its trials started with (`read_packing`): its budget is kept where
    it is no larger than the one cut now, so that continued trials find their plans in the plan
    cache rather than search new ones for a budget a few megabytes apart."""
    from dataclasses import replace

    k = resources.trials_per_gpu
    fits = PlanFit(cfg, resources)
    budget = _capped(cfg, free // k)
    kept = kept_budget(started_with, k, budget)
    if kept is not None and fits(kept):
        return replace(resources, device_memory=kept, device_free=free, budget_kept=True)
    if not fits(budget):
        most = largest_fitting(lambda j: fits(_capped(cfg, free // j)), k)
        device = "GPU" if resources.use_gpu else "CPU slot (the host's memory)"
        advice = (f"at most trials_per_gpu={most} fits" if most else
                  "it does not fit even with the whole device: use a smaller model or micro-batch")
        raise ConfigError(f"trials_per_gpu={k}: each rank would get {format_bytes(budget)} of the {device}'s "
                          f"{format_bytes(free)} free, and the planner finds no plan of this model within it: "
                          f"{advice}")
    return replace(resources, device_memory=budget, device_free=free)


def kept_budget(started_with: Optional[dict], k: int, budget_now: int) -> Optional[int]:
    """The budget a resumed sweep keeps: the one recorded at its start, for the same k and no
    larger than `budget_now` (the memory free now may be less: other work took some); else None."""
    if not started_with or started_with.get("trials_per_gpu") != k:
        return None
    budget = started_with.get("device_memory")
    if not isinstance(budget, int) or isinstance(budget, bool) or not 0 < budget <= budget_now:
        return None
    return budget


def write_packing(sweep_dir: str, resources: TrialResources) -> None:
    """Record the trials' budget in the sweep's directory (temporary name, then rename)."""
    from elixir_ray import storage

    record = {"trials_per_gpu": resources.trials_per_gpu, "device_memory": resources.device_memory,
              "device_free": resources.device_free}
    fs, path = storage.resolve(f"{sweep_dir}/{PACKING_FILE}")
    storage.write_bytes_atomic(fs, path, json.dumps(record, indent=1).encode())


def read_packing(sweep_dir: str) -> Optional[dict]:
    """The packing recorded at the sweep's start; None where there is none or it does not read as
    one (the budget is then cut again)."""
    from elixir_ray import storage

    record = storage.read_json(f"{sweep_dir}/{PACKING_FILE}")
    return record if isinstance(record, dict) else None


def _capped(cfg: RunConfig, budget: int) -> int:
    return budget if cfg.engine.device_memory is None else min(budget, parse_bytes(cfg.engine.device_memory))


def largest_fitting(fits, k: int) -> int:
    """The largest j below `k` for which `fits(j)` (fitting is monotone: fewer trials per GPU, a
    larger budget each), or 0 when not even 1 fits: a few planner searches, not one per j."""
    if not fits(1):
        return 0
    low, high = 1, k - 1  # fits(low); the answer is in [low, high]
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


class PlanFit:
    """Whether the planner finds a plan of `cfg`'s model within a per-rank budget. The model is
    traced once (each checkpointing setting the search tries), and each budget is one search.
    Memory alone decides, so the rates are nominal; the host memory is the driver host's, shared
    by every rank of the trials packed on it."""

    def __init__(self, cfg: RunConfig, resources: TrialResources):
        import torch

        from elixir_ray.cluster.cpu_shares import reserved_threads
        from elixir_ray.model.factory import build_model, sample_inputs, trace_loss
        from elixir_ray.planner.api import default_host_budget
        from elixir_ray.planner.hardware import HardwareProfile
        from elixir_ray.planner.model_profile import checkpointing_variants, profile_model
        from elixir_ray.run_plan import resolve_dtype, split_global_batch, updates_in_backward

        world = self.world = resources.num_workers
        device = "cuda" if resources.use_gpu else "cpu"
        self.cfg, self.dtype = cfg, resolve_dtype(cfg.train.dtype, device)
        micro, self.accum = split_global_batch(cfg.train.micro_batch * cfg.train.grad_accum * world, world,
                                               cfg.train.micro_batch)
        self.hardware = HardwareProfile(device=device, h2d_gbps=10.0, d2h_gbps=10.0, cpu_adam_params_per_s=1e9,
                                        device_adam_params_per_s=1e10, matmul_tflops=10.0,
                                        cpu_threads=reserved_threads(cfg.cluster.cpus_per_worker))
        self.host_budget = default_host_budget(world * resources.trials_per_gpu)
        self.in_backward = updates_in_backward(cfg, self.dtype)
        module, dtype = build_model(cfg, device="meta"), getattr(torch, self.dtype)
        variants = checkpointing_variants(module) if cfg.engine.search_checkpointing else [None]
        self.profiles = [profile_model(module, sample_inputs(cfg, micro), trace_loss(cfg), v, dtype) for v in variants]

    def __call__(self, budget: int) -> bool:
        import torch

        from elixir_ray.chunk_plan.errors import PlanError
        from elixir_ray.planner.api import search_settings
        from elixir_ray.planner.search import plan_search

        settings = search_settings(self.hardware, budget, self.world, getattr(torch, self.dtype),
                                   grad_accum=self.accum, host_budget=self.host_budget,
                                   updates_in_backward=self.in_backward, replicate=self.cfg.engine.replicate,
                                   memory_margin=self.cfg.engine.memory_margin)
        try:
            plan_search(self.profiles, settings)
        except PlanError:
            return False
        return True
