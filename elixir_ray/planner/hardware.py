"""Hardware rates measured where a rank runs; the planner's cost model is built from them.

Measured, never hard-coded: the same code on a laptop, an H100 box or a CI VM gives the rates
that the plan for that machine must use. Each measurement takes well under a second or two.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from elixir_ray.engine.adam_step import AdamCall, AdamTensors
from elixir_ray.engine.device import resolve_device
from elixir_ray.engine.host_memory import HostArena
from elixir_ray.engine.host_updates import update_threads
from elixir_ray.engine.optimizer import TileScratch, host_update, run_adam
from elixir_ray.host_ram import available_host_bytes


@dataclass
class HardwareProfile:
    device: str
    h2d_gbps: float  # pinned host -> device copy, GB/s (host memcpy when the device is the CPU)
    d2h_gbps: float
    cpu_adam_params_per_s: float  # the engine's CPU AdamW (torch's fused kernel) on its update thread's threads
    device_adam_params_per_s: float
    matmul_tflops: float  # in the compute dtype
    cpu_threads: int
    collective_gbps: float = 0.0  # between ranks, when measured (0: the planner assumes the h2d rate)
    device_name: str = ""  # e.g. "NVIDIA H100 80GB HBM3": kernels are timed only on a device of this name
    # the same update from bf16 gradients, widened a tile at a time (Plan.host_grads_low): one more
    # pass and twice the parallel regions, so it need not run at the fp32 rate; 0: not measured
    # (a profile from an older version), taken as cpu_adam_params_per_s
    cpu_adam_low_grad_params_per_s: float = 0.0
    # the share of those rates the CPU job keeps while pinned copies run both ways, as the engine's
    # chunk loads and gradient copies run beside its updates (on the H100 machine the job alone ran
    # at 3.1 G params/s and inside training at 2.0 to 2.5 G); measured on a GPU, 0: not measured
    # (a CPU device, or a profile from an older version), taken as 1
    cpu_adam_beside_copies: float = 0.0
    # GB/s each way of pinned copies running both ways at once while the CPU AdamW job runs, as a
    # step's loads, gradient copies and Deep Optimizer States copies run beside the background
    # updates: the link and the host's memory are shared, so each direction gets less than alone
    # (on the H100 the DOS copies ran at about half the one-way rate inside training); 0: not measured
    copies_beside_cpu_adam_gbps: float = 0.0
    # the host RAM available where it was measured, bytes: what a plan for that machine bounds its
    # host-side optimizer state by (HOST_FRACTION of it) unless a host limit is given; 0: not recorded
    # (a profile from an older version, or written by hand)
    host_memory_free: int = 0

    def __post_init__(self):
        """A profile is often hand-edited JSON: a rate that is not a positive number would plan with a
        zero division or a negative time, so it is refused here, by name."""
        for name in ("h2d_gbps", "d2h_gbps", "cpu_adam_params_per_s", "device_adam_params_per_s", "matmul_tflops",
                     "cpu_threads", "collective_gbps", "cpu_adam_low_grad_params_per_s", "cpu_adam_beside_copies",
                     "copies_beside_cpu_adam_gbps", "host_memory_free"):
            value = getattr(self, name)
            optional = name in ("collective_gbps", "cpu_adam_low_grad_params_per_s", "cpu_adam_beside_copies",
                                "copies_beside_cpu_adam_gbps", "host_memory_free")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0 or (value == 0 and not optional):
                raise ValueError(f"{name} must be a {'non-negative' if optional else 'positive'} number, got {value!r}")
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"device must name a torch device such as 'cuda' or 'cpu', got {self.device!r}")

    def cpu_adam_rate(self, low_grads: bool) -> float:
        """Parameters per second the CPU updates from fp32 gradients, or from bf16 ones, with the
        device's copies running beside it (`cpu_adam_beside_copies`, where measured)."""
        rate = self.cpu_adam_params_per_s
        if low_grads and self.cpu_adam_low_grad_params_per_s > 0:
            rate = self.cpu_adam_low_grad_params_per_s
        return rate * (self.cpu_adam_beside_copies or 1.0)

    def link_rates(self) -> tuple[float, float]:
        """GB/s (host->device, device->host) that a step's copies are costed at: each way's own rate,
        or, where measured, no more than what each way kept while copies ran both ways beside the
        CPU AdamW job (`copies_beside_cpu_adam_gbps`), as they do in training."""
        beside = self.copies_beside_cpu_adam_gbps
        if beside > 0:
            return min(self.h2d_gbps, beside), min(self.d2h_gbps, beside)
        return self.h2d_gbps, self.d2h_gbps

    def rates(self) -> str:
        """One line of the rates a prediction rests on, for a plan's notes: set beside a run's
        measurements, it tells a wrong rate from a wrong model."""
        low = (f" ({self.cpu_adam_low_grad_params_per_s / 1e9:.2f} G from bf16 gradients)"
               if self.cpu_adam_low_grad_params_per_s > 0 else "")
        return (f"rates ({self.device_name or self.device}): host->device {self.h2d_gbps:.1f} GB/s, "
                f"device->host {self.d2h_gbps:.1f} GB/s, CPU AdamW {self.cpu_adam_params_per_s / 1e9:.2f} G "
                f"params/s{low} ({self.cpu_threads} CPU threads"
                + (f"; x{self.cpu_adam_beside_copies:.2f} beside copies" if self.cpu_adam_beside_copies else "")
                + ")"
                + (f", copies both ways beside it {self.copies_beside_cpu_adam_gbps:.1f} GB/s each"
                   if self.copies_beside_cpu_adam_gbps else "")
                + ", device AdamW "
                f"{self.device_adam_params_per_s / 1e9:.1f} G params/s, matmul {self.matmul_tflops:.3g} TFLOPS"
                + (f", between ranks {self.collective_gbps:.1f} GB/s" if self.collective_gbps else ""))

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "HardwareProfile":
        return cls(**json.loads(text))

    @classmethod
    def slowest(cls, profiles: list["HardwareProfile"]) -> "HardwareProfile":
        """The rates a plan for all of these ranks must assume: the minimum of each."""
        return cls(
            device=profiles[0].device,
            **{k: min(getattr(p, k) for p in profiles) for k in (
                "h2d_gbps", "d2h_gbps", "cpu_adam_params_per_s", "device_adam_params_per_s", "matmul_tflops",
                "cpu_adam_low_grad_params_per_s")},
            cpu_threads=min(p.cpu_threads for p in profiles),
            collective_gbps=min(p.collective_gbps for p in profiles),
            cpu_adam_beside_copies=min((p.cpu_adam_beside_copies for p in profiles if p.cpu_adam_beside_copies),
                                       default=0.0),
            copies_beside_cpu_adam_gbps=min((p.copies_beside_cpu_adam_gbps for p in profiles
                                             if p.copies_beside_cpu_adam_gbps), default=0.0),
            device_name=profiles[0].device_name if len({p.device_name for p in profiles}) == 1 else "",
            host_memory_free=min((p.host_memory_free for p in profiles if p.host_memory_free), default=0),
        )


