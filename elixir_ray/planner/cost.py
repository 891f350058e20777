"""The cost model: predicted peak device memory and step time of a placement, from measured rates.

It models what the engine does, and nothing it does not:
- every micro-step loads each chunk it needs into a pool block (Belady eviction, cold after each
  optimizer step): a host chunk copies its fp32 shard over PCIe, or with upload copies (a plan
  choice: 2 more host bytes per parameter) its shard already cast to the compute dtype; a device
  chunk only casts on the device; a sharded chunk is then all-gathered;
- each chunk's gradient is reduced (reduce-scatter when sharded, all-reduce when replicated) and,
  for a host chunk, copied to the host, once per micro-step (in bf16 with bf16 compute and one
  micro-step per step: `host_grads_low_applies`);
- the engine's own kernels move device memory beside the model's (`engine kernels`, costed at the
  device AdamW's memory rate and put on the compute stream, whose memory-bound kernels they slow
  wherever they run): each load of a device chunk casts its fp32 master into the block, and each
  micro-step copies every gradient into its chunk's staging buffer: fp32, but in the compute dtype
  for a host chunk whose gradient goes down in it with one rank (else widened, then cast back);
- the optimizer updates each chunk where its state lives (CPU AdamW, device AdamW, or for Deep
  Optimizer States chunks a copy to the device, a device update and a copy back).
What overlaps what (`overlapped_step`): host-to-device loads run ahead on a side stream (prefetch)
and gradient copies to the host on another, both beside the compute stream; Deep Optimizer States
updates run on streams of their own, and the CPU AdamW on a background thread, from `step()` (or
from each chunk's final gradient in the last backward, when updates may start in backward) until
the next forward needs each chunk: the DOS copies take the link's time that backward's copies
leave idle, then share it with the next forward's loads, and only their device update joins the
compute stream. The predicted step is the critical path of its two phases, the forward and the
rest, not the sum.
Rates come from `HardwareProfile`. Compute is the sum of the step's kernels, each timed on the
device (`op_timing`), or, when the plan is made away from the device, the traced FLOPs at the
measured matmul rate (which misses memory-bound kernels: on an H100 a third of a GPT's step).
Collectives are charged at the rates the ranks measured (`planner.network`: within a node, across
all ranks, between nodes), each call its latency plus its bytes over its group's rate; where none
were measured, at `collective_gbps`, or the host-to-device rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from elixir_ray.chunk_plan.buffers import staged_low
from elixir_ray.chunk_plan.nodes import NodeLayout
from elixir_ray.planner.hardware import HardwareProfile
from elixir_ray.planner.network import GroupRates, Network

STATE_BYTES = 16  # per element of a chunk's shard: fp32 master, gradient, exp_avg, exp_avg_sq


def host_grads_low_applies(dtype_name: str, grad_accum: int, allowed: bool = True) -> bool:
    """Whether host chunks' gradients cross and wait in the compute dtype (`Plan.host_grads_low`):
    with bf16 compute and one micro-step per step, where autograd computed each gradient in bf16
    anyway and nothing accumulates on the host. Not with fp16 (loss-scaled gradients, unscaled on
    the host, would lose their small values) and not where the micro-steps are unknown (`allowed`)."""
    return allowed and dtype_name == "bfloat16" and grad_accum == 1


def host_grad_bytes(grads_low: bool) -> int:
    """Bytes per element of a host chunk's gradient on the host and over PCIe."""
    return 2 if grads_low else 4


def host_state_bytes(elem_bytes: int, upload: bool, grad_bytes: int = 4) -> int:
    """Host bytes per element of a host chunk: fp32 master and moments, its gradient, plus the
    upload copy in a lower compute dtype."""
    return STATE_BYTES - 4 + grad_bytes + (elem_bytes if upload and elem_bytes < 4 else 0)


def load_bytes(elem_bytes: int, upload: bool) -> int:
    """Bytes per element a host chunk's load moves over PCIe: its upload copy, or the fp32 master."""
    return min(elem_bytes, 4) if upload else 4
