"""ChunkedAdam: the user's Adam/AdamW, run per chunk where that chunk's state lives.

The hyper-parameters are read from the user's optimizer's param groups at every step (so a
learning-rate schedule that edits them works), and the update is torch's own Adam functional:
fused on the CPU for host chunks, fused on the GPU for device chunks. With Deep Optimizer States
(`dos_gap=k`), every k-th host chunk is copied to the compute device, updated there, and copied
back. A parameter that received no gradient since the last `zero_grad` is not updated and its
step count does not advance, exactly as torch skips parameters whose `.grad` is None.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Optional

import torch
from torch.optim.adam import adam as adam_functional

from elixir_ray.engine.chunks import Chunk, ChunkStore, ParamSlot
from elixir_ray.engine.pool import ChunkPool

SUPPORTED = (torch.optim.AdamW, torch.optim.Adam)


def check_optimizer(optimizer) -> None:
    if not isinstance(optimizer, SUPPORTED):
        raise TypeError(f"elixir_ray.wrap supports torch.optim.AdamW and torch.optim.Adam, "
                        f"got {type(optimizer).__name__}")
    for group in optimizer.param_groups:
        for key in ("amsgrad", "maximize"):
            if group.get(key):
                raise TypeError(f"elixir_ray.wrap does not support {type(optimizer).__name__}({key}=True)")


class DynamicLossScale:
    """fp16 loss scaling: halve on overflow (and skip the step), double after `interval` clean steps."""

    def __init__(self, init: float = 2.0**16, interval: int = 2000):
        self.scale, self.interval, self.clean = init, interval, 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale, self.clean = max(self.scale / 2, 1.0), 0
        else:
            self.clean += 1
            if self.clean % self.interval == 0:
                self.scale *= 2


class ChunkedAdam:
    def __init__(self, base: torch.optim.Optimizer, store: ChunkStore, pool: ChunkPool, slots: list[ParamSlot],
                 max_grad_norm: Optional[float], dos_gap: int, loss_scale: Optional[DynamicLossScale]):
        self.base, self.store, self.pool, self.slots = base, store, pool, slots
        self.max_grad_norm, self.dos_gap, self.loss_scale = max_grad_norm, dos_gap, loss_scale
        self.decoupled = isinstance(base, torch.optim.AdamW)
        group_of = {id(p): i for i, g in enumerate(base.param_groups) for p in g["params"]}
        for s in slots:
            s.group = group_of.get(id(s.param), -1)  # -1: not in the optimizer, never updated
        self.last_grad_norm: Optional[float] = None
        self.skipped_steps = 0

    @property
    def param_groups(self):
        return self.base.param_groups

    @property
    def defaults(self):
        return self.base.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        for c in self.store.chunks:
            c.grad = None
        for s in self.slots:
            s.has_grad = False

    def _grad_norm_sq(self) -> float:
        """Sum of squared gradients over the whole model: sharded parts add up across ranks."""
        local = torch.zeros(2, dtype=torch.float64)
        for c in self.store.chunks:
            if c.grad is None:
                continue
            sq = float(c.grad.double().pow(2).sum())
            local[0 if c.sharded else 1] += sq
        total = self.store.comm.all_reduce_sum(local[:1].clone())
        return float(total[0] + local[1])  # replicated chunks: every rank holds the same full gradient

    def _overflow(self) -> bool:
        bad = any(c.grad is not None and not torch.isfinite(c.grad).all() for c in self.store.chunks)
        return bool(self.store.comm.all_reduce_max(torch.tensor([float(bad)]))[0] > 0)

    @torch.no_grad()
    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("elixir_ray's optimizer does not take a closure")
        self.store.wait_for_copies()  # host gradients were copied asynchronously; read them only once landed
        scale = 1.0
        if self.loss_scale is not None:
            scale = self.loss_scale.scale  # the scale this step's backward ran with
            overflow = self._overflow()
            self.loss_scale.update(overflow)
            if overflow:
                self.skipped_steps += 1
                self.pool.reset()
                return
        if scale != 1.0:
            for c in self.store.chunks:
                if c.grad is not None:
                    c.grad.div_(scale)
        if self.max_grad_norm is not None:
            norm = math.sqrt(self._grad_norm_sq())
            self.last_grad_norm = norm
            coef = min(1.0, self.max_grad_norm / (norm + 1e-6))
            if coef < 1.0:
                for c in self.store.chunks:
                    if c.grad is not None:
                        c.grad.mul_(coef)
        host_index = 0
        for c in self.store.chunks:
            on_device = c.placement == "device"
            if not on_device:
                via_device = self.dos_gap > 0 and host_index % self.dos_gap == self.dos_gap - 1
                host_index += 1
            else:
                via_device = False
            if c.grad is not None:
                self._update_chunk(c, via_device)
        self.pool.reset()  # compute copies are stale now

    def _update_chunk(self, c: Chunk, via_device: bool) -> None:
        """Timed as "cpu_adam" for a host chunk, "device_adam" for a device or DOS chunk (its copies included).

        By the plan's placement, not the tensor's device, so a CPU-only run reports the same split.
        """
        on_host = c.placement == "host" and not via_device
        with self.store.timer.region("cpu_adam" if on_host else "device_adam"):
            self._update_chunk_untimed(c, via_device)

    def _update_chunk_untimed(self, c: Chunk, via_device: bool) -> None:
        if c.exp_avg is None:
            c.exp_avg = torch.zeros_like(c.master)
            c.exp_avg_sq = torch.zeros_like(c.master)
        if via_device:  # Deep Optimizer States: this host chunk's update runs on the compute device
            dev = self.store.device
            master, grad = c.master.to(dev, non_blocking=True), c.grad.to(dev, non_blocking=True)
            m, v = c.exp_avg.to(dev, non_blocking=True), c.exp_avg_sq.to(dev, non_blocking=True)
            if dev.type == "cpu":  # the same arithmetic on separate buffers, as on a GPU
                master, grad, m, v = master.clone(), grad.clone(), m.clone(), v.clone()
            self._adam(c, master, grad, m, v)
            c.master.copy_(master)
            c.exp_avg.copy_(m)
            c.exp_avg_sq.copy_(v)
        else:
            self._adam(c, c.master, c.grad, c.exp_avg, c.exp_avg_sq)

    def _adam(self, c: Chunk, master, grad, exp_avg, exp_avg_sq) -> None:
        """One fused Adam call per (param group, step count) over the slices of this chunk's shard."""
        batches = defaultdict(list)
        for slot, lo, hi in c.segments():
            if slot.group < 0 or not slot.has_grad or not slot.param.requires_grad:
                continue
            batches[(slot.group, slot.step)].append((slot, lo, hi))
        for (gi, step), segs in batches.items():
            group = self.param_groups[gi]
            beta1, beta2 = group["betas"]
            steps = [torch.tensor(float(step), dtype=torch.float32, device=master.device) for _ in segs]
            adam_functional(
                [master[lo:hi] for _, lo, hi in segs], [grad[lo:hi] for _, lo, hi in segs],
                [exp_avg[lo:hi] for _, lo, hi in segs], [exp_avg_sq[lo:hi] for _, lo, hi in segs], [], steps,
                fused=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
                decoupled_weight_decay=group.get("decoupled_weight_decay", self.decoupled),
            )
        for slot in c.slots:  # every rank counts every parameter's steps, whichever ranks hold its slices
            if slot.group >= 0 and slot.has_grad and slot.param.requires_grad:
                slot.step += 1