def slowest_nodes(profiles: list[HardwareProfile], nodes: list[str],
                  compute_seconds: Optional[list[float]] = None) -> Optional[dict[str, str]]:
    """Per rate a plan is costed at (`HardwareProfile.slowest`), the node of the rank that measured
    the slowest (the first such): where the ranks span several nodes, for a plan to name the node
    that bounds its step (`planner.bounds`); None on one node, and without a rate that is the
    slowest on every node alike. "compute": the rank whose kernels took longest (`compute_seconds`,
    per rank), else the one of the lowest matmul rate."""
    if len(set(nodes)) < 2:
        return None
    rates = {rate: [getattr(p, rate) for p in profiles]
             for rate in ("h2d_gbps", "d2h_gbps", "cpu_adam_params_per_s", "device_adam_params_per_s")}
    rates["compute"] = ([-s for s in compute_seconds] if compute_seconds
                        else [p.matmul_tflops for p in profiles])  # lower is slower, as for the rates
    return {rate: nodes[values.index(min(values))] for rate, values in rates.items()
            if len({nodes[i] for i, v in enumerate(values) if v == min(values)}) < len(set(nodes))}


def device_name(device: torch.device) -> str:
    """What the device is: the GPU's name, or the CPU's model (so that rates and kernel times
    measured elsewhere are not mixed with this machine's)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def median_seconds(fn, device: torch.device, repeats: int, before=None) -> float:
    """Median seconds of `repeats` calls after a warm-up: one slow moment of a shared machine (a
    VM's neighbour, another rank's update) does not set the rate a whole plan is costed at.
    `before`, when given, runs ahead of each call, untimed."""
    times = []
    for i in range(repeats + 1):
        if before is not None:
            before()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _adam_call(numel: int) -> AdamCall:
    return AdamCall(segments=((0, numel),), step=1, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                    decoupled=True)


# device updates per timing: a step queues its device chunks' updates on the stream back to back
DEVICE_ADAM_CALLS = 8


def _adam_rate(device: torch.device, numel: int) -> float:
    """The engine's update (`run_adam`) of one device chunk's shard of `numel` fp32 parameters, as a
    step runs it: `DEVICE_ADAM_CALLS` of them queued back to back between two syncs. Timed one at a
    time, each with a sync of its own, the 16M parameters `quick_hardware` takes (about 0.2 ms of
    device time on an H100) measured 28 to 71 G params/s in the bench's processes, 32 to 56 G in
    three of them on one H100 (2026-11-27), where the same update of 64M measured 86.9 G and torch's fused
    AdamW 89 G (the anchors): the launch and the sync, not the device. Device chunks' updates and the
    engine's own kernels are costed at this rate, on the compute stream."""
    master, avg, avg_sq, grad = (torch.zeros(numel, device=device) for _ in range(4))
    call = _adam_call(numel)

    def updates():
        for _ in range(DEVICE_ADAM_CALLS):
            run_adam([call], master, grad, avg, avg_sq)

    return numel * DEVICE_ADAM_CALLS / median_seconds(updates, device, repeats=3)