# bytes of device memory a device AdamW update moves per element (fp32 master, gradient and both
# moments read, master and moments written): the profile's device AdamW rate times this is the
# rate the engine's own memory-bound kernels are costed at
DEVICE_ADAM_BYTES = 28
DOS_COPY_IN = 12  # master and both moments go to the device, and the gradient (its bytes apart)
DOS_COPY_OUT = 12  # master and both moments come back (and the upload copy, its bytes apart)


@dataclass
class ChunkCosts:
    """Per-chunk seconds (numpy arrays, one entry per chunk) for a given pool size."""

    load_host: np.ndarray  # one load of the chunk when its state is on the host
    load_device: np.ndarray  # one load when its state is on the device
    reduce_host: np.ndarray  # gradient reduction plus the copy to the host, per micro-step
    reduce_device: np.ndarray
    adam_host: np.ndarray
    adam_device: np.ndarray
    adam_dos: np.ndarray  # a host chunk updated on the device (Deep Optimizer States): the three below
    dos_in: np.ndarray  # its copies to the device
    dos_out: np.ndarray  # its copies back
    dos_update: np.ndarray  # its update on the device
    # the engine's own device kernels (beside the model's), at the device's memory rate:
    fill_device: np.ndarray  # one load of a chunk whose state is on the device: its master cast into the block
    stage: np.ndarray  # per micro-step, a device chunk: its gradients copied (widened) into its fp32 staging buffer
    # per micro-step, a host chunk: its gradients copied into its staging buffer, in the compute dtype
    # where they go down in it with one rank (chunk_plan.buffers.staged_low), else widened and then cast back
    stage_host: np.ndarray


@dataclass(frozen=True)
class Link:
    """One kind of group's collectives as the cost model charges them: bytes per second of bus
    bandwidth for an all-gather and a reduce-scatter, seconds per call beyond the bytes, and the
    share of a buffer each rank moves (n - 1) / n over the group's n ranks."""

    gather: float
    reduce: float
    latency: float
    spread: float

    def gather_seconds(self, nbytes):
        return nbytes * self.spread / self.gather + self.latency

    def reduce_seconds(self, nbytes):
        return nbytes * self.spread / self.reduce + self.latency

    def all_reduce_seconds(self, nbytes):
        """A reduce-scatter and an all-gather of the reduced buffer, counted as one call."""
        return nbytes * self.spread / self.reduce + nbytes * self.spread / self.gather + self.latency


@dataclass(frozen=True)
class Collectives:
    """What collectives cost on a plan's ranks (`collectives`): across all of them (`world`), within
    a node (`node`, for chunks sharded within each node) and among the ranks of one local rank on
    every node (`peers`); `ranks_per_node` ranks on each node, the size of a node-sharded chunk's
    shard group."""

    world: Link
    node: Link
    peers: Link
    ranks_per_node: int


def collectives(hw: HardwareProfile, world: int, network: Optional[Network] = None) -> Collectives:
    """The measured rates of `network` where it has them; a kind of group it lacks is charged as all
    ranks are, and those, unmeasured, at `collective_gbps` (or the host-to-device rate) with no latency."""
    layout = network.layout(world) if network is not None else NodeLayout.of((), world)
    k, n = layout.ranks_per_node, layout.n_nodes

    def link(rates: Optional[GroupRates], ranks: int, otherwise: Link) -> Link:
        spread = (ranks - 1) / ranks if ranks > 1 else 0.0
        if rates is None:
            return Link(otherwise.gather, otherwise.reduce, otherwise.latency, spread)
        return Link(rates.all_gather_gbps * 1e9, rates.reduce_scatter_gbps * 1e9, rates.latency_s, spread)

    coll = (getattr(hw, "collective_gbps", 0.0) or hw.h2d_gbps) * 1e9
    everyone = link(network.world if network is not None else None, world, Link(coll, coll, 0.0, 0.0))
    return Collectives(world=everyone, node=link(network.node if network is not None else None, k, everyone),
                       peers=link(network.peers if network is not None else None, n, everyone), ranks_per_node=k)


