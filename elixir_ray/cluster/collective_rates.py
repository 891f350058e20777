"""The collectives' rates between the ranks, timed on the ranks in the profiling round.

Every rank calls `measure_collectives` at once, in the process group the run trains in. It times
an all-gather and a reduce-scatter of a buffer about a chunk's size, and an all-gather of one
element per rank (a call's latency), in each kind of group a plan uses (`planner.network`): the
ranks of its node, all ranks, and the ranks of its local rank on every node. Every group of a
kind runs at once, as a step runs them (every node's gathers together, every local rank's
all-reduce between nodes together), so that ranks sharing a node's links are timed sharing them.
A kind of group that would only repeat another is not timed: with one node, the node's ranks are
all ranks, and with one rank per node, its peers are.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from elixir_ray.chunk_plan.nodes import NodeLayout
from elixir_ray.engine.comm import Comm
from elixir_ray.planner.hardware import median_seconds

REPEATS = 3  # timed calls of each collective, after one warm-up; the median counts


def _median_seconds(fn, device: torch.device, comm: Comm) -> float:
    """Median seconds of REPEATS calls of `fn` after a warm-up, each started together on the group's
    ranks (a tiny all-reduce first): a rank that comes late to a collective would count as slow."""
    token = torch.zeros(1)
    return median_seconds(fn, device, REPEATS, before=lambda: comm.all_reduce_sum(token))


def _time_group(comm: Comm, device: torch.device, numel: int, dtype: torch.dtype) -> dict:
    """{"all_gather_gbps", "reduce_scatter_gbps", "latency_s"} of one group (GB/s of bus bandwidth:
    the gathered or reduced buffer's bytes times (n - 1) / n over the time beyond the latency)."""
    n = comm.world
    shard = max(1, numel // n)
    gathered = torch.empty(shard * n, dtype=dtype, device=device)
    mine = torch.ones(shard, dtype=dtype, device=device)
    full = torch.ones(shard * n, dtype=torch.float32, device=device)  # gradients are reduced in fp32
    part = torch.empty(shard, dtype=torch.float32, device=device)
    tiny_out, tiny = torch.empty(n, dtype=dtype, device=device), torch.ones(1, dtype=dtype, device=device)
    latency = _median_seconds(lambda: comm.all_gather(tiny_out, tiny), device, comm)
    gather = _median_seconds(lambda: comm.all_gather(gathered, mine), device, comm)
    reduce = _median_seconds(lambda: comm.reduce_scatter_mean(part, full), device, comm)
    spread = (n - 1) / n

    def gbps(nbytes: int, seconds: float) -> float:
        return nbytes * spread / max(seconds - latency, seconds / 10, 1e-9) / 1e9

    return {"all_gather_gbps": gbps(gathered.numel() * gathered.element_size(), gather),
            "reduce_scatter_gbps": gbps(full.numel() * 4, reduce), "latency_s": latency}


def measure_collectives(node_of_rank: list[int], device: torch.device, numel: int,
                        dtype: torch.dtype = torch.float32) -> dict:
    """This rank's {kind of group: rates} (`_time_group`), `numel` elements gathered and reduced
    (the gather in the compute dtype `dtype`). A collective: every rank of the default group calls it
    with the same `node_of_rank`. The groups made here are destroyed before it returns."""
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = NodeLayout.of(node_of_rank, world)
    out = {"world": _time_group(Comm(dist.group.WORLD, device), device, numel, dtype)} if world > 1 else {}
    kinds = []
    if layout.n_nodes > 1 and max(len(r) for r in layout.node_ranks) > 1:
        kinds.append(("node", layout.node_ranks))
    if layout.n_nodes > 1 and layout.ranks_per_node > 1:
        kinds.append(("peers", layout.peer_groups))
    for kind, groups in kinds:
        made = [dist.new_group(ranks) for ranks in groups]  # every rank makes every group, in one order
        try:
            mine = next(g for g, ranks in zip(made, groups) if rank in ranks)
            if len(next(ranks for ranks in groups if rank in ranks)) > 1:
                out[kind] = _time_group(Comm(mine, device), device, numel, dtype)
            dist.barrier()  # no group is destroyed while a rank of another still uses its own
        finally:
            for group in made:
                if group not in (None, dist.GroupMember.NON_GROUP_MEMBER):
                    dist.destroy_process_group(group)
    return out
