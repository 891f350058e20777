"""The engine's CPU AdamW beside a busy training thread: which tile size and thread count keep it fast.

On the H100 machine the update ran at 4.3 G params/s alone and at 1.4 to 1.7 G beside training
(docs/BENCHMARKS.md, 2026-11-26). Here the same update (`run_adam` from bf16 gradients, on a thread
of its own with its own intra-op thread count, as `HostUpdates` runs it) is timed alone and beside
a stand-in for the training thread: a Python loop that launches kernels with a little Python
between them, as a forward with hooks does, and on a GPU waits for the device every few launches.
One row per (training thread, update threads, tile elements), so that one short run on the GPU
machine says which setting the engine should use there.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import asdict, dataclass

import torch

from elixir_ray.engine.optimizer import AdamCall, TileScratch, grad_tile_elements, run_adam


@dataclass
class HostAdamRow:
    beside: str  # "nothing" or "training"
    threads: int  # intra-op threads of the update
    tile: int  # elements widened at a time
    tile_rule: str  # "fixed 1M" (before 2026-11-26) or "1M per thread" (grad_tile_elements)
    params_per_s: float

    def to_dict(self) -> dict:
        return asdict(self)


def thread_counts(total: int) -> list[int]:
    """All but one of the process's threads (the engine's default), all but two, and half."""
    return sorted({max(1, total - 1), max(1, total - 2), max(1, total // 2)}, reverse=True)


def _training_stand_in(stop: threading.Event, device: torch.device) -> None:
    if device.type == "cuda":
        a = torch.randn(1024, 1024, device=device, dtype=torch.bfloat16)
        while not stop.is_set():
            for _ in range(20):
                a @ a
                sum(range(200))  # Python between launches: hooks, module code
            torch.cuda.synchronize(device)  # a training thread waiting on the device spins a core
    else:
        x = torch.zeros(64)
        while not stop.is_set():
            for _ in range(20):
                x.add_(1)
                sum(range(200))


def state_of(numel: int) -> tuple:
    """fp32 master and moments and a bf16 gradient of `numel` elements, on the host (the pages
    touched once here, not in the first timing)."""
    return (*(torch.zeros(numel) for _ in range(3)), torch.full((numel,), 1e-3, dtype=torch.bfloat16))


def measure(state: tuple, threads: int, tile: int, beside_training: bool, device: torch.device,
            repeats: int = 3) -> float:
    """Median parameters per second of the update of `state` (`state_of`) from its bf16 gradient."""
    master, avg, avg_sq, grad = state
    numel = master.numel()
    call = AdamCall(segments=((0, numel),), step=1, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                    decoupled=True)
    scratch = TileScratch(elements=tile)
    rates: list[float] = []
    errors: list[BaseException] = []

    def update():
        try:
            torch.set_num_threads(threads)  # this thread's intra-op team, as HostUpdates sets its own
            run_adam([call], master, grad, avg, avg_sq, scratch=scratch)  # warm-up: pages, the team
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                run_adam([call], master, grad, avg, avg_sq, scratch=scratch)
                times.append(time.perf_counter() - start)
            rates.append(numel / statistics.median(times))
        except BaseException as exc:  # re-raised on the calling thread
            errors.append(exc)

    stop = threading.Event()
    trainer = threading.Thread(target=_training_stand_in, args=(stop, device), daemon=True) if beside_training else None
    if trainer:
        trainer.start()
    worker = threading.Thread(target=update, name="elixir-cpu-adam-bench")
    worker.start()
    worker.join()
    stop.set()
    if trainer:
        trainer.join()
    if errors:
        raise errors[0]
    return rates[0]


def run(numel: int, device: torch.device, progress=print) -> list[HostAdamRow]:
    total = torch.get_num_threads()
    state = state_of(numel)
    rows = []
    for beside in (False, True):
        for threads in thread_counts(total):
            tried = set()
            for rule, tile in (("fixed 1M", 1 << 20), ("1M per thread", grad_tile_elements(threads))):
                if min(tile, numel) in tried:  # one thread: the two rules are one tile
                    continue
                tried.add(min(tile, numel))
                rate = measure(state, threads, min(tile, numel), beside, device)
                row = HostAdamRow("training" if beside else "nothing", threads, min(tile, numel), rule, rate)
                progress(f"beside {row.beside}, {threads} thread(s), tile {row.tile:,} ({rule}): "
                         f"{rate / 1e9:.2f} G params/s")
                rows.append(row)
    return rows


def markdown(rows: list[HostAdamRow]) -> str:
    lines = ["| beside | update threads | tile (elements) | tile rule | G params/s |", "|---|---:|---:|---|---:|"]
    for r in rows:
        lines.append(f"| {r.beside} | {r.threads} | {r.tile:,} | {r.tile_rule} | {r.params_per_s / 1e9:.2f} |")
    return "\n".join(lines)