def chunk_costs(sizes: np.ndarray, shards: np.ndarray, replicated: np.ndarray, world: int, elem_bytes: int,
                hw: HardwareProfile, upload: bool = False, grad_bytes: int = 4,
                node_sharded: Optional[np.ndarray] = None, network: Optional[Network] = None) -> ChunkCosts:
    """`node_sharded` (bool per chunk, where `replicated` is not): sharded within each node and
    replicated across nodes, its shard gathered within the node and its gradient reduce-scattered
    there, then all-reduced among the ranks holding the same shard (`network`'s rates)."""
    h2d, d2h = (rate * 1e9 for rate in hw.link_rates())  # as the copies run in training, beside the CPU job
    gather, reduce_comm = _collective_seconds(sizes, shards, replicated, node_sharded, world, elem_bytes,
                                              collectives(hw, world, network))
    dos_in = shards * (DOS_COPY_IN + grad_bytes) / h2d
    dos_out = shards * (DOS_COPY_OUT + (elem_bytes if upload and elem_bytes < 4 else 0)) / d2h
    dos_update = shards / hw.device_adam_params_per_s
    memory_rate = hw.device_adam_params_per_s * DEVICE_ADAM_BYTES
    return ChunkCosts(
        load_host=shards * load_bytes(elem_bytes, upload) / h2d + gather,
        load_device=gather,
        reduce_host=reduce_comm + shards * grad_bytes / d2h,
        reduce_device=reduce_comm,
        adam_host=shards / hw.cpu_adam_rate(low_grads=grad_bytes < 4),
        adam_device=shards / hw.device_adam_params_per_s,
        adam_dos=dos_in + dos_out + dos_update, dos_in=dos_in, dos_out=dos_out, dos_update=dos_update,
        fill_device=shards * (4 + elem_bytes) / memory_rate,
        stage=sizes * (elem_bytes + 4) / memory_rate,
        stage_host=(sizes * (elem_bytes + grad_bytes) if staged_low(grad_bytes < 4, world) else
                    sizes * (elem_bytes + 4) + shards * ((4 + grad_bytes) if grad_bytes < 4 else 0)) / memory_rate,
    )


def _collective_seconds(sizes, shards, replicated, node_sharded, world: int, elem_bytes: int, coll: Collectives):
    """Per chunk: (one fetch's all-gather, one micro-step's gradient reduction) in seconds. A
    sharded chunk gathers its compute copy and reduce-scatters its fp32 gradient across all ranks,
    a replicated one all-reduces its gradient, a node-sharded one gathers and reduce-scatters
    within the node, then all-reduces its gradient shard between the nodes."""
    if world <= 1:
        return np.zeros(len(sizes)), np.zeros(len(sizes))
    node = np.zeros(len(sizes), dtype=bool) if node_sharded is None else np.asarray(node_sharded, dtype=bool)
    gathered, grads = sizes * elem_bytes, sizes * 4
    gather = np.where(replicated, 0.0, np.where(node, coll.node.gather_seconds(gathered),
                                                coll.world.gather_seconds(gathered)))
    node_reduce = coll.node.reduce_seconds(grads) + coll.peers.all_reduce_seconds(shards * 4)
    reduce_comm = np.where(replicated, coll.world.all_reduce_seconds(grads),
                           np.where(node, node_reduce, coll.world.reduce_seconds(grads)))
    return gather, reduce_comm


def compute_seconds(flops: int, hw: HardwareProfile) -> float:
    return flops / (hw.matmul_tflops * 1e12)


def micro_step_compute(profile, hw: HardwareProfile) -> tuple[float, float]:
    """(seconds of one micro-step's kernels, of which forward): the kernels' times measured on the
    device when the profile has them (`op_timing`), else the traced FLOPs at the matmul rate."""
    if profile.compute is not None:
        return profile.compute.step_seconds, profile.compute.forward_seconds
    return compute_seconds(profile.trace.flops, hw), compute_seconds(profile.trace.forward_flops, hw)


