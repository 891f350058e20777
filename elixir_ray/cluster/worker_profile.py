"""Per-worker measurements taken where the worker runs, before the plan is made.

The driver plans for the weakest worker, so each reports its device, how much of it is free, and
the rates the cost model needs (copy bandwidths, AdamW rates, matmul speed), measured on the spot.
The model itself is traced on the driver, on the meta device, without weights; each worker also
traces it and times its kernels on its device, which the driver's plan uses for compute.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from elixir_ray.config import RunConfig
from elixir_ray.host_ram import available_host_bytes, host_ram_bytes
from elixir_ray.planner.hardware import HardwareProfile, profile_hardware

log = logging.getLogger(__name__)


@dataclass
class WorkerProfile:
    rank: int
    hostname: str
    device: str
    device_name: str
    device_memory_total: int
    device_memory_free: int
    cpu_threads: int
    host_memory_free: int = 0  # the host RAM available, shared by the ranks on this host
    hardware: dict = field(default_factory=dict)  # HardwareProfile fields
    kernel_seconds: dict = field(default_factory=dict)  # the model's kernels timed here: {key: [seconds, replayed]}
    node_id: str = ""  # Ray's id of the node this rank runs on (simulated nodes share a host name)
    # the collectives this rank timed, per kind of group (cluster.collective_rates; planner.network)
    network: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def rates(self) -> HardwareProfile:
        return HardwareProfile(**self.hardware)


def device_memory(device: torch.device) -> tuple[int, int]:
    """(total, free) bytes of the compute device; for the CPU, the host's memory."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(total), int(free)
    return host_ram_bytes()


def profile_worker(rank: int, device: torch.device, dtype: torch.dtype, cfg: Optional[RunConfig] = None,
                   micro_batch: Optional[int] = None) -> WorkerProfile:
    """`cfg` and `micro_batch`: also time the kernels of the config's model at that micro-batch, for
    every checkpointing setting the driver's search will try (unless `engine.time_kernels` is off)."""
    small = device.type == "cpu"  # keep the CPU measurement short: it shares cores with other ranks
    hw = profile_hardware(device, dtype, copy_bytes=16 * 2**20 if small else None,
                          adam_numel=2**20 if small else None)
    total, free = device_memory(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    kernels = {}
    if cfg is not None and micro_batch is not None and cfg.engine.time_kernels:
        from elixir_ray.model.factory import build_model, sample_inputs, trace_loss
        from elixir_ray.planner.api import time_run_kernels

        try:
            kernels = time_run_kernels(build_model(cfg, device="meta"), sample_inputs(cfg, micro_batch), hw,
                                       dtype, cfg.engine.search_checkpointing, max_bytes=free // 2,
                                       loss_fn=trace_loss(cfg))
        except Exception as exc:  # optional: the plan then costs compute from FLOPs; the driver's own trace says why
            log.warning("rank %d could not time the model's kernels (%s: %s); the plan will use FLOPs",
                        rank, type(exc).__name__, exc)
    return WorkerProfile(rank=rank, hostname=socket.gethostname(), device=str(device), device_name=name,
                         device_memory_total=total, device_memory_free=free, cpu_threads=torch.get_num_threads(),
                         host_memory_free=available_host_bytes(),
                         hardware=asdict(hw), kernel_seconds=kernels)
