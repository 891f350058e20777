"""Per-worker measurements taken where the worker runs, before the plan is made.

The planner issue widens this (copy bandwidths, AdamW rates); the driver only needs the facts
that decide a plan: the device, its free memory, the CPU threads, and how long a micro-step takes.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class WorkerProfile:
    rank: int
    hostname: str
    device: str
    device_name: str
    device_memory_total: int
    device_memory_free: int
    cpu_threads: int
    matmul_tflops: float
    micro_step_seconds: float
    peak_device_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


def device_memory(device: torch.device) -> tuple[int, int]:
    """(total, free) bytes of the compute device; for the CPU, the host's memory."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(total), int(free)
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(pages), int(avail)


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype, n: int = 1024, repeats: int = 3) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12


def profile_worker(rank: int, device: torch.device, dtype: torch.dtype, micro_step) -> WorkerProfile:
    """`micro_step()` runs one forward and backward of the real model on a real batch."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    micro_step()  # warm-up: allocator and kernels
    start = time.perf_counter()
    micro_step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    total, free = device_memory(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return WorkerProfile(
        rank=rank, hostname=socket.gethostname(), device=str(device), device_name=name,
        device_memory_total=total, device_memory_free=free, cpu_threads=torch.get_num_threads(),
        matmul_tflops=measure_matmul_tflops(device, dtype, n=512 if device.type == "cpu" else 4096),
        micro_step_seconds=seconds, peak_device_bytes=int(peak),
    )
