"""Each rank's CPU threads: `cluster.cpus_per_worker`, or with `auto` its share of its node's CPUs.

A rank runs its host-resident chunks' AdamW on all but one of its torch threads
(`engine.host_updates.update_threads`), and on a GPU node that update is often what bounds the
step: one thread per rank leaves a 64-core node's cores idle. With `auto` each worker reserves one
CPU in Ray (the least a rank needs, so that runs sharing a cluster still place), and once the ranks
are placed each takes as threads its node's CPUs divided among the ranks placed there, or among the
node's GPUs where there are more (the node's other GPUs keep their share, for another run or a
sweep's trial), one CPU kept back on the driver's node for the driver.
"""

from __future__ import annotations

from collections import Counter

import ray
import torch

from elixir_ray.cluster.placement import WorkerShape
from elixir_ray.engine.host_updates import update_threads


def node_shares(node_ids: list[str], node_cpus: dict[str, float], node_gpus: dict[str, float], driver_node: str,
                use_gpu: bool) -> list[int]:
    """Per rank (its node's id in `node_ids`), the threads `auto` gives it: at least one."""
    ranks_on = Counter(node_ids)
    shares = []
    for node in node_ids:
        cpus = int(node_cpus.get(node, 0)) - (1 if node == driver_node else 0)
        sharers = max(ranks_on[node], int(node_gpus.get(node, 0)) if use_gpu else 0)
        shares.append(max(1, cpus // sharers))
    return shares


def use_threads(count: int) -> dict:
    """Run on a rank: torch's intra-op threads set to `count`, which the engine's CPU updates follow
    (all but one of them); what the rank now has."""
    torch.set_num_threads(count)
    return {"threads": torch.get_num_threads(), "update_threads": update_threads()}


def give_ranks_their_threads(group, shape: WorkerShape) -> list[int]:
    """Set each placed rank's threads (`cluster.cpus_per_worker`, or with `auto` its node's share);
    the threads each rank has, in rank order."""
    if shape.threads_from_node:
        nodes = [info for info in ray.nodes() if info.get("Alive")]
        counts = node_shares(group.node_ids,
                             {n["NodeID"]: float(n.get("Resources", {}).get("CPU", 0)) for n in nodes},
                             {n["NodeID"]: float(n.get("Resources", {}).get("GPU", 0)) for n in nodes},
                             ray.get_runtime_context().get_node_id(), shape.use_gpu)
    else:
        counts = [shape.cpus_per_worker] * group.world_size
    refs = [group.call_rank(rank, "run_here", use_threads, count) for rank, count in enumerate(counts)]
    return [had["threads"] for had in group.get_watched(refs, "setting the ranks' CPU threads")]


def reserved_threads(cpus_per_worker) -> int:
    """The threads a worker starts with, before it is placed: `cpus_per_worker`, or one with `auto`."""
    return 1 if cpus_per_worker == "auto" else max(1, int(cpus_per_worker))