@dataclass(frozen=True)
class StepParts:
    """The parts of a step that `overlapped_step` overlaps: floats, or numpy arrays (one entry per
    candidate) that broadcast together; its docstring says what each is."""

    compute: Any
    forward: Any
    on_stream: Any
    h2d: Any
    d2h: Any
    cpu_adam: Any
    cpu_wait: Any  # seconds, or a function of the last backward's seconds that says them
    updates_in_backward: bool
    micro_steps: int = 1
    dos_in: Any = 0.0
    dos_out: Any = 0.0
    forward_loads: Any = 0.0
    dos_first_at: Any = None
    loads_to_dos: Any = None
    dos_queue_in: Any = None
    dos_queue_out: Any = None
    dos_after: Any = None


def overlapped_step(parts: StepParts, path: Optional[dict] = None):
    """Predicted step seconds from its parts (floats or numpy arrays, broadcast), as the engine overlaps them.

    The parts (`StepParts`): compute: forward, recompute and backward of every one of
    `micro_steps` micro-steps; forward: one micro-step's forward (updates start only in the last micro-step's backward);
    on_stream: other work on the compute stream (collectives, device AdamW, the device updates of
    Deep Optimizer States, the engine's kernels); h2d, d2h: the side streams' copies (loads,
    gradients); cpu_adam: the background thread's CPU AdamW; cpu_wait: how long the next forward
    waits for the host chunks' CPU updates and their loads after them (at least the work left
    after backward beyond the forward), or a function of the last backward's seconds that says it
    (`search._cpu_wait`, which plays their queue out: when the updates become ready depends on how
    long backward lasts, and that is the longest of its streams, not its compute alone); dos_in,
    dos_out: the Deep Optimizer States copies each way; forward_loads: the first forward's own loads of host chunks (one each),
    a part of `h2d`; dos_first_at: the forward's compute before its first DOS chunk (default: the
    whole forward, as with no DOS chunk); loads_to_dos: the forward's loads up to and including
    that chunk's (default: all of them); both count only with `updates_in_backward`;
    dos_queue_in, dos_queue_out, dos_after (`search._dos_queue`): per chunk in the order their
    gradients are final, the DOS copies each way of the chunks final no earlier (-inf for a chunk
    not on DOS), and the share of the last backward after its gradient is final; a suffix of the
    queue cannot start before its first chunk's gradient (default: the whole queue may start as
    backward does).

    A step is two phases, because nothing crosses `step()` but the updates: the forward, which
    the host chunks' updates must reach (the pool is cold after a step, and a host chunk is loaded
    only once its update is done), and the rest (recomputation, backward, the other micro-steps),
    whose loads and gradient copies overlap its compute on the side streams. Each phase lasts as
    long as its longest stream. The updates (CPU AdamW, and the DOS chunks' copies, their two
    streams moving the two directions at once) start at `step()`, or with `updates_in_backward` in
    the last backward, where the DOS copies take the link's time that backward's own copies leave
    idle (taken as spread evenly over backward), each chunk's copies only after its gradient is
    final, in the order the gradients are. What is left goes on in the forward: its loads and the
    DOS copies share the link there, and the forward waits for whichever is later, the link or the
    CPU AdamW's remainder. The DOS chunks' gradients are final in backward's order, the reverse of
    the forward's, so the first DOS chunk the forward needs is the last in their queue: the
    forward stops there until the whole queue has gone through (with its loads so far), and only
    its compute before that chunk hides the queue (on the H100 the forward of gpt-4b waited 0.3 s
    there, 2026-11-27). Not so for updates started at `step()`, which queues them in chunk order,
    the forward's.

    `path`, where given a dict, gets the critical path's pieces: the forward's compute, its waits
    for the CPU updates and for the link (the longer counts), the rest's length and its three
    streams' (compute and the compute stream's other work; loads; copies down).
    """
    compute, forward, h2d, d2h, cpu_adam, cpu_wait = (parts.compute, parts.forward, parts.h2d, parts.d2h,
                                                      parts.cpu_adam, parts.cpu_wait)
    updates_in_backward, micro_steps, forward_loads = parts.updates_in_backward, parts.micro_steps, parts.forward_loads
    dos_in, dos_out, dos_after = parts.dos_in, parts.dos_out, parts.dos_after
    rest_parts = (compute + parts.on_stream - forward, np.maximum(h2d - forward_loads, 0.0), d2h)
    rest = np.maximum(rest_parts[0], np.maximum(rest_parts[1], rest_parts[2]))
    if updates_in_backward:  # the last backward hides updates; with one micro-step, all of `rest` is it
        last_backward = rest if micro_steps == 1 else np.maximum(compute / micro_steps - forward, 0.0)
        backward_in = np.maximum(h2d - forward_loads, 0.0) / micro_steps
        idle_in = np.maximum(last_backward - backward_in, 0.0)  # the link time backward's own copies leave
        idle_out = np.maximum(last_backward - d2h / micro_steps, 0.0)
        if dos_after is None:
            dos_in = np.maximum(dos_in - idle_in, 0.0)
            dos_out = np.maximum(dos_out - idle_out, 0.0)
        else:  # each suffix of the queue from its first gradient on: the most that outlasts the idle link
            after = np.asarray(dos_after)
            dos_in = np.maximum(np.max(parts.dos_queue_in - np.expand_dims(idle_in, -1) * after, axis=-1), 0.0)
            dos_out = np.maximum(np.max(parts.dos_queue_out - np.expand_dims(idle_out, -1) * after, axis=-1), 0.0)
    else:
        last_backward = 0.0
    left = np.maximum(cpu_adam - last_backward, 0.0)  # CPU work still to do when backward ends
    if callable(cpu_wait):  # updates from step() on are ready together, whatever backward's length
        # 0 where no chunk is loaded; its loads are waited for even with no CPU update to wait for
        cpu_wait = cpu_wait(last_backward if updates_in_backward else rest)
    else:
        cpu_wait = np.where(cpu_adam > 0, cpu_wait, 0.0)
    cpu_exposed = np.maximum(left - forward, cpu_wait)
    link_exposed = np.maximum(np.maximum(forward_loads + dos_in, dos_out) - forward, 0.0)
    dos_first_at = parts.dos_first_at
    if dos_first_at is not None and updates_in_backward:  # it waits at its first DOS chunk for the whole queue
        loads_to = forward_loads if parts.loads_to_dos is None else parts.loads_to_dos
        at_first = np.maximum(np.maximum(loads_to + dos_in, dos_out) - dos_first_at, 0.0)
        # then its later loads go on beside its later compute, on a link the queue has left
        after = np.maximum((forward_loads - loads_to) - (forward - dos_first_at), 0.0)
        link_exposed = np.maximum(link_exposed, at_first + after)
    if path is not None:  # the critical path's pieces, for a plan's explanation
        path.update(forward=forward, cpu_wait=cpu_exposed, link_wait=link_exposed, rest=rest,
                    rest_compute=rest_parts[0], rest_h2d=rest_parts[1], rest_d2h=rest_parts[2])
    return forward + np.maximum(cpu_exposed, link_exposed) + rest


def dos_mask(host: np.ndarray, gap) -> np.ndarray:
    """Which chunks the engine updates on the device under Deep Optimizer States with this gap.

    `host` is a boolean array (one row per candidate, or a single row); the engine counts host
    chunks in chunk order and sends every gap-th one to the device (none with a gap of 0). `gap`:
    an int, or an integer array broadcast against `host`'s rows (gaps x 1 x 1: one mask per gap).
    """
    gap = np.asarray(gap)
    position = np.cumsum(host, axis=-1) - 1
    return host & (gap > 0) & (position % np.maximum(gap, 1) == gap - 1)
