"""`elixir_ray.plan(module, ...)`: profile a model without weights and search its plan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.nn as nn

from elixir_ray.chunk_plan.errors import PlanError
from elixir_ray.chunk_plan.plan import Plan
from elixir_ray.engine.device import random_state_kept, resolve_device
from elixir_ray.engine.op_record import call_key
from elixir_ray.engine.sample import SampleInputs, as_sample_inputs
from elixir_ray.host_ram import available_host_bytes
from elixir_ray.planner.hardware import HardwareProfile, profile_hardware
from elixir_ray.planner.model_profile import ModelProfile, checkpointing_variants, profile_model
from elixir_ray.planner.network import Network
from elixir_ray.planner.op_timing import compute_from_table, device_is_here, kernel_table, time_ops
from elixir_ray.planner.search import HOST_FRACTION, SearchSettings, check_margin, plan_search
from elixir_ray.units import parse_bytes


def device_budget(device: torch.device) -> int:
    """What the device has free; on CUDA within `set_per_process_memory_fraction`, on CPU the free RAM."""
    device = resolve_device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        fraction = getter(device) if getter else 1.0
        return int(min(free, fraction * total - torch.cuda.memory_reserved(device)))
    return available_host_bytes()


def budget_bytes(device_memory: Union[int, str, None], device: torch.device) -> int:
    """The device budget in bytes: `device_memory` ("24GiB", bytes), or what the device has free."""
    return parse_bytes(device_memory) if device_memory is not None else device_budget(device)


def planning_budget(device_memory: Union[int, str, None], hardware: HardwareProfile) -> int:
    """`budget_bytes` for planning with `hardware`'s rates: with no `device_memory`, what its device
    has free, which only a process on that device can read."""
    if device_memory is None and not device_is_here(hardware):
        raise PlanError(f"the hardware profile describes {hardware.device_name or hardware.device}, which this "
                        f"process cannot query for free memory: give the budget (device_memory=, --device-memory, "
                        f"or engine.device_memory in the config)")
    return budget_bytes(device_memory, torch.device(hardware.device))




def default_host_budget(ranks_on_host: int, free_bytes: Optional[int] = None) -> int:
    """Host RAM for optimizer state per rank: a fraction of what is free, shared by the ranks on the host."""
    free = available_host_bytes() if free_bytes is None else free_bytes
    return int(HOST_FRACTION * free) // max(1, ranks_on_host)


def host_budget(host_memory: Union[int, str, None], hardware: HardwareProfile, ranks_on_host: int,
                flag: str = "host_memory") -> tuple[int, Optional[str]]:
    """(host bytes per rank for optimizer state, the option that set them, `flag`, or None):
    `host_memory` when given, else a share of the free host RAM the hardware profile recorded (of
    the machine it describes), else of this machine's."""
    if host_memory is not None:
        return parse_bytes(host_memory), flag
    return default_host_budget(ranks_on_host, hardware.host_memory_free or None), None


@dataclass(frozen=True)
class Profiling:
    """How `search_module` profiles a module for the search.

    `search_checkpointing`: trace every activation-checkpointing setting the module offers, or only
    its own; `variants`: the settings to trace instead. `time_compute`: time the traced kernels on
    the settings' `hw.device`, which must be this process's; a kernel whose tensors take more than
    half the budget is estimated instead of run. `kernel_seconds` ({call key: [seconds, replayed]},
    measured where the device is, e.g. by the workers of a Ray run) costs compute instead, when it
    covers every kernel of every setting traced."""

    loss_fn: Optional[Callable] = None
    search_checkpointing: bool = True
    variants: Optional[list] = None
    time_compute: bool = False
    kernel_seconds: Optional[dict] = None


def search_settings(hardware: HardwareProfile, budget: int, world_size: int, dtype: torch.dtype,
                    **options) -> SearchSettings:
    """`SearchSettings` for a torch compute dtype; `options` are its other fields."""
    return SearchSettings(hw=hardware, budget=budget, world_size=world_size,
                          dtype_name=str(dtype).replace("torch.", ""),
                          elem_bytes=torch.empty(0, dtype=dtype).element_size(), **options)


