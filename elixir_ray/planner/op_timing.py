"""Time a traced step's kernels on the real device: the compute part of the predicted step.

The meta trace lists every distinct kernel call of one training step with its shapes and count
(`elixir_ray.engine.op_record`). Each distinct call is run here a few times on the device with
tensors of those shapes, filled with small random values as training's are (a GPU can draw less
power on constant operands and hold higher clocks than in training; on the H100 the replay came
out 19% under a measured plain step of gpt-4b while its tensors were constant), in batches of
about 10 ms on a GPU, and its median time is multiplied by its count. A GPT has a few dozen
distinct calls however many layers it has, so this takes seconds, and it sees what FLOPs cannot:
memory-bound kernels (norms, activations, casts, the loss) and how close each matmul shape gets to
the peak.

Attention is timed through `F.scaled_dot_product_attention`, so that the device picks the kernel
it would pick in training (flash attention on a GPU), forward and backward apart. A call that
cannot be replayed (an operator the device lacks, tensors too big for `max_bytes`, FLOPs of over
`LONG_CALL_S` at the matmul rate) is estimated from its FLOPs at the measured matmul rate, or its
bytes at the measured device copy rate, and named in `ComputeTimes.estimated`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from elixir_ray.engine.op_record import ATTENTION_BACKWARD, ATTENTION_FORWARD, OpCall, TensorSpec, call_key
from elixir_ray.planner.hardware import HardwareProfile, device_name


@dataclass
class ComputeTimes:
    """Seconds of kernels in one micro-step, measured on `device`."""

    device: str
    forward_seconds: float
    step_seconds: float  # forward, recomputation and backward
    timed: int  # distinct calls replayed
    estimated: list[str] = field(default_factory=list)  # distinct calls estimated instead (operator names)


# A call whose FLOPs at the matmul rate come to more than this is estimated, not replayed: its
# replay (a warm-up and several timed runs) would take minutes (attention at a sequence of 100k on a
# CPU), and at that size it is bound by its arithmetic, which the estimate counts. A call whose
# first run takes longer anyway is timed by one more run alone.
LONG_CALL_S = 0.5


def device_is_here(hardware: HardwareProfile) -> bool:
    """Whether this process can run kernels on the device `hardware` describes: the same device,
    of the same name (a profile from another machine, or without a name, is not timed here)."""
    d = torch.device(hardware.device)
    if d.type == "cuda":
        if not torch.cuda.is_available() or (d.index or 0) >= torch.cuda.device_count():
            return False
    elif d.type != "cpu":
        return False
    return bool(hardware.device_name) and hardware.device_name == device_name(d)


def time_ops(ops: list[OpCall], hardware: HardwareProfile, max_bytes: Optional[int] = None,
             cache: Optional[dict] = None, repeats: int = 3) -> ComputeTimes:
    """Replay each distinct call on `hardware.device`; `cache` (key -> seconds) is shared across traces."""
    device = torch.device(hardware.device)
    cache = {} if cache is None else cache
    copy_rate = None
    forward = total = 0.0
    timed, estimated = 0, []
    for call in ops:
        key = call_key(call)
        if key not in cache:
            seconds = None
            at_matmul = call.flops / (hardware.matmul_tflops * 1e12)  # its estimate, where it has FLOPs
            if (max_bytes is None or call.bytes <= max_bytes) and not at_matmul > LONG_CALL_S:
                seconds = _replay(call, device, repeats)
            if seconds is None:
                if not call.flops and copy_rate is None:
                    copy_rate = _device_copy_rate(device)
                seconds = at_matmul if call.flops else call.bytes / copy_rate
                cache[key] = (seconds, False)
            else:
                cache[key] = (seconds, True)
        seconds, replayed = cache[key]
        if replayed:
            timed += 1
        else:
            estimated.append(call.op)
        forward += seconds * call.forward_count
        total += seconds * call.count
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ComputeTimes(device=str(device), forward_seconds=forward, step_seconds=total, timed=timed,
                        estimated=estimated)


def kernel_table(cache: dict) -> dict:
    """{call key: [seconds, replayed]} from `time_ops`'s cache: what a worker sends the driver."""
    return {key: [seconds, replayed] for key, (seconds, replayed) in cache.items()}


def compute_from_table(ops: list[OpCall], table: dict, device: str) -> Optional[ComputeTimes]:
    """The step's kernel seconds from times measured elsewhere (the workers'), or None when any of
    its calls was not measured (another micro-batch, say): then the whole plan uses FLOPs, so that
    no setting is costed one way and another setting the other."""
    if any(call_key(call) not in table for call in ops):
        return None
    forward = sum(table[call_key(c)][0] * c.forward_count for c in ops)
    total = sum(table[call_key(c)][0] * c.count for c in ops)
    estimated = [c.op for c in ops if not table[call_key(c)][1]]
    return ComputeTimes(device=device, forward_seconds=forward, step_seconds=total, timed=len(ops) - len(estimated),
                        estimated=estimated)


