"""`elixir-ray doctor`: what a run would find on this cluster, before the first run on it.

It does what a run does until it plans: places one probe per worker as the config places its
workers (`cluster.placement_strategy`, `cluster.cpus_per_worker`, custom resources), forms their
process group, gives each rank its CPU threads, asks each what it sees of the data and checkpoint
directory, and runs the profiling round (copy and CPU AdamW rates, the collectives within and
across nodes; the model's kernels are not timed). Then it prints one row per node, and the settings
the run would take. Nothing is trained, and nothing is written but a probe file in a local
checkpoint directory, removed at once.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Optional

import ray

from elixir_ray.cluster.cpu_shares import give_ranks_their_threads
from elixir_ray.cluster.placement import resolve_worker_shape
from elixir_ray.cluster.shared_storage import look_from_the_ranks
from elixir_ray.cluster.worker_group import WorkerGroup
from elixir_ray.config import RunConfig
from elixir_ray.host_ram import host_ram_bytes


def host_facts() -> dict:
    """Run on a rank: its machine's cores and RAM (total and free), as the operating system says."""
    total, free = host_ram_bytes()
    return {"cores": os.cpu_count() or 0, "ram_total": total, "ram_free": free}


@dataclass
class NodeRow:
    """One node as the probes on it found it (the slowest of its ranks for each rate)."""

    node_id: str
    hostname: str
    ranks: list[int]
    cpus: float  # Ray's CPU resource of the node
    gpus: float
    ram_total: int
    ram_free: int
    h2d_gbps: float
    d2h_gbps: float
    cpu_adam_params_per_s: float
    threads: int  # the threads each rank there gets (the least, where they differ)
    within_gbps: Optional[float]  # all-gather among the node's ranks; None with one rank there
    across_gbps: Optional[float]  # all-gather between nodes; None on a one-node group
    reads: dict[str, bool] = field(default_factory=dict)  # setting -> every rank there reads it as the driver


@dataclass
class DoctorReport:
    rows: list[NodeRow]
    strategy: str
    cpus_per_worker: object  # the setting: "auto" or a number
    workers: int
    use_gpu: bool
    unchecked: list[str]  # settings on object stores, read alike by every node (not probed)

    def table(self) -> str:
        """The report as the command prints it."""
        keys = sorted({k for row in self.rows for k in row.reads})
        head = ["node", "host", "ranks", "CPUs", "GPUs", "RAM GiB (free)", "h2d GB/s", "d2h GB/s",
                "AdamW Mparam/s", "threads/rank", "in-node GB/s", "across GB/s", *keys]
        lines = [head]
        for r in self.rows:
            lines.append([r.node_id[:8], r.hostname, ",".join(map(str, r.ranks)), f"{r.cpus:g}", f"{r.gpus:g}",
                          f"{r.ram_total / 2**30:.1f} ({r.ram_free / 2**30:.1f})", f"{r.h2d_gbps:.2f}",
                          f"{r.d2h_gbps:.2f}", f"{r.cpu_adam_params_per_s / 1e6:.1f}", str(r.threads),
                          _rate(r.within_gbps), _rate(r.across_gbps),
                          *("yes" if r.reads.get(k) else "NO" for k in keys)])
        widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
        text = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
        per_node = ", ".join(f"{r.node_id[:8]}: {len(r.ranks)}" for r in self.rows)
        text.append("")
        text.append(f"settings a run would take: {self.workers} {'GPU' if self.use_gpu else 'CPU'} worker(s), "
                    f"placement {self.strategy} (ranks per node: {per_node}); cluster.cpus_per_worker="
                    f"{self.cpus_per_worker}: threads per rank {', '.join(str(r.threads) for r in self.rows)} "
                    f"(by node, as above)")
        blind = sorted({k for r in self.rows for k, ok in r.reads.items() if not ok})
        if blind:
            text.append(f"not read alike by every node: {', '.join(blind)}: a run is refused until they are on "
                        f"storage every node reads (s3://, gs://, or a filesystem mounted at one path on every node)")
        if self.unchecked:
            text.append(f"on object stores (read alike by every node, not probed): {', '.join(self.unchecked)}")
        return "\n".join(text)


def _rate(gbps: Optional[float]) -> str:
    return "-" if gbps is None else f"{gbps:.2f}"


def diagnose(cfg: RunConfig) -> DoctorReport:
    """Probe the Ray cluster this process is connected to as `cfg` would place its workers."""
    shape = resolve_worker_shape(cfg, ray.cluster_resources())
    probe_cfg = dataclasses.replace(cfg, name=f"{cfg.name}-doctor",
                                    engine=dataclasses.replace(cfg.engine, time_kernels=False))
    group = WorkerGroup(probe_cfg, shape)
    try:
        group.place(first_try=True)
        group.rendezvous()
        threads = give_ranks_their_threads(group, shape)
        views = look_from_the_ranks(group, cfg)  # the run's own paths
        facts = group.get_watched([group.call_rank(r, "run_here", host_facts) for r in range(group.world_size)],
                                  "asking the probes about their machines")
        profiles = group.get_watched(group.call("profile", cfg.train.micro_batch), "profiling the probes")
    finally:
        group.kill()
    nodes = {n["NodeID"]: n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")}
    by_node: dict[str, list[int]] = {}
    for rank, profile in enumerate(profiles):
        by_node.setdefault(profile.node_id, []).append(rank)
    several_nodes = len(by_node) > 1
    rows = []
    for node, ranks in by_node.items():
        hw = [profiles[r].rates for r in ranks]
        nets = [profiles[r].network for r in ranks]
        within = [n["node"]["all_gather_gbps"] for n in nets if "node" in n]
        if not several_nodes:
            within = [n["world"]["all_gather_gbps"] for n in nets if "world" in n]
        across = [n[k]["all_gather_gbps"] for n in nets for k in ("peers",) if k in n]
        if several_nodes and not across:  # one rank per node: all ranks are the peers
            across = [n["world"]["all_gather_gbps"] for n in nets if "world" in n]
        reads = {key: all(views.reads(r)[key] for r in ranks) for key in views.reads(ranks[0])}
        rows.append(NodeRow(
            node_id=node, hostname=profiles[ranks[0]].hostname, ranks=ranks,
            cpus=float(nodes.get(node, {}).get("CPU", 0)), gpus=float(nodes.get(node, {}).get("GPU", 0)),
            ram_total=facts[ranks[0]]["ram_total"], ram_free=facts[ranks[0]]["ram_free"],
            h2d_gbps=min(h.h2d_gbps for h in hw), d2h_gbps=min(h.d2h_gbps for h in hw),
            cpu_adam_params_per_s=min(h.cpu_adam_params_per_s for h in hw),
            threads=min(threads[r] for r in ranks), within_gbps=min(within) if within else None,
            across_gbps=min(across) if across else None, reads=reads))
    unchecked = [key for key, uri in (("data.path", cfg.data.path), ("eval.path", cfg.eval.path),
                                      ("checkpoint.uri", cfg.checkpoint_uri))
                 if uri is not None and "://" in uri and not uri.startswith("file://")]
    return DoctorReport(rows=rows, strategy=shape.strategy, cpus_per_worker=cfg.cluster.cpus_per_worker,
                        workers=shape.num_workers, use_gpu=shape.use_gpu, unchecked=unchecked)