def search_module(module: nn.Module, sample_inputs: Union[tuple, dict, SampleInputs], settings: SearchSettings,
                  profiling: Profiling = Profiling(),
                  progress: Optional[Callable[[str], None]] = None) -> tuple[Plan, ModelProfile]:
    """Profile `module` (once per checkpointing setting tried) and search; also returns the chosen profile.

    `progress` gets a line as each stage starts (tracing a 10B GPT's settings takes tens of seconds)."""
    check_margin(settings.memory_margin)  # before tracing and timing
    say = progress or (lambda line: None)
    dtype, hardware = getattr(torch, settings.dtype_name), settings.hw
    variants = profiling.variants
    if variants is None:
        variants = checkpointing_variants(module) if profiling.search_checkpointing else [None]
    profiles = []
    for i, v in enumerate(variants):
        say(f"tracing one step of {type(module).__name__} on the meta device"
            + (f" (activation checkpointing setting {i + 1} of {len(variants)})" if len(variants) > 1 else ""))
        profiles.append(profile_model(module, sample_inputs, profiling.loss_fn, v, dtype))
    if profiling.time_compute:
        timed: dict = {}  # the checkpointing settings share most of their kernels: each is timed once
        distinct = len({call_key(op) for p in profiles for op in p.trace.ops})
        say(f"timing the step's {distinct} distinct kernels on {hardware.device}")
        for p in profiles:
            p.compute = time_ops(p.trace.ops, hardware, max_bytes=settings.budget // 2, cache=timed)
    elif profiling.kernel_seconds:
        computes = [compute_from_table(p.trace.ops, profiling.kernel_seconds, hardware.device) for p in profiles]
        if all(c is not None for c in computes):
            for p, c in zip(profiles, computes):
                p.compute = c
    say("searching chunk sizes, pool blocks and placements")
    found = plan_search(profiles, settings)
    chosen = next(p for p in profiles if p.checkpointing == found.activation_checkpointing)
    return found, chosen


def plan(module: nn.Module, sample_inputs: Union[tuple, dict, SampleInputs], *,
         device_memory: Union[int, str, None] = None, world_size: int = 1, hardware: Optional[HardwareProfile] = None,
         dtype: Optional[torch.dtype] = None, loss_fn: Optional[Callable] = None, grad_accum: int = 1,
         host_memory: Union[int, str, None] = None, search_checkpointing: bool = True,
         updates_in_backward: bool = False, time_compute: Optional[bool] = None, low_host_grads: bool = True,
         replicate: str = "auto", progress: Optional[Callable[[str], None]] = None,
         memory_margin: Optional[float] = None, network: Optional[Network] = None) -> Plan:
    """The fastest predicted plan for `module` within `device_memory` (bytes or "24GiB"), less
    `memory_margin` of it (default, None: 0.2), kept back for the allocator's fragmentation.

    The module may live on the meta device; it is traced, never run on real weights. `hardware`
    defaults to a measurement of this machine's device. `host_memory` bounds the optimizer state
    kept on the host per rank (default: a share of the free RAM that `hardware` recorded, else of
    this machine's, shared by `world_size` ranks).
    `search_checkpointing=False` keeps the module's own activation-checkpointing setting.
    `updates_in_backward=True` plans for a loop whose CPU updates start during the last backward
    (wrap with accumulation_steps, no max_grad_norm, not fp16), which hides more of them; with
    `grad_accum=1` device chunks' gradients are then released once applied, which frees memory.
    `time_compute` (default: whether `hardware.device` is this process's) times the step's kernels
    on the device, a few seconds; otherwise compute is the traced FLOPs at the matmul rate.
    `low_host_grads=False` keeps host chunks' gradients in fp32 even with bf16 and `grad_accum=1`
    (when the loop may call backward() more often than `grad_accum` says).
    `replicate` (several ranks): "auto" searches which chunks every rank keeps whole, "all"
    replicates every chunk (when ranks use different parameters in a step), "none" shards them all.
    `network` (several ranks): the node of each rank and the collectives' rates within a node,
    across all ranks and between nodes (`planner.network.Network`); on several nodes "auto" also
    tries sharding chunks within each node and replicating them across nodes.
    `progress` (`print`, say) gets a line as each stage starts.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if network is not None:
        network.layout(world_size)  # a node for each rank, checked before any tracing
    sample_inputs = as_sample_inputs(sample_inputs)
    with random_state_kept(torch.device(hardware.device) if hardware is not None else None):
        check_margin(memory_margin)  # before any measuring or tracing
        if hardware is None:
            if progress:
                progress("measuring this machine's copy, AdamW and matmul rates")
            hardware = profile_hardware()
        device = torch.device(hardware.device)
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        budget = planning_budget(device_memory, hardware)
        host, host_from = host_budget(host_memory, hardware, world_size)
        if time_compute is None:
            time_compute = device_is_here(hardware)
        settings = search_settings(hardware, budget, world_size, dtype, grad_accum=grad_accum, host_budget=host,
                                   host_budget_from=host_from,
                                   updates_in_backward=updates_in_backward, low_host_grads=low_host_grads,
                                   replicate=replicate, memory_margin=memory_margin, network=network)
        profiling = Profiling(loss_fn=loss_fn, search_checkpointing=search_checkpointing, time_compute=time_compute)
        return search_module(module, sample_inputs, settings, profiling, progress)[0]


def time_run_kernels(module: nn.Module, sample_inputs: Union[tuple, dict, SampleInputs], hardware: HardwareProfile,
                     dtype: torch.dtype, search_checkpointing: bool, max_bytes: Optional[int] = None,
                     loss_fn: Optional[Callable] = None) -> dict:
    """{call key: [seconds, replayed]} of every kernel the plan search will trace for `module`, timed on
    `hardware.device` (which must be this process's): what a Ray worker measures for the driver."""
    variants = checkpointing_variants(module) if search_checkpointing else [None]
    timed: dict = {}
    for v in variants:
        time_ops(profile_model(module, sample_inputs, loss_fn, v, dtype).trace.ops, hardware,
                 max_bytes=max_bytes, cache=timed)
    return kernel_table(timed)


def quick_hardware(device: torch.device, device_memory=None) -> HardwareProfile:
    """A short measurement for `wrap` without a plan (a few seconds on a GPU, less on a CPU).

    On a GPU its device buffers stay within a quarter of `device_memory` (the budget wrap was
    given): the budget bounds everything the engine does on the device, measuring included. The
    CPU AdamW is still timed over a full-size host job (128M parameters, 2 GiB of host memory):
    over 16M, which the host's caches nearly hold, it ran at twice the rate of the engine's real
    jobs on the H100 machine, and the plan costed on it left the step waiting on the CPU."""
    if device.type == "cuda":
        quarter = budget_bytes(device_memory, device) // 4
        side = int((quarter / 6) ** 0.5) // 256 * 256  # three square bf16 matrices
        return profile_hardware(device, copy_bytes=max(2**20, min(64 * 2**20, quarter)),
                                adam_numel=max(2**18, min(16 * 2**20, quarter // 16)),  # 16 bytes per element
                                matmul_n=max(512, min(4096, side)))
    return profile_hardware(device, copy_bytes=8 * 2**20, adam_numel=2**20)