class HostChunkState:
    """One host chunk's state as the engine keeps it: fp32 master and moments, the gradient in
    `grad_dtype` and, where `upload_dtype` is narrower than fp32, the upload copy, in a
    `HostArena` (page-locked for `pin_for` when that is a GPU). For timing the engine's job."""

    def __init__(self, numel: int, grad_dtype: torch.dtype, upload_dtype: Optional[torch.dtype],
                 pin_for: torch.device):
        low = upload_dtype is not None and upload_dtype != torch.float32
        sizes: dict = {torch.float32: 3 * numel}
        for dtype in [grad_dtype] + ([upload_dtype] if low else []):
            sizes[dtype] = sizes.get(dtype, 0) + numel
        self.arena = HostArena(sizes, pin_for)
        self.master, self.avg, self.avg_sq = (self.arena.take(numel, torch.float32) for _ in range(3))
        self.grad = self.arena.take(numel, grad_dtype)
        self.grad.fill_(1e-3)
        self.upload = self.arena.take(numel, upload_dtype) if low else None

    def update(self, call: AdamCall, scratch: TileScratch, kernel="auto") -> None:
        """The engine's job over this state (`host_update`; `kernel` as there: the one-pass C kernel
        where it builds, or None for torch's passes)."""
        host_update([call], AdamTensors(self.master, self.grad, self.avg, self.avg_sq, self.upload), scratch=scratch,
                    kernel=kernel)


class PinnedCopies:
    """Pinned host-to-device and device-to-host copies of `elements` bf16 values each way (256 MiB
    by default), back to back on two streams of their own, on a thread, while the context is open:
    the host memory traffic of the engine's chunk loads and gradient copies, beside which its CPU
    updates run. The device holds both buffers, so a caller bounded by a budget sizes them."""

    def __init__(self, device: torch.device, elements: int = 128 << 20):
        self.device, self.elements = device, elements
        self.rounds, self.seconds = 0, 0.0  # rounds of one copy each way, and the time they took
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._error: list = []

    def _run(self) -> None:
        try:
            torch.cuda.set_device(self.device)
            n = self.elements
            host_in = torch.empty(n, dtype=torch.bfloat16).pin_memory()
            host_out = torch.empty(n, dtype=torch.bfloat16).pin_memory()
            dev_in = torch.empty(n, dtype=torch.bfloat16, device=self.device)
            dev_out = torch.empty(n, dtype=torch.bfloat16, device=self.device)
            up, down = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)
            self._started.set()
            start = time.perf_counter()
            while not self._stop.is_set():
                with torch.cuda.stream(up):
                    dev_in.copy_(host_in, non_blocking=True)
                with torch.cuda.stream(down):
                    host_out.copy_(dev_out, non_blocking=True)
                up.synchronize()
                down.synchronize()
                self.rounds += 1
                self.seconds = time.perf_counter() - start
        except BaseException as exc:  # re-raised on the measuring thread
            self._error.append(exc)
            self._started.set()

    def __enter__(self):
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elixir-profile-copies", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error:
            raise self._error[0]
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        if self._error and exc[0] is None:
            raise self._error[0]
        return False

    def gbps_each_way(self) -> float:
        """GB/s each way over the rounds that finished while the context was open (0.0 if none)."""
        bytes_each_way = self.rounds * self.elements * torch.bfloat16.itemsize
        return bytes_each_way / self.seconds / 1e9 if self.rounds and self.seconds > 0 else 0.0


MIN_COPY_ROUND_BYTES = 16 * 2**20  # each way per round, for PinnedCopies' rate to be a link's rate
# timed updates per CPU AdamW rate (after one warm-up). In training on the H100 machine one run's
# updates of the same chunk size spread about 15% either side of their median (10th to 90th
# percentile), and with 3 timed updates one profile's rates from fp32 and from bf16 gradients, whose
# kernels differ by a few percent, came out up to 1.49x apart (2026-11-27): the rate a plan is costed
# at was then as much noise as measurement. 9 cost about 1 s more per profile there (128M parameters).
HOST_UPDATE_REPEATS = 9


