"""plan_search: the fastest predicted placement whose predicted peak fits the budget.

Candidates are enumerated without looking at the budget: per activation-checkpointing setting,
chunk size and pool size, the chunks are ranked by benefit per byte of moving their optimizer
state to the device (Elixir uses one global priority; a ranking per chunk spends the budget where
it buys most), and every prefix of that ranking is a candidate, with each Deep Optimizer States
gap. The budget only filters. So a larger budget can only add candidates, and never predicts a
slower step. The enumeration is vectorised over prefixes, which keeps a 10B-parameter model's
search to seconds.
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Optional

import numpy as np

from elixir_ray.chunk_plan.buffers import DOS_BUFFERS, DOS_TILE, MAX_REDUCTIONS_IN_FLIGHT, staged_low
from elixir_ray.chunk_plan.layout import chunk_events, chunk_size_candidates, gradient_buffer_moments, pack
from elixir_ray.chunk_plan.nodes import NodeLayout
from elixir_ray.chunk_plan.plan import DEFAULT_MEMORY_MARGIN, Plan
from elixir_ray.engine.allocator import MARGIN_EXPANDABLE, default_memory_margin
from elixir_ray.planner.bounds import bounding_note
from elixir_ray.planner.cache_sim import loads_per_chunk
from elixir_ray.planner.cost import (STATE_BYTES, ChunkCosts, StepParts, chunk_costs, dos_mask, host_grad_bytes,
                                     host_grads_low_applies, host_state_bytes, micro_step_compute,
                                     overlapped_step)
from elixir_ray.planner.hardware import HardwareProfile
from elixir_ray.planner.model_profile import ModelProfile
from elixir_ray.planner.network import Network
from elixir_ray.units import format_bytes

# Deep Optimizer States gaps (0: off). The gap that wins moves with the budget and with when CPU
# updates start: 4 to 6 from step(), 6 to 15 from the last backward (GPT 1.5B to 10B at the H100
# anchor rates); with only 2, 3, 4 and 8 the search missed up to 4.6% of predicted step time (GPT
# 1.5B and 4.2B, 47 to 48 budgets each). Each gap is one vectorised pass per pool size and ranking;
# with the smallest-peak pick below done without a loop, a 10B GPT's search takes no longer.
DOS_GAPS = (0, *range(1, 17))
# The share of the budget kept free for the allocator's fragmentation and short-lived buffers when
# none is asked for: engine/allocator.py's default_memory_margin, by device and allocator setting
# (10% on CUDA with expandable segments, the engine's default; 20% otherwise). SAFETY is the larger.
SAFETY = DEFAULT_MEMORY_MARGIN


def check_margin(margin: Optional[float], device: str = "cpu") -> float:
    """The margin to plan with on `device`: `margin`, or the allocator's default for None
    (`default_memory_margin`); refused outside [0, 1)."""
    if margin is None:
        return default_memory_margin(device)
    if isinstance(margin, bool) or not isinstance(margin, numbers.Real) or not 0 <= margin < 1:
        raise ValueError(f"memory_margin must be a fraction of the budget in [0, 1), got {margin!r} "
                         f"(default {MARGIN_EXPANDABLE} on CUDA with expandable segments, else {SAFETY}: kept back "
                         f"for the allocator's fragmentation and short-lived buffers)")
    return float(margin)


HOST_FRACTION = 0.8  # of the free host RAM, for optimizer state by default; the rest for the process, data and pinning


@dataclass(frozen=True)
class SearchSettings:
    """What one plan search is for: the rates, ranks, compute dtype and loop every candidate is
    costed with, and the limits it must keep within.

    `replicate` (several ranks): "auto" also tries keeping some chunks whole on every rank (no
    all-gather on each fetch, for world-size times their state), "all" replicates every chunk
    (needed when ranks use different parameters in a step), "none" shards every chunk.
    `low_host_grads=False` keeps host gradients in fp32 even where `host_grads_low_applies` (the
    caller cannot promise one micro-step per step).
    `updates_in_backward`: the training loop lets CPU updates start in the last backward (no
    clipping, no fp16, accumulation declared; see docs/engine.md), so more of them are hidden; with
    one micro-step, device chunks' gradients are released once applied (`gradients_released`).
    `network`: where the ranks are and their collectives' measured rates (None: one node, at
    `hw.collective_gbps`); with "auto" on several nodes of as many ranks each, the search also tries
    sharding chunks within each node and replicating them across nodes. `slowest_nodes`: per rate
    of `hw` (a HardwareProfile field, or "compute"), the node it was measured on, where the ranks'
    profiles differ (`hardware.slowest_nodes`): the plan names the one that bounds its step.
    """

    hw: HardwareProfile
    budget: int  # device bytes, the margin included
    world_size: int = 1
    dtype_name: str = "float32"  # the compute dtype
    elem_bytes: int = 4  # its bytes per element
    grad_accum: int = 1  # micro-steps per step
    host_budget: Optional[int] = None  # host bytes per rank for optimizer state (None: no limit)
    # the option that set host_budget, as a refusal names it ("host_memory", "--host-memory"); None:
    # HOST_FRACTION of the free host RAM
    host_budget_from: Optional[str] = None
    updates_in_backward: bool = False
    low_host_grads: bool = True
    replicate: str = "auto"
    # the share of the budget kept back (None: the allocator's default for hw.device, default_memory_margin)
    memory_margin: Optional[float] = None
    network: Optional[Network] = None
    slowest_nodes: Optional[dict] = None

    @property
    def nodes(self) -> NodeLayout:
        return NodeLayout.of(self.network.node_of_rank if self.network is not None else (), self.world_size)

    @property
    def margin(self) -> float:
        return check_margin(self.memory_margin, self.hw.device)

    @property
    def limit(self) -> float:
        """The device bytes a plan's predicted peak may take: the budget less the margin."""
        return self.budget * (1 - self.margin)


@dataclass
class Layout:
    """One profile packed at one chunk size: what the cost model needs, as arrays."""

    profile: ModelProfile
    chunk_size: int
    sizes: np.ndarray  # padded elements per chunk
    numels: np.ndarray  # parameter elements per chunk
    shards: np.ndarray  # elements of each chunk this rank holds
    replicated: np.ndarray  # bool per chunk
    events: list  # chunk ids per traced access
    min_blocks: int
    param_order: list
    open_grads: int = 1  # most chunks collecting gradients at once in backward (each an fp32 staging buffer)
    # per chunk: the share of the forward's accesses before its first one there (1.0: none), for
    # the forward's compute before it (`_dos_first`)
    forward_before: Optional[np.ndarray] = None
    # per chunk: the share of the backward's accesses (recomputation included) up to its last one,
    # when its gradient is final and its update may start (0.0: none), for the DOS queue's start
    backward_final: Optional[np.ndarray] = None
    # per memory sample of the trace (`backward_timeline`): activation bytes alive, and (columns: no
    # reduction in flight, up to MAX_REDUCTIONS_IN_FLIGHT) the most gradient buffers held at once and
    # how many of those are reductions in flight
    event_activations: Optional[np.ndarray] = None
    event_buffers: Optional[np.ndarray] = None
    event_flying: Optional[np.ndarray] = None
    # per memory sample and chunk: its gradient handed on by the end of the sample's interval (a
    # device chunk's gradient then holds that buffer until the step's zero_grad, or, where updates
    # start in backward with one micro-step, until its update right after: `gradients_released`)
    event_handed: Optional[np.ndarray] = None
    # bool per chunk: sharded within each node of `ranks_per_node` ranks, replicated across nodes
    node_sharded: Optional[np.ndarray] = None
    ranks_per_node: int = 1
    # bool per chunk: some traced access uses it (a resident chunk's one load per step is for these)
    used: Optional[np.ndarray] = None


@dataclass
class Choice:
    layout: Layout
    n_blocks: int
    device: np.ndarray  # bool per chunk: optimizer state on the device
    dos_gap: int
    upload: bool = False  # host chunks keep a copy in the compute dtype to upload
    grads_low: bool = False  # host chunks' gradients in the compute dtype (Plan.host_grads_low)
    prefetch: Optional[int] = None  # chunks the pool loads ahead (Plan.prefetch_depth); None: `prefetch_depth`
    # bool per chunk, host chunks only: compute copy kept on the device (Plan.resident); None: none
    resident: Optional[np.ndarray] = None

    @property
    def kept(self) -> np.ndarray:
        """`resident` as a bool per chunk (all False for None)."""
        n = len(self.layout.sizes)
        return np.zeros(n, dtype=bool) if self.resident is None else np.asarray(self.resident, dtype=bool)

    @property
    def depth(self) -> int:
        return prefetch_depth(self.n_blocks, self.layout.min_blocks) if self.prefetch is None else self.prefetch


REPLICATE_CHOICES = ("auto", "all", "none")
REPLICATED_FRACTIONS = (0.25, 0.5, 0.75)  # "auto": these shares of the chunks replicated, best first


