"""The engine's CPU AdamW beside a busy training thread: what slows it, and which setting keeps it fast.

On one H100 machine (16 cores) an update through torch's passes ran at 4.3 G params/s alone and
at 1.4 to 1.7 G beside training (2026-11-26). Here the engine's update job (`host_update`: the update from bf16
gradients and the cast of the master into the upload copy, on a thread of its own with its own
thread count, as `HostUpdates` runs it) is timed alone and beside stand-ins for what the training
thread does, one cause at a time, through the one-pass C kernel (host_kernel.py) and through
torch's three passes:

- "python+kernels": a Python loop launching kernels with a little Python between them, as a
  forward with hooks does, waiting on the device every few launches (the GIL, and a spinning core);
- "device wait": the thread only waits on the device, in `torch.cuda.synchronize` (a spinning core,
  no GIL held);
- "copies": pinned host-to-device and device-to-host copies of 256 MiB running all the time (the
  DMA engines' share of host memory bandwidth);

each per update thread count (torch's passes at the engine's tile of 1M elements per thread), and for the
first stand-in with Python's GIL switch interval cut from 5 ms to 0.2 ms. On a CPU-only machine the
device stand-ins are left out and "python+kernels" runs tiny tensor ops. The state lives in host
memory page-locked as the engine's arena is (on CUDA), and one row times ordinary pageable memory.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from elixir_ray.engine.adam_step import AdamCall
from elixir_ray.engine.host_kernel import HostAdamKernel, host_adam_kernel
from elixir_ray.engine.optimizer import TileScratch, grad_tile_elements
from elixir_ray.planner.hardware import HostChunkState, PinnedCopies


@dataclass
class HostAdamRow:
    beside: str  # "nothing", "python+kernels", "device wait" or "copies"
    # "c" (the one-pass kernel, host_kernel.py, its threads claiming blocks as the engine runs it),
    # "c, even shares" (the same kernel, an even share per thread: what claiming blocks is
    # measured against) or "torch" (widen, fused Adam, cast)
    kernel: str
    threads: int  # threads of the update
    tile: int  # elements widened at a time (torch's path; the C kernel makes one pass over the chunk)
    tile_rule: str  # "fixed 1M", "1M per thread" (grad_tile_elements), "whole" or "one pass"
    memory: str  # "page-locked" (the engine's arena on CUDA) or "pageable"
    switch_interval_ms: float  # Python's GIL switch interval during the timing
    params_per_s: float

    def to_dict(self) -> dict:
        return asdict(self)


def thread_counts(total: int) -> list[int]:
    """All but one of the process's threads (the engine's default), all but two, three quarters and half."""
    return sorted({max(1, total - 1), max(1, total - 2), max(1, 3 * total // 4), max(1, total // 2)}, reverse=True)


def stand_ins(device: torch.device) -> list[str]:
    return ["nothing", "python+kernels"] + (["device wait", "copies"] if device.type == "cuda" else [])


def _stand_in(kind: str, stop: threading.Event, device: torch.device) -> None:
    if kind == "python+kernels" and device.type == "cuda":
        a = torch.randn(1024, 1024, device=device, dtype=torch.bfloat16)
        while not stop.is_set():
            for _ in range(20):
                a @ a
                sum(range(200))  # Python between launches: hooks, module code
            torch.cuda.synchronize(device)
    elif kind == "python+kernels":
        x = torch.zeros(64)
        while not stop.is_set():
            for _ in range(20):
                x.add_(1)
                sum(range(200))
    elif kind == "device wait":
        a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
        while not stop.is_set():
            for _ in range(50):
                a @ a  # about 10 ms of device work, waited for without Python in between
            torch.cuda.synchronize(device)
    elif kind == "copies":  # the profile's own stand-in for the engine's loads and gradient copies
        with PinnedCopies(device):
            stop.wait()


def measure(state: HostChunkState, threads: int, tile: int, beside: str, device: torch.device,
            switch_interval_ms: Optional[float] = None, repeats: int = 3, kernel: Optional[HostAdamKernel] = None) -> float:
    """Median parameters per second of the engine's update job over `state`, beside `beside`:
    through `kernel` (the one-pass C kernel), or torch's passes where it is None."""
    numel = state.master.numel()
    call = AdamCall(segments=((0, numel),), step=1, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                    decoupled=True)
    scratch = TileScratch(elements=tile)
    rates: list[float] = []
    errors: list[BaseException] = []

    def job():
        state.update(call, scratch, kernel)

    def update():
        try:
            torch.set_num_threads(threads)  # this thread's intra-op team, as HostUpdates sets its own
            if device.type == "cuda":
                torch.cuda.set_device(device)
            job()  # warm-up: the team, the scratch buffer
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                job()
                times.append(time.perf_counter() - start)
            rates.append(numel / statistics.median(times))
        except BaseException as exc:  # re-raised on the calling thread
            errors.append(exc)

    old_interval = sys.getswitchinterval()
    if switch_interval_ms is not None:
        sys.setswitchinterval(switch_interval_ms / 1e3)
    stop = threading.Event()
    trainer = (threading.Thread(target=_stand_in, args=(beside, stop, device), daemon=True)
               if beside != "nothing" else None)
    try:
        if trainer:
            trainer.start()
            time.sleep(0.05)  # the stand-in under way before the clock starts
        worker = threading.Thread(target=update, name="elixir-cpu-adam-bench")
        worker.start()
        worker.join()
    finally:
        stop.set()
        if trainer:
            trainer.join()
        sys.setswitchinterval(old_interval)
    if errors:
        raise errors[0]
    return rates[0]