def _host_update_rate(numel: int, grad_dtype: torch.dtype, upload_dtype: Optional[torch.dtype],
                      pin_for: torch.device, beside_copies: bool = False,
                      copy_bytes: int = 256 * 2**20) -> tuple[float, float, float]:
    """The background thread's whole job for one host chunk of `numel` parameters, as the engine
    runs it (`HostChunkState`, `host_update`). The update alone over small fresh tensors ran at
    4.0 to 4.3 G params/s on one H100 machine while the engine's jobs ran at 2.0 to 2.5 G
    (2026-11-26): the plan must be costed at the rate of what really runs.
    Returns (alone, beside copies, copies' GB/s each way beside it): the second with `PinnedCopies`
    running (0.0 unless asked), its two device buffers `copy_bytes` together, as the profile's own
    copies take; the third what those copies kept meanwhile, which the step's copies are costed at."""
    state = HostChunkState(numel, grad_dtype, upload_dtype, pin_for)
    call, scratch = _adam_call(numel), TileScratch()  # the scratch kept between updates, as the engine keeps it

    def rate() -> float:
        return numel / median_seconds(lambda: state.update(call, scratch), torch.device("cpu"),
                                      repeats=HOST_UPDATE_REPEATS)

    alone = rate()
    if not beside_copies:
        return alone, 0.0, 0.0
    with PinnedCopies(pin_for, elements=max(1, copy_bytes // 4)) as copies:
        beside = rate()
    # rounds of small copies time their syncs more than the link: such a rate would under-cost
    # every copy of a plan, so it counts as not measured
    link = copies.gbps_each_way() if copy_bytes // 2 >= MIN_COPY_ROUND_BYTES else 0.0
    return alone, beside, link


def _copy_rates(copy_bytes: int, device: torch.device) -> tuple[float, float]:
    """(host->device, device->host) GB/s of one copy of `copy_bytes`, from pinned host memory on a
    GPU; its buffers are freed on return, before the rates measured after it."""
    host = torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    h2d = copy_bytes / median_seconds(lambda: dev.copy_(host, non_blocking=True), device, repeats=5) / 1e9
    d2h = copy_bytes / median_seconds(lambda: host.copy_(dev, non_blocking=True), device, repeats=5) / 1e9
    return h2d, d2h


def profile_hardware(device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                     copy_bytes: int | None = None, adam_numel: int | None = None,
                     matmul_n: int | None = None, host_adam_numel: int | None = None) -> HardwareProfile:
    """Measure this rank's copy bandwidths, AdamW rates and matmul speed (`matmul_n`: the square
    matmul's side, 4096 on a GPU and 512 on the CPU by default). The CPU AdamW rates are those of
    the engine's host-chunk job over `host_adam_numel` parameters (on a GPU 128M by default, about
    a chunk of a 4B model and well past the CPU's caches; on a CPU `adam_numel`)."""
    device = resolve_device(device)
    on_gpu = device.type == "cuda"
    dtype = dtype or (torch.bfloat16 if on_gpu else torch.float32)
    copy_bytes = copy_bytes or (256 * 2**20 if on_gpu else 64 * 2**20)
    adam_numel = adam_numel or (64 * 2**20 if on_gpu else 4 * 2**20)
    h2d, d2h = _copy_rates(copy_bytes, device)
    threads = torch.get_num_threads()
    torch.set_num_threads(update_threads())  # as many as the engine's update thread takes
    try:
        host_numel = host_adam_numel or (128 * 2**20 if on_gpu else adam_numel)
        cpu_adam, _, _ = _host_update_rate(host_numel, torch.float32, dtype, device)
        # from bf16 gradients, as GPU plans update, also beside copies both ways: the share it keeps
        cpu_adam_low, beside, copies_beside = _host_update_rate(host_numel, torch.bfloat16, dtype, device,
                                                                beside_copies=on_gpu, copy_bytes=copy_bytes)
    finally:
        torch.set_num_threads(threads)
    dev_adam = _adam_rate(device, adam_numel) if on_gpu else cpu_adam
    n = matmul_n or (4096 if on_gpu else 512)
    gen = torch.Generator(device=device).manual_seed(0)  # leaves the caller's random state alone
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    tflops = 2 * n**3 / median_seconds(lambda: a @ b, device, repeats=5) / 1e12
    return HardwareProfile(device=str(device), h2d_gbps=h2d, d2h_gbps=d2h, cpu_adam_params_per_s=cpu_adam,
                           device_adam_params_per_s=dev_adam, matmul_tflops=tflops,
                           cpu_threads=torch.get_num_threads(), device_name=device_name(device),
                           cpu_adam_low_grad_params_per_s=cpu_adam_low,
                           cpu_adam_beside_copies=min(1.0, beside / cpu_adam_low) if beside else 0.0,
                           copies_beside_cpu_adam_gbps=copies_beside, host_memory_free=available_host_bytes())