def _tensor(spec: TensorSpec, device: torch.device, requires_grad: bool = False) -> torch.Tensor:
    """A tensor of the spec's shape, strides and dtype; strides that overlap (0 for an expanded
    dimension) share one filled storage."""
    numel = 1
    for s in spec.shape:
        numel *= s
    extent = 1 + sum((n - 1) * st for n, st in zip(spec.shape, spec.stride)) if numel else 0
    base = torch.empty(extent, dtype=spec.dtype, device=device)
    if spec.dtype.is_floating_point or spec.dtype.is_complex:
        try:  # seeded apart from the caller's random state
            base.normal_(0.0, 0.02, generator=torch.Generator(device=device).manual_seed(0))
        except (RuntimeError, NotImplementedError):  # a dtype without a random fill (float8)
            base.fill_(0.01)
    elif spec.dtype == torch.bool:
        base.fill_(True)
    else:
        base.zero_()
    t = base.as_strided(spec.shape, spec.stride)
    return t.requires_grad_() if requires_grad else t


def _materialise(value, device: torch.device):
    return tree_map(lambda x: _tensor(x, device) if isinstance(x, TensorSpec)
                    else device if isinstance(x, str) and x == "DEVICE" else x, value)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Seconds per call of `fn` run back to back, as a step's kernels run (launches overlap the
    device's work; one sync per batch, not per call): the median of `repeats` batches."""
    start = time.perf_counter()
    fn()  # warm-up: first-call setup and allocator growth are not the step's cost
    _sync(device)
    first = time.perf_counter() - start
    if first > LONG_CALL_S:  # one more run, without the first's setup, is enough for so long a call
        start = time.perf_counter()
        fn()
        _sync(device)
        return min(first, time.perf_counter() - start)
    start = time.perf_counter()
    fn()
    _sync(device)
    once = time.perf_counter() - start
    # a batch of about 2 ms, so that a sync costs little; 10 ms on a GPU, whose clocks a busy step
    # holds lower than a short burst finds them
    target = 10e-3 if device.type == "cuda" else 2e-3
    batch = max(1, min(250, int(target / max(once, 1e-7))))
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        _sync(device)
        times.append((time.perf_counter() - start) / batch)
    return statistics.median(times)


def _operator(name: str):
    namespace, rest = name.split("::")
    op, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload or "default")


def _replay(call: OpCall, device: torch.device, repeats: int) -> Optional[float]:
    try:
        name = call.op.split(".")[0]
        if name in ATTENTION_FORWARD or name in ATTENTION_BACKWARD:
            return _attention_seconds(call, device, repeats)
        func = _operator(call.op)
        args, kwargs = _materialise(call.args, device), _materialise(call.kwargs, device)
        if name == "aten::_grouped_mm":
            args, kwargs = _even_groups(args, kwargs)
        with torch.no_grad():
            return _median_seconds(lambda: func(*args, **kwargs), device, repeats)
    except Exception:  # an operator this device lacks, arguments it refuses, no memory: estimated instead
        return None
    finally:
        if device.type == "cuda":
            try:
                torch.cuda.synchronize(device)
            except Exception:  # a failed kernel's error surfaces here; the call is estimated
                pass


def _even_groups(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A grouped matmul's offsets, which the trace keeps only the shape of, as an even split of the
    grouped dimension: made of zeros, every group would be empty and the kernel would do no work.
    (A real router's split is uneven; the total work is the same.)"""
    args, kwargs = list(args), dict(kwargs)
    offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
    if offs is None:
        return tuple(args), kwargs
    a = args[0]
    total = a.shape[1] if a.dim() == 2 and args[1].dim() == 2 else a.shape[0]
    groups = offs.numel()
    even = torch.tensor([total * (g + 1) // groups for g in range(groups)], dtype=offs.dtype, device=offs.device)
    if "offs" in kwargs:
        kwargs["offs"] = even
    else:
        args[2] = even
    return tuple(args), kwargs


def _attention_seconds(call: OpCall, device: torch.device, repeats: int) -> float:
    """Forward or backward of `F.scaled_dot_product_attention` as the device runs it in training."""
    schema = _operator(call.op)._schema
    named = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    named.update({a.name: v for a, v in zip(schema.arguments, call.args)})
    named.update(call.kwargs)
    q, k, v = (_tensor(named[n], device, requires_grad=True) for n in ("query", "key", "value"))
    bias = named.get("attn_bias")
    mask = _tensor(bias, device) if isinstance(bias, TensorSpec) else None
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}

    def forward():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=named.get("dropout_p", 0.0),
                                              is_causal=named.get("is_causal", False), scale=named.get("scale"),
                                              **gqa)

    if call.op.split(".")[0] in ATTENTION_FORWARD:
        return _median_seconds(forward, device, repeats)
    out = forward()
    grad = torch.empty_like(out).normal_(0.0, 0.02, generator=torch.Generator(device=device).manual_seed(1))
    return _median_seconds(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True), device, repeats)


def _device_copy_rate(device: torch.device) -> float:
    """Bytes per second a device-local copy moves (read plus write), for calls that cannot be replayed."""
    n = (64 if device.type == "cuda" else 16) * 2**20
    a = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    b = torch.empty_like(a)
    return 2 * n / _median_seconds(lambda: b.copy_(a), device, 3)