def run(numel: int, device: torch.device, progress=print) -> list[HostAdamRow]:
    """Each stand-in and thread count, through the one-pass C kernel (where it builds here; its
    threads claiming blocks, and an even share each) and through torch's passes at the engine's
    tile (on the H100 with 15 threads, 2026-11-26: 1.7 to 2.1 G params/s with a fixed 1M tile,
    2.7 to 3.1 G with 1M per thread); then the C kernel (else torch) with a short GIL switch
    interval, and over pageable memory."""
    total = torch.get_num_threads()
    state = HostChunkState(numel, torch.bfloat16, torch.bfloat16, device)
    memory = "page-locked" if state.arena.pinned else "pageable"
    interval = sys.getswitchinterval() * 1e3
    rows: list[HostAdamRow] = []
    c_kernel = host_adam_kernel()
    kernels = ([("c", c_kernel), ("c, even shares", HostAdamKernel(c_kernel.path, claim=0))]
               if c_kernel is not None else []) + [("torch", None)]

    def add(beside, name, kernel, threads, memory_kind, state_used, switch=None):
        rule, tile = ("one pass", numel) if kernel is not None else \
            ("1M per thread", min(grad_tile_elements(threads), numel))  # the engine's tile
        rate = measure(state_used, threads, tile, beside, device, switch, kernel=kernel)
        row = HostAdamRow(beside, name, threads, tile, rule, memory_kind, interval if switch is None else switch, rate)
        progress(f"beside {beside}, {name}, {threads} thread(s), tile {tile:,} ({rule}), {memory_kind}, "
                 f"switch {row.switch_interval_ms:g} ms: {rate / 1e9:.2f} G params/s")
        rows.append(row)

    for beside in stand_ins(device):
        for threads in thread_counts(total):
            for name, kernel in kernels:
                add(beside, name, kernel, threads, memory, state)
    default = thread_counts(total)[0]
    name, kernel = kernels[0]
    add("python+kernels", name, kernel, default, memory, state, switch=0.2)
    if state.arena.pinned:
        del state
        add("nothing", name, kernel, default, "pageable",
            HostChunkState(numel, torch.bfloat16, torch.bfloat16, torch.device("cpu")))  # not page-locked
    return rows


def markdown(rows: list[HostAdamRow]) -> str:
    lines = ["| beside | kernel | update threads | tile (elements) | tile rule | memory | GIL switch (ms) | G params/s |",
             "|---|---|---:|---:|---|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.beside} | {r.kernel} | {r.threads} | {r.tile:,} | {r.tile_rule} | {r.memory} | "
                     f"{r.switch_interval_ms:g} | {r.params_per_s / 1e9:.2f} |")
    return "\n".join(lines)