def make_layout(profile: ModelProfile, chunk_size: int, world: int, replicated: Optional[np.ndarray] = None,
                node_sharded: Optional[np.ndarray] = None, ranks_per_node: int = 1) -> Layout:
    """`replicated` (bool per chunk; several ranks only): chunks every rank holds whole, default none;
    `node_sharded` (bool per chunk, of those not replicated): chunks split among the `ranks_per_node`
    ranks of each node and whole on every node, default none."""
    order = profile.trace.order
    slots, sizes = pack([profile.numels[i] for i in order], chunk_size, world)
    chunk_of_param = [0] * len(profile.numels)
    numels = np.zeros(len(sizes), dtype=np.int64)
    for slot, i in zip(slots, order):
        chunk_of_param[i] = slot.chunk
        numels[slot.chunk] += slot.numel
    events, min_blocks = chunk_events(profile.trace.events, profile.trace.phases, chunk_of_param,
                                       profile.trace.grad_epochs)
    sizes_arr = np.array(sizes, dtype=np.int64)
    if world == 1:
        replicated = np.ones(len(sizes), dtype=bool)
    elif replicated is None:
        replicated = np.zeros(len(sizes), dtype=bool)
    else:
        replicated = np.asarray(replicated, dtype=bool)
    node = (np.zeros(len(sizes), dtype=bool) if node_sharded is None or world == 1
            else np.asarray(node_sharded, dtype=bool) & ~replicated)
    shards = np.where(replicated, sizes_arr, np.where(node, sizes_arr // ranks_per_node, sizes_arr // world))
    moments, handed_at = gradient_buffer_moments(profile.trace.grad_order, chunk_of_param, ordered=world > 1)
    used = np.zeros(len(sizes), dtype=bool)
    used[sorted({c for ev in events for c in ev})] = True
    return Layout(profile=profile, chunk_size=chunk_size, sizes=sizes_arr, numels=numels, used=used,
                  forward_before=forward_shares(events, profile.trace.phases, len(sizes)),
                  backward_final=backward_shares(profile.trace, chunk_of_param, handed_at, len(sizes)),
                  shards=shards, replicated=replicated, node_sharded=node, ranks_per_node=ranks_per_node,
                  events=events, min_blocks=min(min_blocks, len(sizes)),
                  param_order=[profile.names[i] for i in order],
                  open_grads=max(1, max(opened for opened, _ in moments)),
                  **backward_timeline(profile.trace, moments, handed_at, len(sizes)))


def forward_shares(events: list, phases: list, n_chunks: int) -> np.ndarray:
    """Per chunk, the share of the forward's accesses that come before its first one (1.0 for a
    chunk the forward does not use): the forward's compute before it, taking each access as an
    equal part (a transformer's blocks repeat the same accesses)."""
    forward = [ev for ev, phase in zip(events, phases) if phase == "forward"]
    out = np.ones(n_chunks)
    for i in range(len(forward) - 1, -1, -1):  # backwards, so the first access's share stays
        for cid in forward[i]:
            out[cid] = i / len(forward)
    return out


def backward_shares(trace, chunk_of_param: list[int], handed_at: dict[int, int], n_chunks: int) -> np.ndarray:
    """Per chunk, the share of the backward's accesses (recomputation and backward, after the
    forward) that come before its gradient is final: its last parameter's gradient arrived (from
    the trace's gradient order, not from its weights' reads: an embedding's backward reads no
    weight, and a tied one's gradient is final last), or with several ranks its reduction's turn
    (`handed_at`, moment 2k after k gradients). 0.0 for a chunk with no gradient."""
    back = np.array([e for e, phase in zip(trace.grad_epochs, trace.phases) if phase != "forward"], dtype=np.int64)
    arrived = np.zeros(n_chunks, dtype=np.int64)  # gradients arrived when each chunk's last one did
    for position, i in enumerate(trace.grad_order):
        arrived[chunk_of_param[i]] = position + 1
    for c, moment in handed_at.items():
        arrived[c] = max(arrived[c], moment // 2)
    if len(back) == 0:
        return np.zeros(n_chunks)
    return np.where(arrived > 0, np.searchsorted(back, arrived, side="left") / len(back), 0.0)


def _dos_queue(lay: Layout, dos: np.ndarray, dos_in: np.ndarray, dos_out: np.ndarray):
    """The DOS queue's release times, for `overlapped_step`: per row of `dos` and per chunk in the
    order their gradients are final, the copies each way of the row's DOS chunks final no earlier
    than it (-inf where the chunk is not a DOS chunk of the row), and per chunk in that order the
    share of the last backward after its gradient is final. The copies left for the forward are
    the most by which any such suffix of the queue outlasts backward's idle link after it starts."""
    final = lay.backward_final
    order = np.argsort(final, kind="stable")
    member = dos[..., order]

    def suffix(cost):
        work = np.where(member, cost[order], 0.0)
        sums = np.flip(np.cumsum(np.flip(work, axis=-1), axis=-1), axis=-1)
        return np.where(member, sums, -np.inf)

    return suffix(dos_in), suffix(dos_out), 1.0 - final[order]


def _dos_first(lay: Layout, host: np.ndarray, dos: np.ndarray, forward: float, load: np.ndarray):
    """Per row of `dos` (and `host`): the forward's compute before its first DOS chunk, and its
    loads of host chunks up to and including that one's (`load`: per chunk, when on the host);
    (forward, all of its loads) where a row has none."""
    shares = lay.forward_before
    first = np.argmin(np.where(dos, shares, np.inf), axis=-1)  # the DOS chunk the forward needs first
    has = dos.any(axis=-1)
    at = shares[first]
    loads = host * load
    before = shares <= np.asarray(at)[..., None]  # per row, the chunks the forward reaches by then
    return (np.where(has, forward * at, forward),
            np.where(has, (loads * before).sum(axis=-1), loads.sum(axis=-1)))


def backward_timeline(trace, moments: list[tuple[int, int]], handed_at: dict[int, int], n_chunks: int) -> dict:
    """Per memory sample of the trace (each event and each gradient's arrival), for the planner's
    backward peak: the activations alive (the most since the sample before), and the most
    gradient buffers held at one moment since then (chunks collecting gradients plus reductions
    still holding theirs) with at most 0 and at most MAX_REDUCTIONS_IN_FLIGHT reductions in flight
    (no host chunk, some), and how many of them are reductions; and which chunks' gradients were
    handed on by the end of the interval.

    Activations and gradient buffers peak at different moments (a GPT's activations as backward
    starts, with one buffer open; its buffers later, when little is saved), so the backward peak
    is the largest sum at one moment, not the sum of the two peaks: that sum over-predicted the
    H100's measured peaks by 3 to 9 GiB. Empty for a trace without samples (a profile saved by an
    older version): the sum of the peaks is used then."""
    samples = trace.memory_samples
    if not samples or samples[-1][1] != len(moments) - 1:
        return {}
    caps = (0, MAX_REDUCTIONS_IN_FLIGHT)
    n = len(samples)
    buffers, flying = np.zeros((n, len(caps)), dtype=np.int64), np.zeros((n, len(caps)), dtype=np.int64)
    start = 0
    for s, (_, end) in enumerate(samples):
        for j, cap in enumerate(caps):
            for opened, handed in moments[start: end + 1]:
                buffers[s, j] = max(buffers[s, j], opened + min(cap, handed))
                flying[s, j] = max(flying[s, j], min(cap, handed))
        start = end
    ends = np.array([end for _, end in samples], dtype=np.int64)
    handed = np.full(n_chunks, np.iinfo(np.int64).max, dtype=np.int64)
    for c, m in handed_at.items():
        handed[c] = m
    return {"event_activations": np.array([high for high, _ in samples], dtype=np.int64), "event_buffers": buffers,
            "event_flying": flying, "event_handed": handed[None, :] <= ends[:, None]}


def pool_candidates(layout: Layout) -> list[int]:
    """Pool sizes to try: all of them for small models, a geometric spread otherwise."""
    lo, hi = layout.min_blocks, len(layout.sizes)
    if hi - lo <= 96:
        return list(range(lo, hi + 1))
    return sorted({int(round(x)) for x in np.geomspace(lo, hi, 64)} | {lo, hi})


def prefetch_depth(n_blocks: int, min_blocks: int) -> int:
    """How many chunks ahead the pool loads (Plan.prefetch_depth): as far as its blocks allow, at
    least one. A prefetch evicts none of the chunks used last (the two an autograd node may read,
    and as many as the trace needs at once less one: wrap's `keep_recent`), and one more block is
    left for a chunk the forward uses twice (a tied embedding, at both ends), which a prefetch
    further ahead than the next chunk does not evict (`ChunkPool._prefetch`). Loads from further
    ahead start earlier, where the forward's host chunks follow one another with loads slower than
    their compute (gpt-1.5b at 24 GiB: 4.8 ms of load beside the CPU job against 2.9 ms of compute
    per chunk of 80M)."""
    return max(1, n_blocks - max(2, min_blocks - 1) - 1)


def loads_at(layout: Layout, n_blocks: int, resident: Optional[np.ndarray] = None) -> np.ndarray:
    """Per chunk, its loads in one micro-step with `n_blocks` pool blocks (Belady, cold at the
    start). `resident` (bool per chunk): compute copies kept on the device, which take no block
    and are counted 0 here; each is loaded once per step (`resident_loads`)."""
    kept = [] if resident is None else [int(c) for c in np.flatnonzero(resident)]
    counts = loads_per_chunk(layout.events, n_blocks, kept)
    out = np.zeros(len(layout.sizes), dtype=np.float64)
    for c, k in counts.items():
        out[c] = k
    return out


def resident_loads(layout: Layout, resident: np.ndarray) -> np.ndarray:
    """Per chunk, the loads per step of a resident compute copy: one, after its update, for each
    resident chunk the step uses; 0 elsewhere."""
    return (np.asarray(resident, dtype=bool) & layout.used).astype(np.float64)


# -- one configuration, part by part ---------------------------------------------------------------

@dataclass(frozen=True)
class UpdateQueue:
    """The host chunks' CPU updates of some rows of one layout, and the forward's loads after them:
    what `_cpu_wait` plays out, given the last backward's length (its docstring says what each is)."""

    lay: Layout
    plain: np.ndarray  # per row and chunk: updated by the CPU
    adam_host: np.ndarray  # per chunk: its CPU update's seconds
    forward: float  # the forward's compute
    in_backward: bool  # updates start in the last backward
    load: np.ndarray  # per chunk: one load's seconds
    copy_down: Optional[np.ndarray] = None  # per chunk: its gradient's copy down
    loaded: Optional[np.ndarray] = None  # per row and chunk: loaded by the forward (default `plain`)
    depth: int = 1  # chunks the pool loads ahead


def _cpu_wait(queue: UpdateQueue, backward, simulate: Optional[np.ndarray] = None) -> np.ndarray:
    """Per row of `plain` (host chunks updated by the CPU): how long the next forward waits for
    them and for the loads of `loaded` (default `plain`), from the engine's update queue played out
    (0 where the row loads no chunk).

    A chunk's update is ready once its gradient is final (with `in_backward`, at that share of the
    last backward's `backward` seconds, `Layout.backward_final`; else at `step()`) and copied down
    (`copy_down`, per chunk: by backward's end at the latest, which lasts as long as its copies
    down at least, `overlapped_step`); the one background thread runs the updates one at a time, taking
    the lowest chunk index among those ready (the forward's order, as `HostUpdates` does), or
    when none is, the one ready first. The forward loads a chunk after its update, and the loads
    of `loaded` (per row: every host chunk, those the Deep Optimizer States update too, whose own
    queue `overlapped_step` costs) one after another, as `_forward_chain` plays them out; a chunk
    the forward does not use is not waited for there (the engine waits for an update only where
    it loads the chunk). Its updates start no earlier than the first host chunk's gradient: on the
    H100 the thread was idle the first 28 ms of gpt-1.5b's backward at 24 GiB, and busy 220 of its
    280 ms step, so that the forward waited 30 ms for the chunks it needs last (2026-11-27). A tied
    embedding's chunk (final last, needed first) has no time at all; a middle chunk part of
    backward and of the forward.

    The copies down are taken as independent, where the engine queues them on one stream: a
    chunk's copy can wait for the one before it when gradients are final less than a copy apart
    (not so for a GPT's equal chunks: gpt-1.5b's chunk of 80M parameters takes about 8 ms of
    backward on the H100, its copy down 5 ms).

    `simulate` (per row): the rows to play out; the others get each update as if it ran alone,
    from when it is ready, a lower bound of their wait (for the search to skip rows that
    cannot be the best)."""
    lay, adam_host, forward, in_backward = queue.lay, queue.adam_host, queue.forward, queue.in_backward
    copy_down, loaded, load, depth = queue.copy_down, queue.loaded, queue.load, queue.depth
    plain = np.asarray(queue.plain, dtype=bool)
    rows = plain.reshape(-1, plain.shape[-1])
    n_rows, n = rows.shape
    start = np.broadcast_to(np.asarray(backward, dtype=np.float64).reshape(-1), (n_rows,))[:, None]
    ready = start * lay.backward_final[None, :] if in_backward else np.repeat(start, n, axis=1)
    if copy_down is not None and in_backward:  # copied down after it is final, within backward's copy stream
        ready = np.minimum(ready + copy_down[None, :], start)
    finish = ready + adam_host[None, :]  # alone: a lower bound
    played = rows.any(axis=1) if simulate is None else np.asarray(simulate, dtype=bool).reshape(-1) & rows.any(axis=1)
    if played.any():
        finish[played] = _play_queue(rows[played], ready[played], adam_host)
    updated = np.where(rows, finish - start, -np.inf)  # relative to the forward's start (backward's end)
    loaded_rows = rows if loaded is None else np.broadcast_to(np.asarray(loaded, dtype=bool), plain.shape).reshape(
        rows.shape)
    return _forward_chain(lay, loaded_rows, updated, load, forward, depth).reshape(plain.shape[:-1])


def _update_queue(lay: Layout, costs, plain: np.ndarray, forward: float, in_backward: bool, load: np.ndarray,
                  loaded: np.ndarray, depth: int):
    """`_cpu_wait` with one layout's costs bound in, for `overlapped_step` to call with the backward's
    length; each gradient's copy down is what a host chunk's reduction costs beyond a device chunk's."""
    return partial(_cpu_wait, UpdateQueue(lay, plain, costs.adam_host, forward, in_backward, load,
                                          copy_down=costs.reduce_host - costs.reduce_device, loaded=loaded,
                                          depth=depth))


def _forward_chain(lay: Layout, loaded: np.ndarray, updated: np.ndarray, load: np.ndarray,
                   forward: float, depth: int = 1) -> np.ndarray:
    """Per row: how much longer than its compute the forward lasts, its chunks taken in the order it
    first needs them, as the pool serves them: a chunk `loaded` (per row: its state on the host) is
    copied in after its update ends (`updated`, per row, from the forward's start; -inf for none)
    and after the previous load on the one copy stream, and no earlier than the compute of the
    chunk `depth` places before it starts (the pool prefetches `depth` chunks ahead, Plan.
    prefetch_depth: at the first access of that chunk, and the copy first waits for the compute
    queued so far; the first `depth` chunks from the forward's start); its compute starts when
    both the compute before it and its load are done. So loads slower than the compute between them add
    up where host chunks follow one another, even when the forward as a whole has time for them:
    on the H100 gpt-1.5b's forward at 24 GiB (host chunks the last 6 of 11, a load 8.9 ms beside
    the CPU job against 5 ms of compute each) took about 30 ms more than its compute and its waits
    for updates (2026-11-27). Kept as the delay of each chunk's compute against its need, so that a
    forward with nothing late waits exactly 0."""
    shares = lay.forward_before
    order = np.argsort(shares, kind="stable")
    order = order[shares[order] < 1.0]  # the chunks the forward uses, by first use
    n_rows = loaded.shape[0]
    delay, link = np.zeros(n_rows), np.zeros(n_rows)
    starts = []  # per chunk in that order, per row: when its compute starts
    for p, c in enumerate(order):
        need = forward * shares[c]  # its compute's start, were nothing late
        issued = starts[p - depth] if p >= depth else 0.0
        copied = np.maximum(np.maximum(issued, updated[:, c]), link) + load[c]
        link = np.where(loaded[:, c], copied, link)
        delay = np.where(loaded[:, c], np.maximum(delay, copied - need), delay)
        starts.append(need + delay)
    return delay


def _play_queue(rows: np.ndarray, ready: np.ndarray, adam_host: np.ndarray) -> np.ndarray:
    """Per row, when each of its chunks' updates ends (`_cpu_wait`'s queue; only a row's own
    chunks are meaningful): one thread, the lowest index among those ready first."""
    n_rows, n = rows.shape
    finish = np.zeros((n_rows, n))
    clock = np.zeros(n_rows)
    left = rows.copy()
    every = np.arange(n_rows)
    waiting = np.where(left, ready, np.inf)
    for _ in range(int(left.sum(axis=1).max(initial=0))):
        busy = np.isfinite(waiting).any(axis=1)
        ready_now = waiting <= clock[:, None]
        pick = np.where(ready_now.any(axis=1), np.argmax(ready_now, axis=1),  # the lowest index among those ready
                        np.argmin(waiting, axis=1))  # else the one ready first
        end = np.maximum(clock, ready[every, pick]) + adam_host[pick]
        finish[every[busy], pick[busy]] = end[busy]
        waiting[every[busy], pick[busy]] = np.inf
        clock = np.where(busy, end, clock)
    return finish


def evaluate(choice: Choice, hw: HardwareProfile, world: int, elem_bytes: int, grad_accum: int,
             updates_in_backward: bool = False, path: Optional[dict] = None,
             network: Optional[Network] = None) -> tuple[dict, dict, int, float]:
    """(device memory parts in bytes, step time parts in seconds, host bytes, predicted step seconds).

    The time parts overlap (`overlapped_step`), so the step is not their sum; `path` (a dict) gets
    the critical path's pieces; `network` the collectives' rates (`chunk_costs`)."""
    lay = choice.layout
    grad_bytes = host_grad_bytes(choice.grads_low)
    costs = chunk_costs(lay.sizes, lay.shards, lay.replicated, world, elem_bytes, hw, choice.upload, grad_bytes,
                        lay.node_sharded, network)
    kept = choice.kept
    loads = loads_at(lay, choice.n_blocks, kept)  # per micro-step, of the chunks the pool serves
    once = resident_loads(lay, kept)  # per step, of the resident ones
    dev, host = choice.device, ~choice.device
    dos = dos_mask(host, choice.dos_gap)
    plain_host = host & ~dos
    copies_in = float((loads * (costs.load_host - costs.load_device))[host].sum())
    gathers = float((loads * costs.load_device).sum())
    resident_in = float((once * (costs.load_host - costs.load_device))[host].sum())
    resident_gathers = float((once * costs.load_device).sum())
    reduce_comm = float(costs.reduce_device.sum())
    copies_out = float((costs.reduce_host - costs.reduce_device)[host].sum())
    micro_step, forward = micro_step_compute(lay.profile, hw)
    load = (costs.load_host - costs.load_device) * ((loads > 0) | (once > 0))  # one load of each chunk the step loads
    engine_kernels = grad_accum * float((loads * costs.fill_device + costs.stage)[dev].sum()
                                        + costs.stage_host[host].sum())
    time = {
        "compute": grad_accum * micro_step,
        "copies host->device": grad_accum * copies_in + resident_in,
        "all-gather": grad_accum * gathers + resident_gathers,
        "gradient reduce": grad_accum * reduce_comm,
        "copies device->host": grad_accum * copies_out,
        "CPU AdamW": float(costs.adam_host[plain_host].sum()),
        "device AdamW": float(costs.adam_device[dev].sum()),
        "Deep Optimizer States": float(costs.adam_dos[dos].sum()),
        "engine kernels": engine_kernels,
    }
    dos_at, loads_to_dos = _dos_first(lay, host, dos, forward, load)
    seconds = overlapped_step(StepParts(
        time["compute"], forward,
        time["all-gather"] + time["gradient reduce"] + time["device AdamW"] + float(costs.dos_update[dos].sum())
        + engine_kernels,
        time["copies host->device"], time["copies device->host"], time["CPU AdamW"],
        _update_queue(lay, costs, plain_host, forward, updates_in_backward, load, host, choice.depth),
        updates_in_backward, grad_accum,
        float(costs.dos_in[dos].sum()), float(costs.dos_out[dos].sum()),
        float(load[host].sum()), float(dos_at), float(loads_to_dos),
        *_dos_queue(lay, dos, costs.dos_in, costs.dos_out)), path=path)
    held = MemorySettings(choice.dos_gap, elem_bytes, world, choice.upload, grad_bytes,
                          gradients_freed(choice.grads_low, grad_accum),
                          gradients_released(updates_in_backward, grad_accum))
    rows = _memory_rows(lay, choice.n_blocks, dev[None, :], held, resident=kept[None, :])
    memory = {part: int(values[0]) for part, values in rows.items()}
    host_bytes = int((host_state_bytes(elem_bytes, choice.upload, grad_bytes) * lay.shards)[host].sum())
    return memory, time, host_bytes, float(seconds)


def gradients_freed(grads_low: bool, grad_accum: int) -> bool:
    """Whether a device chunk's gradient exists only from its backward to the step's zero_grad:
    with one backward per step, declared (the plan's host_grads_low rests on the same promise;
    the engine warns when a step has more). Otherwise a gradient kept from an earlier backward is
    alive at every moment, and each device element is budgeted at STATE_BYTES."""
    return grads_low and grad_accum == 1


def gradients_released(updates_in_backward: bool, grad_accum: int) -> bool:
    """Whether a device chunk's gradient exists only while it is collected: with one backward per
    step whose updates start in it (`updates_start_in_backward`: accumulation declared, no clipping,
    not fp16), the engine updates a device chunk as soon as its gradient is final and releases the
    gradient right after (`ChunkedAdam._release_gradient`). Its buffer is then the chunk's staging
    buffer, counted in "gradient staging" until it is handed on, and nothing of it is left at the
    optimizer step. The engine refuses a second backward in the step, and one after `step()`
    without `zero_grad()`, so no gradient outlives its update. With several micro-steps a gradient
    is kept from the first backward to the last, alive at every moment as without the release."""
    return updates_in_backward and grad_accum == 1


MEMORY_PARTS = ("pool blocks", "resident compute copies", "optimizer state on device", "gradients of device chunks",
                "activations", "gradient staging", "fetch conversion", "Deep Optimizer States buffer", "buffers")


@dataclass(frozen=True)
class MemorySettings:
    """How a placement holds its chunks, beside which are on the device: what `_memory_rows` counts by."""

    dos_gap: int  # Deep Optimizer States gap (0: off)
    elem_bytes: int  # bytes per element of the compute dtype
    world: int  # ranks
    upload: bool  # host chunks keep an upload copy in the compute dtype
    grad_bytes: int = 4  # bytes per element of a host chunk's gradient on its way to the host
    freed: bool = False  # `gradients_freed`
    released: bool = False  # `gradients_released`


def _memory_rows(lay: Layout, n_blocks: int, device: np.ndarray, held: MemorySettings,
                 ranking: Optional[np.ndarray] = None, resident: Optional[np.ndarray] = None) -> dict[str, np.ndarray]:
    """Peak device bytes by part, for each row of `device` (bool per chunk: state on the device).

    Backward peaks at its worst moment (`backward_timeline`): activations alive, gradient buffers
    (chunks collecting gradients, each a whole fp32 chunk, and reductions in flight, `flying_bytes`), a fetch's
    conversion buffer, and, where gradients are `freed` (`gradients_freed`), the gradients of
    the device chunks handed on by then. The optimizer step holds every device gradient and the
    Deep Optimizer States buffers, which are held at every moment (`_dos_buffer_bytes`); the
    largest counts. Where gradients are `released` (`gradients_released`), each device chunk's is
    gone as soon as it is handed on (its update runs then), in every row, all on the device too:
    the worst moment holds only the buffers still collecting, and the step none. Host gradients in
    the compute dtype are cast on the device before they leave: each reduction in flight holds
    that copy too. `ranking`: the rows are the prefixes of it (row k: its first k chunks), summed
    here by running sums instead of a product per row. `resident` (bool per row and chunk, host
    chunks only): each one's compute copy, a whole chunk in the compute dtype, held at every moment
    beside the pool's blocks (`resident_bytes`)."""
    dos_gap, elem_bytes, world, upload = held.dos_gap, held.elem_bytes, held.world, held.upload
    grad_bytes, freed, released = held.grad_bytes, held.freed, held.released
    size, shard = int(lay.sizes.max()), int(lay.shards.max())
    shards = lay.shards.astype(np.float64)
    timeline = lay.event_activations is not None and lay.event_handed is not None
    freed = freed and timeline
    if ranking is not None:
        device_elems = np.concatenate([[0.0], np.cumsum(shards[ranking])])
    else:
        device_elems = device.astype(np.float64) @ shards
    has_host = ~device.all(axis=1)
    any_sharded = world > 1 and not bool(lay.replicated.all())
    sharded_part = shard * 4 if any_sharded else 0
    out = {part: np.zeros(len(device)) for part in MEMORY_PARTS}
    out["pool blocks"][:] = n_blocks * size * elem_bytes
    if resident is not None:
        out["resident compute copies"][:] = np.asarray(resident, dtype=np.float64) @ resident_bytes(lay, elem_bytes)
    out["buffers"][:] = lay.profile.buffer_bytes
    for host in (False, True):
        rows = np.flatnonzero(has_host == host)
        if not len(rows):
            continue
        # a plan with every chunk on the device records no host_grads_low, the flag that carries
        # the promise of one backward per step: its gradients are costed as always alive, unless
        # they are released in backward (promised by the plan's micro-steps and where its updates start)
        row_freed = freed and host and not released
        apart = row_freed or released  # the gradient is not part of the state: counted where it is alive
        out["optimizer state on device"][rows] = (STATE_BYTES - 4 if apart else STATE_BYTES) * device_elems[rows]
        in_flight = MAX_REDUCTIONS_IN_FLIGHT if host else 0  # host chunks' gradients on their way out
        fetch = _fetch_bytes(lay, elem_bytes, world, host, upload)
        device_grads = np.zeros(len(rows))
        dos_buffer = _dos_buffer_bytes(lay, dos_gap, host)
        dos_held = np.zeros(len(rows))
        if timeline:
            staged = _staged_by_sample(lay, host, grad_bytes, world)
            forward_dos = np.full(len(staged), float(dos_buffer))  # DOS updates may run at any moment
            at = lay.event_activations + staged + forward_dos
            if row_freed:  # per sample and row: the device chunks' gradients handed on by then
                # a later sample holds every gradient an earlier one does: an earlier sample whose
                # activations and buffers are no more than a later one's is never the worst
                later = np.concatenate([np.maximum.accumulate(at[::-1])[::-1][1:], [-np.inf]])
                kept = np.flatnonzero(at > later)
                held = lay.event_handed[kept] * (4 * shards)
                grads = (np.concatenate([np.zeros((len(kept), 1)), np.cumsum(held[:, ranking], axis=1)], axis=1)[:, rows]
                         if ranking is not None else held @ device[rows].T.astype(np.float64))
                pick = np.argmax(at[kept][:, None] + grads, axis=0)
                device_grads = grads[pick, np.arange(len(rows))]
                worst = kept[pick]
            else:
                worst = np.full(len(rows), int(np.argmax(at)))
            activations, staging = lay.event_activations[worst], staged[worst] + sharded_part
            dos_held = forward_dos[worst]
        else:
            activations = np.full(len(rows), lay.profile.trace.activation_peak_bytes)
            staging = np.full(len(rows), lay.open_grads * size * 4 + in_flight * flying_bytes(size, shard, grad_bytes, world)
                              + sharded_part)
            dos_held = np.full(len(rows), float(dos_buffer))
        backward = activations + staging + fetch + device_grads + dos_held
        at_step = _step_bytes(lay, dos_gap, host, device_elems[rows], row_freed)
        in_backward = backward >= at_step
        out["gradients of device chunks"][rows] = np.where(in_backward, device_grads, at_step - dos_buffer)
        out["activations"][rows] = np.where(in_backward, activations, 0)
        out["gradient staging"][rows] = np.where(in_backward, staging, 0)
        out["fetch conversion"][rows] = np.where(in_backward, fetch, 0)
        out["Deep Optimizer States buffer"][rows] = np.where(in_backward, dos_held, dos_buffer)
    return out


def resident_bytes(lay: Layout, elem_bytes: int) -> np.ndarray:
    """Per chunk, the device bytes of its compute copy when resident: the whole chunk (gathered,
    when sharded) in the compute dtype."""
    return (lay.sizes * elem_bytes).astype(np.float64)


def _fetch_bytes(lay: Layout, elem_bytes: int, world: int, has_host: bool, upload: bool) -> int:
    """The fetch conversion buffer of a layout's largest chunk (`_fetch_buffer`); with several
    ranks and some chunks replicated, the larger of a sharded and a replicated chunk's."""
    size, shard = int(lay.sizes.max()), int(lay.shards.max())
    fetch = _fetch_buffer(size, shard, elem_bytes, world, has_host, upload)
    if world > 1 and bool(lay.replicated.any()):  # a replicated chunk is fetched as with one rank
        any_sharded = not bool(lay.replicated.all())
        fetch = max(fetch if any_sharded else 0, _fetch_buffer(size, size, elem_bytes, 1, has_host, upload))
    return fetch


def _dos_buffer_bytes(lay: Layout, dos_gap: int, has_host: bool) -> int:
    """The Deep Optimizer States buffers: a tile of a host chunk's state and gradient on the
    device, in each of the engine's DOS_BUFFERS (one tile's state comes back while the next one's
    goes up). Counted at every moment of the step: the updates may start in backward, and run into
    the next forward (at most 256 MiB, so a plan whose updates start at step() loses little)."""
    return DOS_BUFFERS * STATE_BYTES * min(DOS_TILE, int(lay.shards.max())) if dos_gap > 0 and has_host else 0


def _step_bytes(lay: Layout, dos_gap: int, has_host: bool, device_elems, freed: bool):
    """What the optimizer step holds beside the state and the pool: the Deep Optimizer States
    buffer, and every device chunk's gradient where those come and go (`freed`; otherwise they
    are in the state already)."""
    return _dos_buffer_bytes(lay, dos_gap, has_host) + (4 * device_elems if freed else 0)


def _staged_by_sample(lay: Layout, has_host: bool, grad_bytes: int, world: int) -> np.ndarray:
    """Per memory sample: the gradient buffers held at its worst moment, each a whole fp32 chunk
    (a host chunk's collecting in the compute dtype is counted so too), with up to
    MAX_REDUCTIONS_IN_FLIGHT host reductions in flight when some chunk is on the host, each as
    `flying_bytes`."""
    column = 1 if has_host else 0
    size, shard = int(lay.sizes.max()), int(lay.shards.max())
    flying = lay.event_flying[:, column]
    return (lay.event_buffers[:, column] - flying) * size * 4 + flying * flying_bytes(size, shard, grad_bytes, world)


def flying_bytes(size: int, shard: int, grad_bytes: int, world: int) -> int:
    """A host chunk's reduction in flight: its staging buffer, in the compute dtype where its
    gradient goes down in it with one rank (`staged_low`); else fp32, with the cast shard beside
    it when the gradient goes down in the compute dtype."""
    if staged_low(grad_bytes < 4, world):
        return size * grad_bytes
    return size * 4 + (shard * grad_bytes if grad_bytes < 4 else 0)


def _fetch_buffer(size: int, shard: int, elem_bytes: int, world: int, has_host: bool, upload: bool) -> int:
    """Device bytes a fetch allocates beside the pool block while it fills it.

    torch copies a host tensor into a device tensor of another dtype through a device buffer of
    the source dtype: an fp32 master uploaded into a bf16 block needs a whole fp32 chunk for a
    moment (upload copies avoid it). A sharded chunk moves and casts its shard before the gather.
    """
    low = elem_bytes < 4
    if world > 1:
        source = elem_bytes if upload and low else 4
        host_part = shard * source + (shard * elem_bytes if source != elem_bytes else 0) if has_host else 0
        return max(host_part, shard * elem_bytes if low else 0)
    return size * 4 if has_host and low and not upload else 0


# -- the search -------------------------------------------------------------------------------------

@dataclass
class _Best:
    """What a search found so far: the fastest choice that fits, and (`smallest`) the smallest
    need of any candidate, for the refusal when none fits."""

    seconds: float = float("inf")
    peak: int = 0
    choice: Optional[Choice] = None
    smallest: dict = field(default_factory=dict)


def _search_layout(lay: Layout, settings: SearchSettings, best: _Best, upload: bool, grads_low: bool = False) -> None:
    """Try every pool size, device prefix and DOS gap of one layout; update `best`."""
    hw, world, elem_bytes, grad_accum = settings.hw, settings.world_size, settings.elem_bytes, settings.grad_accum
    updates_in_backward = settings.updates_in_backward
    grad_bytes = host_grad_bytes(grads_low)
    costs: ChunkCosts = chunk_costs(lay.sizes, lay.shards, lay.replicated, world, elem_bytes, hw, upload, grad_bytes,
                                    lay.node_sharded, settings.network)
    n_chunks = len(lay.sizes)
    state_bytes = (STATE_BYTES * lay.shards).astype(np.float64)
    host_bytes = (host_state_bytes(elem_bytes, upload, grad_bytes) * lay.shards).astype(np.float64)
    micro_step, forward = micro_step_compute(lay.profile, hw)
    compute = grad_accum * micro_step
    for n in pool_candidates(lay):
        loads = loads_at(lay, n)
        host_cost = grad_accum * (loads * costs.load_host + costs.reduce_host + costs.stage_host) + costs.adam_host
        dev_cost = (grad_accum * (loads * (costs.load_device + costs.fill_device) + costs.reduce_device + costs.stage)
                    + costs.adam_device)
        benefit = host_cost - dev_cost
        by_benefit = np.argsort(-(benefit / state_bytes), kind="stable")
        parts = _PrefixParts(compute, forward, grad_accum * loads * (costs.load_host - costs.load_device),
                             grad_accum * (costs.reduce_host - costs.reduce_device), grad_accum * costs.stage_host,
                             grad_accum * (loads * costs.fill_device + costs.stage),
                             grad_accum * (float((loads * costs.load_device).sum()) + float(costs.reduce_device.sum())),
                             updates_in_backward, upload, grad_accum, grads_low,
                             **_resident_parts(lay, loads, costs, grad_accum, elem_bytes))
        for ranking in (by_benefit, np.arange(n_chunks)):  # per-chunk benefit per byte; Gemini-style order
            _search_prefixes(lay, n, ranking, host_bytes, costs, parts, settings, best)


@dataclass
class _PrefixParts:
    """What a pool size fixes for every prefix: per-chunk copy seconds and the step's fixed parts."""

    compute: float
    forward: float
    h2d: np.ndarray  # per chunk, per step, when its state is on the host
    d2h: np.ndarray
    host_stage: np.ndarray  # per chunk, per step, when on the host: its gradients' staging (and casts)
    device_kernels: np.ndarray  # per chunk, per step, when its state is on the device: its loads' casts and staging
    collectives: float  # the fixed compute-stream work: collectives
    updates_in_backward: bool
    upload: bool
    micro_steps: int
    grads_low: bool = False
    # a host chunk kept resident (`_resident_parts`): per chunk, the link's and the gathers' seconds
    # per step it saves, and in which order the search keeps chunks resident (those saving nothing left out)
    kept_h2d: Optional[np.ndarray] = None
    kept_gather: Optional[np.ndarray] = None
    kept_order: Optional[np.ndarray] = None


def _resident_parts(lay: Layout, loads: np.ndarray, costs: ChunkCosts, grad_accum: int, elem_bytes: int) -> dict:
    """What keeping each host chunk's compute copy resident saves, at a pool size whose loads per
    micro-step are `loads`: every load of the step but the one after its update, each a copy over
    the link (`kept_h2d`) and, when sharded, an all-gather (`kept_gather`); and the order in which
    the search makes host chunks resident, by seconds saved per byte of device memory (its
    compute copy, `resident_bytes`).

    The loads are those with every chunk in the pool: a resident chunk takes no block, so the
    others are loaded no more often than that, and `evaluate` costs the plan found with the loads
    as they are (`loads_at` with its resident chunks)."""
    again = np.maximum(grad_accum * loads - resident_loads(lay, np.ones(len(loads), dtype=bool)), 0.0)
    kept_h2d, kept_gather = again * (costs.load_host - costs.load_device), again * costs.load_device
    saved = kept_h2d + kept_gather
    order = np.argsort(-(saved / resident_bytes(lay, elem_bytes)), kind="stable")
    return {"kept_h2d": kept_h2d, "kept_gather": kept_gather, "kept_order": order[saved[order] > 0]}


def resident_fill(host: np.ndarray, peaks: np.ndarray, limit: float, order: np.ndarray,
                  nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of `host` (bool per chunk: state on the host), the host chunks kept resident: those
    first in `order` whose compute copies (`nbytes` per chunk) fit beside the row's peak (`peaks`)
    within `limit`, as many as fit in that order; and the bytes they add to the peak. A row that
    does not fit keeps none."""
    rows, n = host.shape
    resident = np.zeros((rows, n), dtype=bool)
    if not len(order):
        return resident, np.zeros(rows)
    candidates = host[:, order]
    total = np.cumsum(np.where(candidates, nbytes[order], 0.0), axis=1)
    # the running totals only grow, so the positions within the limit are a prefix of `order`
    fits = (peaks[:, None] + total <= limit).sum(axis=1)
    taken = candidates & (np.arange(len(order))[None, :] < fits[:, None])
    resident[:, order] = taken
    return resident, np.where(taken, nbytes[order], 0.0).sum(axis=1)


def _search_prefixes(lay: Layout, n: int, ranking: np.ndarray, host_state: np.ndarray, costs: ChunkCosts,
                     parts: _PrefixParts, settings: SearchSettings, best: _Best) -> None:
    """Every prefix of `ranking` on the device, with each DOS gap, at pool size n (the settings'
    margin also sets the smallest need a refusal names); and each of those with host chunks kept
    resident in the device memory it leaves (`resident_fill`), a candidate beside it: the step's
    loads of those chunks, and the link's and the gathers' time for them, are saved, for their
    compute copies' bytes.

    Every gap's candidates are costed in one pass: the parts a gap changes are computed for all
    gaps at once (arrays of gap x prefix x chunk), and the best of each gap is then taken in
    `DOS_GAPS`' order."""
    host_budget, limit, margin, smallest = settings.host_budget, settings.limit, settings.margin, best.smallest
    n_chunks = len(lay.sizes)
    rank_of = np.empty(n_chunks, dtype=np.int64)
    rank_of[ranking] = np.arange(n_chunks)
    ks = np.arange(n_chunks + 1)
    device = rank_of[None, :] < ks[:, None]  # row k: the first k chunks of the ranking on the device
    host_bytes = host_state.sum() - np.concatenate([[0.0], np.cumsum(host_state[ranking])])
    host_ok = np.ones(len(ks), dtype=bool) if host_budget is None else host_bytes <= host_budget
    host = ~device
    grad_bytes = host_grad_bytes(parts.grads_low)
    freed = gradients_freed(parts.grads_low, parts.micro_steps)
    released = gradients_released(parts.updates_in_backward, parts.micro_steps)
    nbytes = resident_bytes(lay, settings.elem_bytes)
    # the peak and the candidates depend on the gap only through whether some chunks are on DOS
    gaps = np.array([gap for gap in DOS_GAPS if gap == 0 or host.any()])
    variants = {}
    for on_dos in dict.fromkeys(bool(gap > 0) for gap in gaps):
        held = MemorySettings(1 if on_dos else 0, settings.elem_bytes, settings.world_size, parts.upload, grad_bytes,
                              freed, released)
        peaks = sum(_memory_rows(lay, n, device, held, ranking).values())
        unbounded = float(peaks.min()) / (1 - margin)  # as if the host could hold any optimizer state
        smallest["unbounded_need"] = min(smallest.get("unbounded_need", float("inf")), unbounded)
        if host_ok.any():  # the first smallest peak within the host limit (a loop here was a third of the search)
            k = int(np.flatnonzero(host_ok)[np.argmin(peaks[host_ok])])
            need = peaks[k] / (1 - margin)
            if need < smallest.get("need", float("inf")):
                gap = int(gaps[gaps > 0][0]) if on_dos else 0
                smallest.update(need=need, choice=Choice(lay, n, device[k].copy(), gap, parts.upload, parts.grads_low))
        ok = host_ok & (peaks <= limit)
        if ok.any():
            variants[on_dos] = _candidates(ok, peaks, *resident_fill(host, peaks, limit, parts.kept_order, nbytes),
                                           parts)
    segments = [(i, int(gap), variants[gap > 0]) for i, gap in enumerate(gaps) if (gap > 0) in variants]
    if not segments:
        return
    n_rows = len(ks)
    at = np.concatenate([i * n_rows + c.take for i, _, c in segments])  # each candidate's (gap, prefix) row
    prefix = at % n_rows
    saved_h2d, saved_gather = (np.concatenate([getattr(c, key) for _, _, c in segments])
                               for key in ("saved_h2d", "saved_gather"))

    def by_gap(x):  # a part of every (gap, prefix) row, for each candidate
        return x.reshape(-1, *x.shape[2:])[at]

    hostf = host.astype(np.float64)
    # one load of each host chunk the step loads at all (a chunk no traced access uses has none)
    load = np.where(parts.h2d > 0, costs.load_host - costs.load_device, 0.0)
    on_stream = (parts.collectives + device.astype(np.float64) @ (costs.adam_device + parts.device_kernels)
                 + hostf @ parts.host_stage)
    dos = dos_mask(host, gaps[:, None, None])  # gap x prefix x chunk
    plain = host & ~dos
    dosf = dos.astype(np.float64)
    dos_at, loads_to_dos = _dos_first(lay, hostf, dos, parts.forward, load)
    queue_in, queue_out, after = _dos_queue(lay, dos, costs.dos_in, costs.dos_out)
    stream = by_gap(on_stream + dosf @ costs.dos_update) - saved_gather
    cpu_adam = by_gap(plain.astype(np.float64) @ costs.adam_host)
    queue = _update_queue(lay, costs, by_gap(plain), parts.forward, parts.updates_in_backward, load, host[prefix],
                          prefetch_depth(n, lay.min_blocks))
    step_parts = partial(
        StepParts, parts.compute, parts.forward, stream, (hostf @ parts.h2d)[prefix] - saved_h2d,
        (hostf @ parts.d2h)[prefix], cpu_adam, updates_in_backward=parts.updates_in_backward,
        micro_steps=parts.micro_steps, dos_in=by_gap(dosf @ costs.dos_in), dos_out=by_gap(dosf @ costs.dos_out),
        forward_loads=(hostf @ load)[prefix], dos_first_at=by_gap(dos_at), loads_to_dos=by_gap(loads_to_dos),
        dos_queue_in=by_gap(queue_in), dos_queue_out=by_gap(queue_out), dos_after=after)
    ok = np.concatenate([c.ok for _, _, c in segments])
    # the queue played out only where the step could still be the best: each update alone is a
    # lower bound of it (a 10B GPT's search took three times as long playing out every row)
    bound = overlapped_step(step_parts(cpu_wait=partial(queue, simulate=np.zeros(len(ok), dtype=bool))))
    contender = ok & (bound < best.seconds + 1e-12)
    if not contender.any():
        return
    seconds = np.where(contender, overlapped_step(step_parts(cpu_wait=partial(queue, simulate=contender))), np.inf)
    end = 0
    for _, gap, c in segments:  # each gap's fastest, taken in the gaps' order
        start, end = end, end + len(c.ok)
        fits = contender[start:end]
        if not fits.any():
            continue
        k = int(np.flatnonzero(fits)[np.argmin(seconds[start:end][fits])])
        if seconds[start + k] < best.seconds - 1e-12 or (abs(seconds[start + k] - best.seconds) <= 1e-12
                                                         and c.peaks[k] < best.peak):
            best.seconds, best.peak = float(seconds[start + k]), int(c.peaks[k])
            best.choice = Choice(lay, n, device[c.take[k]].copy(), gap, parts.upload, parts.grads_low,
                                 resident=c.kept[k].copy() if c.kept[k].any() else None)


@dataclass(frozen=True)
class _Candidates:
    """The candidates of a gap at one pool size (`_candidates`): every prefix row as it is, then
    the rows that keep some host chunks resident. Per candidate: its prefix row (`take`), its
    resident chunks (`kept`), whether it fits, its peak, and the link's and the gathers' seconds
    its resident chunks save (0 for a row as it is)."""

    take: np.ndarray
    kept: np.ndarray
    ok: np.ndarray
    peaks: np.ndarray
    saved_h2d: np.ndarray
    saved_gather: np.ndarray


def _candidates(ok: np.ndarray, peaks: np.ndarray, resident: np.ndarray, added: np.ndarray,
                parts: _PrefixParts) -> _Candidates:
    """`_Candidates` from the prefix rows' fit (`ok`) and peaks, and `resident_fill`'s chunks kept
    resident per row (adding `added` bytes to its peak; their copies fit by construction)."""
    filled = np.flatnonzero(ok & resident.any(axis=1))
    keptf = resident[filled].astype(np.float64)
    zeros = np.zeros(len(ok))
    return _Candidates(
        take=np.concatenate([np.arange(len(ok)), filled]),
        kept=np.concatenate([np.zeros_like(resident), resident[filled]]),
        ok=np.concatenate([ok, ok[filled]]), peaks=np.concatenate([peaks, peaks[filled] + added[filled]]),
        saved_h2d=np.concatenate([zeros, keptf @ parts.kept_h2d]),
        saved_gather=np.concatenate([zeros, keptf @ parts.kept_gather]))


def plan_search(profiles: list[ModelProfile], settings: SearchSettings,
                chunk_sizes: Optional[list[int]] = None) -> Plan:
    """The fastest predicted plan over all profiles (checkpointing settings) that fits the
    settings' budget less their memory margin (kept back for the allocator's fragmentation and
    short-lived buffers). `chunk_sizes`: those to try (default: a few of least waste per profile).

    Raises PlanError (`refusal.too_small`): the smallest budget any candidate needs, what dominates
    it, and what to change.
    """
    if settings.replicate not in REPLICATE_CHOICES:
        raise ValueError(f"replicate must be one of {', '.join(REPLICATE_CHOICES)}, got {settings.replicate!r}")
    routed = settings.world_size > 1 and settings.replicate == "auto" and any(p.trace.weights_read for p in profiles)
    if routed:  # which parameters a step uses depends on the weights, so it may differ between ranks
        settings = replace(settings, replicate="all")
    settings = replace(settings, memory_margin=settings.margin)
    best = _Best()
    grads_low = host_grads_low_applies(settings.dtype_name, settings.grad_accum, settings.low_host_grads)
    for profile in profiles:
        ordered = [profile.numels[i] for i in profile.trace.order]
        for cs in chunk_sizes or chunk_size_candidates(ordered):
            sharded = make_layout(profile, cs, settings.world_size)
            for lay in node_sharding_layouts(replication_layouts(sharded, settings.world_size, settings.elem_bytes,
                                                                 settings.hw, settings.replicate), settings):
                uploads = (False, True) if settings.elem_bytes < 4 else (False,)  # upload copies: host RAM for PCIe
                for upload in uploads:
                    _search_layout(lay, settings, best, upload, grads_low)
    if best.choice is None:
        from elixir_ray.planner.refusal import too_small  # it reads the search's results: imported when needed

        raise too_small(settings, best.smallest, profiles)
    found = choice_to_plan(best.choice, settings, note="searched: fastest predicted step within the budget")
    if routed:
        routed_note = ("every chunk replicated: the traced step read values computed from the weights (a learned "
                       "router, say), so ranks may use different parameters in a step")
        found = replace(found, notes=[*found.notes, routed_note])
    return found


def plan_layout(profile: ModelProfile, plan: Plan) -> Layout:
    """The layout a plan was chosen on (its chunk size, ranks, replicated and node-sharded chunks)."""
    nodes = NodeLayout.of(plan.node_of_rank, plan.world_size)
    return make_layout(profile, plan.chunk_size, plan.world_size, ~np.array(plan.sharded, dtype=bool),
                       np.array(plan.node_sharded, dtype=bool) if plan.node_sharded else None, nodes.ranks_per_node)


def _plan_loop(plan: Plan, grad_accum: Optional[int], updates_in_backward: Optional[bool]) -> tuple[int, bool]:
    """(micro-steps, updates start in backward) to re-cost a plan with: those given, else the plan's
    own (a plan older than version 4 says one, and at `step()`)."""
    return (plan.grad_accum if grad_accum is None else grad_accum,
            plan.updates_in_backward if updates_in_backward is None else updates_in_backward)


def _plan_gradients(plan: Plan, grad_accum: Optional[int], updates_in_backward: Optional[bool]) -> tuple[bool, bool]:
    """(`gradients_freed`, `gradients_released`) for a plan, as `_memory_rows` takes them, for the
    loop `_plan_loop` gives."""
    grad_accum, updates_in_backward = _plan_loop(plan, grad_accum, updates_in_backward)
    return gradients_freed(plan.host_grads_low, grad_accum), gradients_released(updates_in_backward, grad_accum)


def plan_buffers_by_sample(plan: Plan, lay: Layout, elem_bytes: int, grad_accum: Optional[int] = None,
                           updates_in_backward: Optional[bool] = None) -> Optional[np.ndarray]:
    """Per memory sample of the trace, then at the optimizer step, the device bytes beside state,
    pool and activations that the plan holds: in backward, gradient buffers (open and in flight),
    the gradients of the device chunks handed on by then (none where they are released once
    applied, `gradients_released`) and the fetch conversion buffer; at the step, `_step_bytes`.
    None without the trace's samples. For the chart: the same moments `_memory_rows` takes the
    worst of."""
    if lay.event_activations is None or lay.event_handed is None:
        return None
    device = np.array([p == "device" for p in plan.placements])
    has_host = not bool(device.all())
    staged = _staged_by_sample(lay, has_host, host_grad_bytes(plan.host_grads_low), plan.world_size)
    any_sharded = plan.world_size > 1 and not bool(lay.replicated.all())
    fetch = _fetch_bytes(lay, elem_bytes, plan.world_size, has_host, plan.upload_copies)
    freed, released = _plan_gradients(plan, grad_accum, updates_in_backward)
    freed = freed and has_host and not released  # as `_memory_rows` takes a row's
    grads = lay.event_handed @ (4.0 * lay.shards * device) if freed else np.zeros(len(staged))
    in_backward = staged + (int(lay.shards.max()) * 4 if any_sharded else 0) + fetch + grads
    in_backward += _dos_buffer_bytes(lay, plan.dos_gap, has_host)  # DOS updates may run at any moment
    step = _step_bytes(lay, plan.dos_gap, has_host, float(lay.shards[device].sum()), freed)
    return np.append(in_backward.astype(float), float(step))


def plan_memory(plan: Plan, profile: ModelProfile, elem_bytes: int, grad_accum: Optional[int] = None,
                updates_in_backward: Optional[bool] = None) -> dict[str, int]:
    """The peak device bytes by part that this version's cost model predicts for an existing plan
    (its placement, pool, DOS gap, copies), traced as `profile`: to set a plan measured earlier
    beside the model as it is now. The micro-steps and where the updates start default to the
    plan's own (`_plan_gradients`)."""
    lay = plan_layout(profile, plan)
    device = np.array([p == "device" for p in plan.placements])
    freed, released = _plan_gradients(plan, grad_accum, updates_in_backward)
    held = MemorySettings(plan.dos_gap, elem_bytes, plan.world_size, plan.upload_copies,
                          host_grad_bytes(plan.host_grads_low), freed, released)
    rows = _memory_rows(lay, plan.n_blocks, device[None, :], held, resident=_plan_resident(plan)[None, :])
    return {part: int(values[0]) for part, values in rows.items()}


def _plan_resident(plan: Plan) -> np.ndarray:
    """The plan's resident chunks as a bool per chunk (none for a plan without the field)."""
    return np.array([plan.is_resident(i) for i in range(plan.n_chunks)], dtype=bool)


def plan_step_seconds(plan: Plan, profile: ModelProfile, hw: HardwareProfile, elem_bytes: int,
                      grad_accum: Optional[int] = None, updates_in_backward: Optional[bool] = None,
                      path: Optional[dict] = None) -> float:
    """The step time this version's cost model predicts for an existing plan (its placement, pool,
    DOS gap, copies), traced as `profile` with its compute set, at the rates `hw`: to set a plan
    measured earlier beside the model as it is now. The micro-steps and where the updates start
    default to the plan's own (`_plan_loop`); `path` (a dict) gets the critical path's pieces."""
    grad_accum, updates_in_backward = _plan_loop(plan, grad_accum, updates_in_backward)
    lay = plan_layout(profile, plan)
    device = np.array([p == "device" for p in plan.placements])
    choice = Choice(lay, plan.n_blocks, device, plan.dos_gap, plan.upload_copies, plan.host_grads_low,
                    plan.prefetch_depth, _plan_resident(plan))
    network = Network.from_dict(plan.network) if plan.network else None
    return evaluate(choice, hw, plan.world_size, elem_bytes, grad_accum, updates_in_backward, path, network)[3]


def replication_layouts(lay: Layout, world: int, elem_bytes: int, hw: HardwareProfile, replicate: str) -> list:
    """The layouts to search for one packing: which chunks every rank keeps whole.

    A replicated chunk needs no all-gather at each fetch but holds its whole state on every rank and
    all-reduces its gradient (twice a reduce-scatter's bytes). "auto" tries none, all, and the
    chunks that save the most gather time per extra byte of state, a quarter, half and three
    quarters of them (at the smallest pool, where they are fetched most)."""
    if world == 1 or replicate == "none":
        return [lay]
    n = len(lay.sizes)
    whole = make_layout(lay.profile, lay.chunk_size, world, np.ones(n, dtype=bool))
    if replicate == "all":
        return [whole]
    gather = lay.sizes * elem_bytes * (world - 1) / world  # bytes each fetch gathers
    saved = loads_at(lay, lay.min_blocks) * gather
    extra = (lay.sizes - lay.shards) * STATE_BYTES
    ranking = np.argsort(-(saved / np.maximum(extra, 1)), kind="stable")
    out = [lay, whole]
    for k in sorted({int(round(f * n)) for f in REPLICATED_FRACTIONS} - {0, n}):
        mask = np.zeros(n, dtype=bool)
        mask[ranking[:k]] = True
        out.append(make_layout(lay.profile, lay.chunk_size, world, mask))
    return out


NODE_SHARDED_FRACTIONS = (0.5, 1.0)  # of a layout's sharded chunks, those node sharding saves most on first


def node_sharding_applies(settings: SearchSettings) -> bool:
    """Whether the search tries sharding chunks within each node: "auto", on several nodes of as
    many ranks each, more than one of them."""
    nodes = settings.nodes
    return (settings.replicate == "auto" and settings.world_size > 1 and nodes.n_nodes > 1
            and nodes.ranks_per_node > 1 and nodes.uniform)


def node_sharding_layouts(layouts: list[Layout], settings: SearchSettings) -> list[Layout]:
    """`layouts` (the first with every chunk sharded across all ranks) and, with "auto" on several
    nodes of as many ranks each, each of them with some of its sharded chunks sharded within each
    node instead: gathered among the ranks of a node, with only the gradient shards crossing
    between nodes, for ranks-per-node times less of the chunk's state on each rank than replicated
    and world/ranks-per-node times more than sharded. The chunks are taken in the order of the
    collective time saved per extra byte of state (at the smallest pool, where they are fetched
    most), half of them and all."""
    if not node_sharding_applies(settings):
        return layouts
    world, lay, k = settings.world_size, layouts[0], settings.nodes.ranks_per_node
    n = len(lay.sizes)
    spread, within = np.zeros(n, dtype=bool), np.ones(n, dtype=bool)

    def collective(node: np.ndarray) -> np.ndarray:
        costs = chunk_costs(lay.sizes, np.where(node, lay.sizes // k, lay.shards), spread, world,
                            settings.elem_bytes, settings.hw, node_sharded=node, network=settings.network)
        return loads_at(lay, lay.min_blocks) * costs.load_device + costs.reduce_device

    saved = collective(spread) - collective(within)
    extra = (lay.sizes // k - lay.shards) * STATE_BYTES
    ranking = np.argsort(-(saved / np.maximum(extra, 1)), kind="stable")
    out = list(layouts)
    for base in layouts:
        free = [c for c in ranking if not base.replicated[c]]
        for m in sorted({max(1, int(round(f * len(free)))) for f in NODE_SHARDED_FRACTIONS} if free else ()):
            mask = np.zeros(n, dtype=bool)
            mask[free[:m]] = True
            out.append(make_layout(lay.profile, lay.chunk_size, world, base.replicated, mask, k))
    return out


def choice_to_plan(choice: Choice, settings: SearchSettings, note: str) -> Plan:
    """The plan of a choice, with its predictions, their breakdowns and the notes that explain them."""
    hw, world, dtype_name, elem_bytes = settings.hw, settings.world_size, settings.dtype_name, settings.elem_bytes
    grad_accum, budget, updates_in_backward = settings.grad_accum, settings.budget, settings.updates_in_backward
    host_budget, margin = settings.host_budget, settings.margin
    path: dict = {}
    memory, time, host_bytes, seconds = evaluate(choice, hw, world, elem_bytes, grad_accum, updates_in_backward, path,
                                                 settings.network)
    lay = choice.layout
    start = "from the last backward" if updates_in_backward else "from step()"
    host_limit = f" (of {format_bytes(host_budget)} allowed, host_memory)" if host_budget is not None else ""
    notes = [note,
             f"device memory usable: {format_bytes(int(budget * (1 - margin)))} of the {format_bytes(budget)} "
             f"budget ({margin:.0%} kept back for the allocator's fragmentation and short-lived buffers)",
             f"optimizer state on the host: {format_bytes(host_bytes)} per rank{host_limit}",
             "the time parts overlap: copies on side streams beside compute, CPU AdamW in the background "
             + ("and Deep Optimizer States on streams of their own " if choice.dos_gap else "")
             + f"{start} until the next forward needs each chunk; the step is the critical path, not the sum",
             critical_path_note(path, grad_accum),
             hw.rates()]
    if choice.kept.any():
        notes.append(resident_note(choice, grad_accum, elem_bytes))
    if gradients_released(updates_in_backward, grad_accum) and bool(choice.device.any()):
        notes.append("device chunks' gradients: each chunk is updated as soon as its gradient is final in the "
                     "backward and its gradient released then, so none is counted beyond the buffers still "
                     "collecting (gradient staging)")
    timing = lay.profile.compute
    if timing is not None:
        estimated = sorted(set(timing.estimated))
        notes.append(f"compute: {timing.timed} distinct kernels timed on {timing.device}" +
                     (f", {len(timing.estimated)} estimated from FLOPs or bytes ({', '.join(estimated[:4])})"
                      if estimated else ""))
    else:
        notes.append(f"compute: traced FLOPs at {hw.matmul_tflops:.3g} TFLOPS (planned away from the device; "
                     f"memory-bound kernels not counted)")
    if lay.profile.checkpointing is not None:
        notes.append(f"activations measured at micro-batch {lay.profile.batch_size}, {grad_accum} micro-step(s) per step")
    if lay.node_sharded.any():
        notes.append(_node_sharding_note(choice, settings, seconds))
    elif node_sharding_applies(settings):
        notes.append(f"sharding within each node (replicated across the {settings.nodes.n_nodes} nodes) was searched "
                     f"too and predicted no faster a step within the budget")
    bound = bounding_note(time, settings.slowest_nodes, settings.network)
    if bound:
        notes.append(bound)
    return Plan(
        chunk_size=lay.chunk_size, n_blocks=choice.n_blocks, param_order=list(lay.param_order),
        placements=["device" if d else "host" for d in choice.device],
        sharded=[bool(not r) for r in lay.replicated], dos_gap=choice.dos_gap, upload_copies=choice.upload,
        node_sharded=[bool(x) for x in lay.node_sharded] if lay.node_sharded.any() else [],
        node_of_rank=list(settings.network.node_of_rank) if settings.network is not None else [],
        network=json.loads(json.dumps(settings.network.to_dict())) if settings.network is not None else {},
        host_grads_low=choice.grads_low and not bool(choice.device.all()), prefetch_depth=choice.depth,
        resident=[bool(x) for x in choice.kept] if choice.kept.any() else [],
        activation_checkpointing=lay.profile.checkpointing, world_size=world, dtype=dtype_name,
        budget_bytes=int(budget), chunk_numels=[int(x) for x in lay.numels],
        predicted_peak_bytes=int(sum(memory.values())), predicted_step_seconds=seconds,
        memory=memory, time=time, notes=notes, hardware=json.loads(hw.to_json()),
        forward_compute_seconds=float(micro_step_compute(lay.profile, hw)[1]), grad_accum=grad_accum,
        updates_in_backward=updates_in_backward, memory_margin=margin,
    )


def resident_note(choice: Choice, grad_accum: int, elem_bytes: int) -> str:
    """Why some host chunks keep their compute copy on the device: the loads a step saves, for how
    many bytes."""
    lay, kept = choice.layout, choice.kept
    pooled = grad_accum * loads_at(lay, choice.n_blocks)  # were they in the pool
    once = resident_loads(lay, kept)
    return (f"resident compute copies: {int(kept.sum())} host chunk(s) keep theirs on the device "
            f"({format_bytes(int(resident_bytes(lay, elem_bytes)[kept].sum()))} beside the pool), loaded "
            f"{int(once.sum())} time(s) a step, once each after its update, where the pool would load them "
            f"{int(pooled[kept].sum())} times")


def _node_sharding_note(choice: Choice, settings: SearchSettings, seconds: float) -> str:
    """Why some chunks are sharded within each node: the collectives' rates, and the step predicted
    with those chunks sharded across all ranks instead."""
    lay, nodes, network = choice.layout, settings.nodes, settings.network
    spread = make_layout(lay.profile, lay.chunk_size, settings.world_size, lay.replicated)
    across = replace(choice, layout=spread)
    alone = evaluate(across, settings.hw, settings.world_size, settings.elem_bytes, settings.grad_accum,
                     settings.updates_in_backward, network=network)[3]
    extra = int(((lay.shards - spread.shards) * STATE_BYTES).sum())

    def rate(scope: str) -> str:
        measured = network.rates(scope) if network is not None else None
        return f"{measured.all_gather_gbps:.3g} GB/s" if measured is not None else "an unmeasured rate"

    return (f"sharded within each node: {int(lay.node_sharded.sum())} chunk(s) split among the "
            f"{nodes.ranks_per_node} ranks of a node and whole on each of the {nodes.n_nodes} nodes, gathered within "
            f"the node (all-gather {rate('node')}) with only their gradient shards all-reduced between nodes "
            f"({rate('peers')}), where sharding across all ranks gathers at {rate('world')}: sharded so instead, the "
            f"step is predicted at {alone * 1e3:,.1f} ms, not {seconds * 1e3:,.1f} ms, for "
            f"{format_bytes(extra)} less state per rank")


def forward_wait(path: dict) -> tuple[float, bool]:
    """(seconds, whether for the host chunks' updates and loads rather than the link's copies) of the
    forward's wait on the critical path (`overlapped_step`'s `path`): the longer of the two counts."""
    cpu, link = float(path["cpu_wait"]), float(path["link_wait"])
    return max(cpu, link, 0.0), cpu >= link


def critical_path_note(path: dict, grad_accum: int = 1) -> str:
    """One line of where the predicted step goes (`overlapped_step`'s `path`): set beside a run's
    measured forward, backward and waits, it says which part of the model is off."""
    def ms(x) -> str:
        return f"{float(x) * 1e3:,.1f} ms"

    cpu, link = float(path["cpu_wait"]), float(path["link_wait"])
    longest, for_updates = forward_wait(path)
    if longest <= 0:
        wait = "no wait"
    elif for_updates:
        wait = (f"a wait of {ms(cpu)} for host chunks' CPU updates and loads"
                + (f" (for copies: {ms(link)})" if link > 0 else ""))
    else:
        wait = (f"a wait of {ms(link)} for copies host->device"
                + (f" (for CPU updates and loads: {ms(cpu)})" if cpu > 0 else ""))
    streams = {"compute": path["rest_compute"], "copies host->device": path["rest_h2d"],
               "copies device->host": path["rest_d2h"]}
    bound = max(streams, key=lambda k: float(streams[k]))
    rest = "recompute, backward and the other micro-steps" if grad_accum > 1 else "recompute and backward"
    return (f"critical path: the forward's compute {ms(path['forward'])}, {wait}, then {rest} {ms(path['rest'])} "
            f"(bound by {bound})")
