"""Placing the workers: resource checks, the gang placement group, and rank order.

Ranks are ordered by node, then by GPU, as the launchers of distributed torch do; the node that
hosts the driver comes first so that rank 0 (the rendezvous host) sits beside it when it can.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from elixir_ray.config import RunConfig
from elixir_ray.engine.host_updates import update_threads
from elixir_ray.errors import ClusterError, ConfigError

log = logging.getLogger("elixir_ray")

QUIET_WAIT_S = 1.0  # a reservation that takes longer than this is waiting for resources, and says so


@dataclass
class WorkerShape:
    num_workers: int
    use_gpu: bool
    cpus_per_worker: int

    @property
    def bundle(self) -> dict:
        bundle = {"CPU": self.cpus_per_worker}
        if self.use_gpu:
            bundle["GPU"] = 1
        return bundle

    @property
    def backend(self) -> str:
        return "nccl" if self.use_gpu else "gloo"


def resolve_worker_shape(cfg: RunConfig, resources: dict) -> WorkerShape:
    """Defaults from what the cluster has; errors name the config field to change."""
    gpus = int(resources.get("GPU", 0))
    cpus = int(resources.get("CPU", 0))
    use_gpu = cfg.cluster.use_gpu if cfg.cluster.use_gpu is not None else gpus > 0
    if use_gpu and gpus == 0:
        raise ConfigError("cluster.use_gpu is true but the Ray cluster has no GPUs (set cluster.use_gpu: false)")
    num = cfg.cluster.num_workers or (gpus if use_gpu else 2)
    per = cfg.cluster.cpus_per_worker
    if use_gpu and num > gpus:
        raise ConfigError(f"cluster.num_workers={num} but the Ray cluster has {gpus} GPU(s): use at most {gpus}")
    if num * per > cpus:
        raise ConfigError(
            f"cluster.num_workers={num} x cluster.cpus_per_worker={per} needs {num * per} CPUs "
            f"but the Ray cluster has {cpus}: lower one of them"
        )
    return WorkerShape(num_workers=num, use_gpu=use_gpu, cpus_per_worker=per)


def workers_that_fit(shape: WorkerShape, available: dict) -> int:
    """How many of the shape's bundles the currently free resources could hold."""
    return min(int(available.get(res, 0) // amount) for res, amount in shape.bundle.items())


def cpu_thread_hint(shape: WorkerShape, workers_per_node: dict[str, int], node_cpus: dict[str, float],
                    node_gpus: dict[str, float]) -> Optional[str]:
    """A warning when GPU workers were given far fewer CPUs than their share of their nodes: each
    worker runs its host-resident chunks' AdamW on all but one of its `cluster.cpus_per_worker`
    threads (at least one), and on one GPU that update is often what limits the step, so the
    default of 1 leaves a 16-core machine's cores idle. The share is per GPU of the node, not per
    worker of this run, so that the node's other GPUs keep theirs (another run, a sweep's trial).
    Only a hint: the reservation is what the config asked for."""
    if not shape.use_gpu or not workers_per_node:
        return None
    share = min(int(node_cpus.get(node, 0) // max(count, node_gpus.get(node, 0)))
                for node, count in workers_per_node.items())
    have, could = update_threads(shape.cpus_per_worker), update_threads(share)
    if could < 2 * have:
        return None
    return (f"each GPU worker runs the CPU AdamW of its host-resident chunks on {have} thread(s) (all but one of "
            f"cluster.cpus_per_worker={shape.cpus_per_worker}), while its node has {share} CPUs per GPU"
            f"{' (the smallest node)' if len(workers_per_node) > 1 else ''}: set cluster.cpus_per_worker={share} "
            f"(--set cluster.cpus_per_worker={share}) for {could} update threads, unless other work needs those CPUs")


def _free(bundle: dict) -> str:
    available = ray.available_resources()
    return ", ".join(f"{available.get(res, 0):g} {res}" for res in bundle)


class PlacementTimeoutError(ClusterError):
    """The cluster did not reserve the workers' bundles in time: other runs or tasks hold them."""


def create_placement_group(shape: WorkerShape, timeout_s: float):
    """Reserve one bundle per worker, waiting up to `timeout_s` (cluster.placement_timeout_s). A
    reservation not made at once (another run holds the resources) is said in one line, with how
    long it will be waited for, rather than waited for in silence."""
    pg = placement_group([shape.bundle] * shape.num_workers, strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=min(QUIET_WAIT_S, timeout_s))
    if not ready and timeout_s > QUIET_WAIT_S:
        log.warning("waiting for the cluster to free %d x %s for the workers (free now: %s): up to "
                    "cluster.placement_timeout_s=%gs", shape.num_workers, shape.bundle, _free(shape.bundle),
                    timeout_s)
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s - QUIET_WAIT_S)
    if not ready:
        table = placement_group_table(pg)
        remove_placement_group(pg)
        raise PlacementTimeoutError(
            f"could not reserve {shape.num_workers} x {shape.bundle} within cluster.placement_timeout_s="
            f"{timeout_s:g}s (placement group state: {table.get('state')}; free now: "
            f"{_free(shape.bundle)}): other runs or tasks hold them; free them, or raise "
            f"cluster.placement_timeout_s to wait longer"
        )
    return pg


def bundle_rank_order(pg, driver_node_id: str, timeout_s: float = 10.0) -> list[int]:
    """Bundle indices in rank order: grouped by node (driver's node first), bundle order within."""
    deadline = time.monotonic() + timeout_s
    while True:
        nodes = placement_group_table(pg).get("bundles_to_node_id", {})
        if len(nodes) == len(pg.bundle_specs) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    node_order: dict[str, int] = {}
    keys = sorted(nodes.items(), key=lambda kv: (kv[1] != driver_node_id, kv[1], kv[0]))
    for _, node in keys:
        node_order.setdefault(node, len(node_order))
    return sorted(range(len(pg.bundle_specs)), key=lambda i: (node_order.get(nodes.get(i), 0), i))
