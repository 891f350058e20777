"""Chunks: flat fp32 master state per chunk, and the compute copy the parameters are views of.

Each chunk holds, for this rank, a shard (split among all ranks, or among the ranks of its node
when sharded within each node) or, when replicated, all of: the fp32 master weights,
the fp32 gradient and the AdamW moments, on the device, or on the host as slices of one arena
(page-locked when a GPU computes; host_memory.py). Its compute copy is one flat tensor in the compute dtype on the compute device; every
parameter in the chunk is a view of it. Freeing the copy shrinks its storage to zero and
fetching regrows and refills the same storage, so tensors autograd saved from the parameters
see the weights again after a refetch (weights do not change within a step).

A host chunk the plan keeps resident (`Chunk.stays_resident`) keeps its compute copy's storage
from wrap on, outside the pool's blocks: the pool never evicts it, and after an optimizer step it
is only marked stale (its parameters guarded as an evicted chunk's are) and filled again, in the
same storage, by its first access of the next step, as any load is (on CUDA a prefetch on the
copy stream, after its CPU update; gathered across ranks when sharded). So it is loaded once per
step, where a pooled chunk is loaded again for recompute and backward once evicted.

When the plan asks for upload copies, a host chunk computed in a lower precision also keeps
`upload`, its master already cast to the compute dtype (pinned), refreshed after every update: a
fetch then copies half the bytes of the fp32 master and needs no fp32 buffer on the device.

What may be in flight for a chunk, and everything that reads or writes its state waits for it
first (`settle`, `make_usable`): its CPU AdamW update on the background thread (`update`), and,
on CUDA, a prefetch of its compute copy on the copy stream (`ready`) and the copies of its state
back to the host after a Deep Optimizer States update (`landed`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn

from elixir_ray.chunk_plan.buffers import MAX_REDUCTIONS_IN_FLIGHT, staged_low
from elixir_ray.engine.comm import Comm, NodeComms
from elixir_ray.engine.host_memory import HostArena
from elixir_ray.engine.host_updates import HostUpdates
from elixir_ray.engine.param_guard import GradReads, guardable, mark_evicted
from elixir_ray.engine.timing import StepTimer, profiled


def _point_at(param: nn.Parameter, view: torch.Tensor) -> None:
    """Make `param` a view of the chunk's compute copy, keeping the Python object (optimizers hold it).

    `.data` can be re-pointed only within one device type; a meta or host parameter moving to
    another device has its tensor swapped underneath the same object instead.
    """
    if param.device.type == view.device.type and param.dtype == view.dtype:
        param.data = view
    else:
        swapped = nn.Parameter(view, requires_grad=param.requires_grad)
        swapped.__dict__.update(param.__dict__)  # swap_tensors swaps attribute dicts too: keep the user's tags
        torch.utils.swap_tensors(param, swapped)


def device_scope(device: torch.device):
    """A scope in which `device` is the thread's current CUDA device (nothing on a CPU).

    The caller's thread may have another current device (a new thread starts on device 0, as do a
    threaded Ray actor's pool threads), and a stream switch or event wait there would create a
    context on that device, about half a GiB on GPU 0 for every rank of a node.
    """
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


# Tensors are left out of these reprs: a parameter or compute copy whose chunk is evicted has no
# storage, and printing it would read freed memory.
@dataclass
class ParamSlot:
    name: str
    param: nn.Parameter = field(repr=False)
    chunk: int
    offset: int  # within the chunk, in elements
    numel: int
    shape: torch.Size
    group: int = 0  # optimizer param group
    step: int = 0  # AdamW updates applied to this parameter (loaded with the optimizer's state)
    changes: int = 0  # updates of its weight in this process, never loaded: see EngineHooks._on_output_grad
    has_grad: bool = False  # received a gradient since the last zero_grad (on any rank)
    had_grad: bool = False  # updated since the last zero_grad(set_to_none=True): torch would keep a zero .grad


@dataclass
class Chunk:
    index: int
    size: int  # padded elements, a multiple of the world size
    sharded: bool
    placement: str  # "host" or "device"
    # sharded among the ranks of each node only, whole on every node (`NodeComms`); with `sharded`
    node_sharded: bool = False
    slots: list[ParamSlot] = field(default_factory=list, repr=False)
    shard_start: int = 0  # this rank's first element
    shard_len: int = 0
    # fp32 [shard_len] each; grad is None until a gradient arrives, and again once a device chunk's
    # update has run in the backward (`grad_released`)
    master: Optional[torch.Tensor] = field(default=None, repr=False)
    grad: Optional[torch.Tensor] = field(default=None, repr=False)
    grad_buffer: Optional[torch.Tensor] = field(default=None, repr=False)  # host chunks: where grad lands
    exp_avg: Optional[torch.Tensor] = field(default=None, repr=False)
    exp_avg_sq: Optional[torch.Tensor] = field(default=None, repr=False)
    # compute dtype [size] on the compute device; the parameters are views of it
    compute: Optional[torch.Tensor] = field(default=None, repr=False)
    # host chunks in low precision (plan.upload_copies): the master cast to the compute dtype, pinned
    upload: Optional[torch.Tensor] = field(default=None, repr=False)
    # [size] on the compute device: gradients collected during backward, in `staging_dtype`
    staging: Optional[torch.Tensor] = field(default=None, repr=False)
    # fp32, but the compute dtype for a host chunk whose gradient goes down in it with one rank
    # (`staged_low`): nothing to widen, and no cast before the copy down
    staging_dtype: torch.dtype = torch.float32
    # ids of the slots whose gradient is in `staging`: a first gradient is copied in, not added to
    # zeros, and what no gradient wrote (padding, parameters without one) is zeroed at the reduction
    staged: set = field(default_factory=set, repr=False)
    pending: int = 0  # gradient-bearing slots still to report in this backward
    reduced: bool = True  # already reduced in the backward under way
    # its CPU AdamW update, queued or running on the background thread
    update: Optional[Future] = field(default=None, repr=False)
    updated: bool = False  # its update for the step under way has been started
    # device chunks: its gradient was applied during the backward and released then (updates in
    # backward, `ChunkedAdam._release_gradient`); cleared by zero_grad
    grad_released: bool = False
    # CUDA: its prefetch on the copy stream has finished; its gradient's copy to the host has landed
    ready: Optional[torch.cuda.Event] = field(default=None, repr=False)
    grad_ready: Optional[torch.cuda.Event] = field(default=None, repr=False)
    # CUDA, host chunks: the last copy out of its host master or upload copy has finished (a fetch
    # after its gradient was reduced is ordered after nothing the update waits for otherwise)
    host_read: Optional[torch.cuda.Event] = field(default=None, repr=False)
    # CUDA: its state's copies back to the host after a device update (Deep Optimizer States) have
    # landed, and its reads of the host state have finished: one event per DOS stream
    landed: Optional[tuple] = field(default=None, repr=False)
    # its compute copy has storage; kept by the ChunkStore beside every resize, since asking the
    # storage costs microseconds and the hooks ask for every op in forward. For a chunk that
    # `stays_resident`: its compute copy holds this step's weights (the storage is always there)
    resident: bool = False
    # a host chunk whose compute copy has device memory of its own, outside the pool's blocks
    # (Plan.resident): never evicted, filled once per step at its first use after the step's update
    stays_resident: bool = False
    # its parameters that refuse reads while it is not resident (param_guard.py)
    guarded: list = field(default_factory=list, repr=False)

    def segments(self):
        """(slot, lo, hi) for each slot's part inside this rank's shard, in shard coordinates."""
        for slot in self.slots:
            lo = max(slot.offset, self.shard_start)
            hi = min(slot.offset + slot.numel, self.shard_start + self.shard_len)
            if lo < hi:
                yield slot, lo - self.shard_start, hi - self.shard_start


class ChunkStore:
    """All chunks of one wrapped module, and the moves of their data.

    `timer` (a StepTimer, disabled by default) times fetches, reductions and optimizer updates
    when a benchmark sets `store.timer.enabled = True`; see elixir_ray/engine/timing.py.
    """

    def __init__(self, chunks: list[Chunk], comm: Comm, device: torch.device, dtype: torch.dtype,
                 upload_copies: bool = False, host_grads_low: bool = False, nodes: Optional[NodeComms] = None):
        self.chunks, self.comm, self.device, self.dtype = chunks, comm, device, dtype
        self.nodes = nodes  # the node and peer groups, where some chunk is sharded within each node
        # resident_loads: fills of the compute copies of chunks that stay resident (one each per step)
        self.counts = {"fetches": 0, "prefetches": 0, "evictions": 0, "reduces": 0, "blocks_over_plan": 0,
                       "untraced_accesses": 0, "prefetch_lead": 0, "resident_loads": 0}
        self.timer = StepTimer(device)
        self.updates = HostUpdates(self.timer, device)
        # CUDA side streams: prefetches host->device, and host chunks' gradient reductions device->host
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.reduce_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # and Deep Optimizer States updates, off the compute stream: (up, down), a tile's copies to the
        # device and its update on the first, its copies back on the second, so both directions run at once
        self.dos_streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if device.type == "cuda" else None
        self.reductions_in_flight: deque = deque()  # events of side-stream reductions not known to have landed
        self.accumulated_low = False  # a host gradient in the compute dtype got a second micro-step (warned)
        self.weights_version = 0  # counts changes to the masters (each load): see EngineHooks._on_output_grad
        self.grad_reads = GradReads()  # gradients held where a loop may look for them in .grad (param_guard.py)
        for c in chunks:
            if c.stays_resident and c.placement != "host":
                raise ValueError(f"chunk {c.index} stays resident but its state is on the {c.placement}: only a "
                                 f"host chunk's compute copy is kept on the device")
            if c.node_sharded and nodes is None:
                raise ValueError(f"chunk {c.index} is sharded within each node, and the store was given no node groups")
            shard_comm = self.shard_comm(c)
            c.shard_len = c.size // shard_comm.world if c.sharded else c.size
            c.shard_start = shard_comm.rank * c.shard_len if c.sharded else 0
        # host chunks' state (master, gradient, two moments, upload copy) in one page-locked arena;
        # the gradient in the compute dtype when the plan says so (see Plan.host_grads_low)
        host = [c for c in chunks if c.placement != "device"]
        low = dtype != torch.float32
        upload, grads_low = upload_copies and low, host_grads_low and low
        # the plan then also counts each device chunk's gradient as gone from zero_grad() to that
        # chunk's next backward (planner.search.gradients_freed): EngineHooks warns when it is not
        self.device_grads_freed = grads_low
        self.warned_grads_alive = False
        host_numel = sum(c.shard_len for c in host)
        sizes = {torch.float32: (3 if grads_low else 4) * host_numel}
        if upload or grads_low:
            sizes[dtype] = (int(upload) + int(grads_low)) * host_numel
        self.arena = HostArena(sizes, device)
        for c in chunks:
            if c.placement == "device":
                c.master = torch.zeros(c.shard_len, dtype=torch.float32, device=device)
            else:
                c.master, c.exp_avg, c.exp_avg_sq = (self.arena.take(c.shard_len, torch.float32) for _ in range(3))
                c.grad_buffer = self.arena.take(c.shard_len, dtype if grads_low else torch.float32)
                if staged_low(grads_low, comm.world):
                    c.staging_dtype = dtype
                if upload:
                    c.upload = self.arena.take(c.shard_len, dtype)
            c.compute = torch.empty(c.size, dtype=dtype, device=device)
            for s in c.slots:  # views first: a view cannot be made of an empty storage
                _point_at(s.param, c.compute[s.offset: s.offset + s.numel].view(s.shape))
            c.guarded = guardable([(s.param, s.name) for s in c.slots], self.grad_reads)
            self._set_resident(c, False)
        self.by_storage = {c.compute.untyped_storage()._cdata: c for c in chunks}

    def shard_comm(self, c: Chunk) -> Comm:
        """The ranks among which the chunk is split: its node's for a node-sharded chunk, else all."""
        return self.nodes.node if c.node_sharded else self.comm

    @property
    def stats(self) -> dict:
        """Counts of chunk moves, plus seconds per timed category while the timer is enabled.

        A fresh dict each call (what `ChunkedModule.engine_stats()` reports); counters live in `counts`.
        """
        out = dict(self.counts)
        if self.timer.enabled:
            out["seconds"] = self.timer.totals()
        return out

    def on_device(self):
        """A scope in which the engine's device is current (`device_scope`): its entry points run in it."""
        return device_scope(self.device)

    def wait_for_copies(self) -> None:
        """Block until the device has finished what was queued, gradient copies to the host included.

        A device-to-host copy with non_blocking=True returns before the data has arrived, so the
        host must not read host-placed gradients (norm, overflow check, CPU AdamW) before this.
        Every stream: a prefetch may still be reading a host master the CPU is about to update, and
        a Deep Optimizer States update's copies back may still be landing.
        """
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- work in flight ---------------------------------------------------------------------------

    @profiled("elixir.settle")
    def settle(self, c: Chunk) -> None:
        """Wait for the chunk's CPU update, if one is queued or running (re-raising its error), and for
        the copies back of a device update of its host state."""
        self._finish_update(c)
        if c.landed is not None:
            events, c.landed = c.landed, None
            for event in events:
                event.synchronize()

    def settle_all(self) -> None:
        """Every chunk's state final and every device copy landed: before reading or writing state wholesale."""
        for c in self.chunks:
            self.settle(c)
        self.wait_for_copies()

    def usable(self, c: Chunk) -> bool:
        """Its compute copy is there and filled, as far as the compute stream is concerned."""
        return c.ready is None and c.resident

    def make_usable(self, c: Chunk) -> None:
        """Order the compute stream after the chunk's prefetch (a no-op when none is pending); its
        parameters, guarded while the copy was pending, become plain ones."""
        if c.ready is not None:
            stream = torch.cuda.current_stream(self.device)
            self.timer.device_mark("load wait", stream, c.index)  # the two marks bracket the stream's stall
            stream.wait_event(c.ready)
            self.timer.device_mark("load waited", stream, c.index)
            c.ready = None
            mark_evicted(c.guarded, self.grad_reads.held)

    def refresh_upload(self, c: Chunk) -> None:
        """Recast the master into the compute-dtype upload copy, after the master changed."""
        if c.upload is not None:
            c.upload.copy_(c.master)

    def state_device(self, chunk: Chunk) -> torch.device:
        return self.device if chunk.placement == "device" else torch.device("cpu")

    def chunk_of(self, t: torch.Tensor) -> Optional[Chunk]:
        return self.by_storage.get(t.untyped_storage()._cdata)

    # -- compute copies -------------------------------------------------------------------------

    def _finish_update(self, c: Chunk) -> None:
        """Wait for the chunk's CPU update, if one is queued or running (re-raising its error)."""
        if c.update is not None:
            future, c.update = c.update, None
            self.updates.wait(future, c.index)

    def _settle_for_fill(self, c: Chunk, stream, stalls: bool = False) -> None:
        """What a fill needs before it reads the chunk's host copy: its CPU update finished (waited
        for here), and the copies back of a Deep Optimizer States update landed, which `stream` is
        made to wait for on the device: the training thread goes on queueing work meanwhile.
        `stalls`: `stream` is the compute stream, whose stall for the load starts here (its device
        mark, after the host's wait)."""
        self._finish_update(c)
        if stalls:
            self.timer.device_mark("load wait", stream, c.index)
        if c.landed is not None:  # only ever set on CUDA, where there is a stream to make wait
            for event in c.landed:  # kept for the host readers, who settle on them
                stream.wait_event(event)

    @profiled("elixir.fetch")
    def fetch(self, c: Chunk) -> None:
        """Fill the chunk's compute copy now, on the compute stream."""
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        # on the compute stream itself, all of it a stall: a Deep Optimizer States update's copies back included
        self._settle_for_fill(c, stream, stalls=True)
        with self.timer.region("h2d"):
            self._set_resident(c, True)
            try:
                self.timer.device_mark("load", stream, c.index)
                self._fill(c)
                for category in ("load done", "load waited"):
                    self.timer.device_mark(category, stream, c.index)
            except BaseException:
                self._unfill(c)
                raise
        self.counts["fetches"] += 1
        self.counts["resident_loads"] += c.stays_resident

    @profiled("elixir.prefetch")
    def prefetch(self, c: Chunk) -> None:
        """Fill the chunk's compute copy ahead of its use: on CUDA on the copy stream, else now.

        The block is allocated on the compute stream (so the allocator orders its reuse there) and
        the copy stream first waits for the compute stream, so it cannot write into memory an
        evicted chunk's kernels still read. `make_usable` orders the chunk's first use after it.
        """
        if self.copy_stream is None:
            self.fetch(c)
            self.counts["prefetches"] += 1
            return
        self._settle_for_fill(c, self.copy_stream)
        with self.timer.region("h2d"):
            self._set_resident(c, True)
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            try:
                with torch.cuda.stream(self.copy_stream):
                    self.timer.device_mark("load", self.copy_stream, c.index)
                    self._fill(c)
                    self.timer.device_mark("load done", self.copy_stream, c.index)
                    c.ready = torch.cuda.Event(blocking=True)  # a blocking wait sleeps instead of spinning a core
                    c.ready.record(self.copy_stream)
                # guarded until make_usable: a read outside the module's pre-hook (which makes it usable)
                # fetches through the guard, which waits for the copy (param_guard.py)
                mark_evicted(c.guarded, True)
            except BaseException:
                self._unfill(c)
                raise
        self.counts["fetches"] += 1
        self.counts["prefetches"] += 1
        self.counts["resident_loads"] += c.stays_resident

    def _unfill(self, c: Chunk) -> None:
        """After a fill that raised (out of memory for a staging buffer, a failed all-gather): the
        chunk is not resident, so the next access fetches it again instead of computing with a
        block that was never filled. What the fill queued finishes before the block is reused."""
        if self.copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
        c.ready = None
        self._set_resident(c, False)

    def _fill(self, c: Chunk) -> None:
        source = c.upload if c.upload is not None else c.master  # the compute dtype when there is one
        if c.sharded and self.shard_comm(c).world > 1:
            shard = source.to(self.device, non_blocking=True).to(self.dtype)
            self.shard_comm(c).all_gather(c.compute, shard)
        else:
            c.compute.copy_(source, non_blocking=True)
        if self.copy_stream is not None and source.device.type == "cpu":  # on the stream the copy ran on
            c.host_read = torch.cuda.Event(blocking=True)
            c.host_read.record(torch.cuda.current_stream(self.device))

    @profiled("elixir.evict")
    def free(self, c: Chunk) -> None:
        if c.resident:
            self.make_usable(c)  # a prefetch still writing must finish before the block is reused
            self._set_resident(c, False)
            self.counts["evictions"] += 1

    def free_all(self) -> None:
        for c in self.chunks:
            if c.resident:
                self.make_usable(c)
                self._set_resident(c, False)

    def _set_resident(self, c: Chunk, resident: bool) -> None:
        """Grow (refill next) or free the compute copy's storage; the chunk's parameters refuse reads
        while it is freed (param_guard.py). A chunk that stays resident keeps its storage: it is only
        marked stale (and its parameters refuse reads) until it is filled again."""
        if not c.stays_resident:
            c.compute.untyped_storage().resize_(c.size * c.compute.element_size() if resident else 0)
        c.resident = resident
        mark_evicted(c.guarded, not resident or self.grad_reads.held)

    def hold_gradients(self, held: bool) -> None:
        """Whether a loop reading `.grad` now looks for gradients the engine holds (GradReads): while
        so, every guarded parameter takes the guard's class, resident ones too."""
        if held == self.grad_reads.held:
            return
        self.grad_reads.held = held
        for c in self.chunks:
            if c.resident:
                mark_evicted(c.guarded, held or c.ready is not None)

    # -- gradients ------------------------------------------------------------------------------

    def add_grad(self, slot: ParamSlot, grad: torch.Tensor) -> Chunk:
        """Into the chunk's staging buffer (`Chunk.staging_dtype`): copied (widened to fp32 where
        it is fp32) at the slot's first gradient in it, added after; one pass over the gradient's
        bytes instead of a zero fill and an add."""
        c = self.chunks[slot.chunk]
        if c.staging is None:
            c.staging = torch.empty(c.size, dtype=c.staging_dtype, device=self.device)
            c.staged = set()
        part = c.staging[slot.offset: slot.offset + slot.numel]
        if id(slot) in c.staged:
            part.add_(grad.reshape(-1))
        else:
            part.copy_(grad.reshape(-1))
            c.staged.add(id(slot))
        return c

    def _zero_unstaged(self, c: Chunk, full: torch.Tensor) -> None:
        """Zero what no gradient wrote in the staging buffer (padding, parameters without a gradient
        in this backward): the reduction, the norm and the updates read the whole buffer."""
        end = 0
        for slot in c.slots:  # in offset order, as packed
            if id(slot) in c.staged:
                if slot.offset > end:
                    full[end:slot.offset].zero_()
                end = max(end, slot.offset + slot.numel)
        if end < c.size:
            full[end:].zero_()

    @profiled("elixir.reduce")
    def reduce(self, c: Chunk) -> None:
        """Average the chunk's gradient over ranks and add this rank's part to its gradient shard."""
        with self.timer.region("d2h"):
            self._reduce(c)
        self.counts["reduces"] += 1

    def _reduce(self, c: Chunk) -> None:
        self.settle(c)  # its gradient may still be read by last step's update
        if c.staging is not None:
            full = c.staging
            self._zero_unstaged(c, full)
        else:
            full = torch.zeros(c.size, dtype=torch.float32, device=self.device)
        c.staging = None  # `staged` is reset when the next buffer is made
        where = self.state_device(c)
        if where.type == "cpu" and self.reduce_stream is not None:
            # off the compute stream, so backward goes on while the gradient crosses to the host
            self.reduce_stream.wait_stream(torch.cuda.current_stream(self.device))  # the gradients are written
            full.record_stream(self.reduce_stream)  # not reused by the allocator before this stream is done
            with torch.cuda.stream(self.reduce_stream):
                self._reduce_into(c, full, where)
                c.grad_ready = torch.cuda.Event(blocking=True)  # the background update waits for this alone
                c.grad_ready.record(self.reduce_stream)
            # each reduction in flight holds its whole staging buffer on the device: at most MAX_REDUCTIONS_IN_FLIGHT,
            # as the planner budgets ("gradient staging"), so wait for the oldest when there are more
            self.reductions_in_flight.append(c.grad_ready)
            while len(self.reductions_in_flight) > MAX_REDUCTIONS_IN_FLIGHT:
                self.reductions_in_flight.popleft().synchronize()
        else:
            self._reduce_into(c, full, where)

    def _reduce_into(self, c: Chunk, full: torch.Tensor, where: torch.device) -> None:
        if self.comm.world > 1 and c.sharded:
            shard_comm = self.shard_comm(c)
            if shard_comm.world > 1:
                part = torch.empty(c.shard_len, dtype=torch.float32, device=self.device)
                shard_comm.reduce_scatter_mean(part, full)  # the mean over the node's ranks, for a node-sharded chunk
            else:
                part = full
            if c.node_sharded and self.nodes.peers.world > 1:
                self.nodes.peers.all_reduce_mean(part)  # then over the nodes: the mean over every rank
        else:
            if self.comm.world > 1:
                self.comm.all_reduce_mean(full)
            part = full
        if c.grad_buffer is not None and c.grad_buffer.dtype != part.dtype:
            # cast on the device, so half the bytes cross: with one micro-step per step each gradient
            # was computed in the compute dtype anyway (only sums over several uses are rounded again)
            part = part.to(c.grad_buffer.dtype)
        if (c.grad is not None and c.grad_buffer is not None and c.grad_buffer.dtype != torch.float32
                and not self.accumulated_low):
            self.accumulated_low = True
            warnings.warn(
                f"host chunks keep their gradients in {str(self.dtype).replace('torch.', '')} (the plan's "
                f"host_grads_low, chosen for one backward per step), but this step has several: they now "
                f"accumulate in that dtype on the host, and the device chunks' gradients stay on the device "
                f"from one backward to the next, which the plan's memory did not count. Pass "
                f"accumulation_steps=N to wrap, or plan with grad_accum=N, to keep them in float32 and the "
                f"device memory planned for it", stacklevel=2)
        if c.grad is None and c.grad_buffer is not None:
            # asynchronous to the host: readers wait for it (grad_ready, or wait_for_copies) first; a
            # previous step's update reading this buffer has finished (settled above)
            c.grad_buffer.copy_(part, non_blocking=True)
            c.grad = c.grad_buffer
        elif c.grad is None:
            c.grad = part  # a device chunk's gradient takes over the staging buffer
        else:
            # the host adds at once, so this copy (and the earlier one into c.grad) must have landed
            c.grad.add_(part.to(where, non_blocking=where.type != "cpu"))

    # -- whole tensors for state dicts ----------------------------------------------------------

    def full_master(self, c: Chunk) -> torch.Tensor:
        """The whole chunk's fp32 weights on the host (gathered from the ranks it is split among)."""
        return self.full_of(c, c.master)

    def full_of(self, c: Chunk, shard: Optional[torch.Tensor]) -> torch.Tensor:
        self.settle(c)
        if shard is None:
            shard = torch.zeros(c.shard_len, dtype=torch.float32)
        comm = self.shard_comm(c)
        if not (c.sharded and comm.world > 1):
            return shard.detach().to("cpu", copy=True)
        out = torch.empty(c.size, dtype=torch.float32, device=comm.device)
        comm.all_gather(out, shard.to(comm.device))
        return out.cpu()


def own_part(c: Chunk, slot: ParamSlot) -> tuple[int, int]:
    """The elements [lo, hi) of a parameter (in its flat order) that this rank's shard of its chunk
    holds; lo == hi when it holds none."""
    lo = max(slot.offset, c.shard_start)
    hi = max(lo, min(slot.offset + slot.numel, c.shard_start + c.shard_len))
    return lo - slot.offset, hi - slot.offset


def write_part(c: Chunk, target: torch.Tensor, slot: ParamSlot, lo: int, hi: int, part: torch.Tensor) -> None:
    """Copy elements [lo, hi) of a parameter (`own_part`) into one of the chunk's shard tensors."""
    if part.numel() != hi - lo:
        raise ValueError(f"{slot.name}: {part.numel()} elements read for its elements [{lo}, {hi})")
    start = slot.offset + lo - c.shard_start
    target[start: start + part.numel()].copy_(part.reshape(-1))


def write_slot(c: Chunk, target: torch.Tensor, slot: ParamSlot, flat: torch.Tensor) -> None:
    """Copy this rank's part of a whole parameter (flat) into one of the chunk's shard tensors."""
    lo, hi = own_part(c, slot)
    if lo < hi:
        write_part(c, target, slot, lo, hi, flat[lo:hi])
