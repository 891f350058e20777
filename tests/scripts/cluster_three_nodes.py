"""A simulated cluster (ray.cluster_utils.Cluster) of three nodes with 2, 4 and 6 CPUs, each with a
cache directory of its own ($XDG_CACHE_HOME) and two `slot`s (a custom resource), the driver's node
hosting no worker. In one cluster, one phase after another:

- doctor: `elixir-ray doctor`'s table, six probes, two to a node (one slot each);
- spread: three workers, SPREAD, `cpus_per_worker: auto`, on the built-in corpus (built on each node
  in its own cache directory);
- restore: four workers resume the spread run's checkpoint from durable storage, lose a rank mid-run
  and restore from the object store: what each rank read at each restore;
- refused: a data.path only the driver's process reads (a descriptor it holds open, as a disk only
  the driver's machine has), refused before training;
- elastic: three workers, one per node (two slots each), `min_workers: 2`; a node is removed mid-run
  and, once the run goes on with two workers, added again: the run grows back to three at its next
  checkpoint.

Run by tests/test_multinode.py in its own process, because it needs a cluster of its own.
Prints one JSON line with what happened.
"""

import contextlib
import io
import json
import logging
import os
import sys
import threading
import time

import ray
from ray.cluster_utils import Cluster

import elixir_ray
import elixir_ray.checkpoint
from elixir_ray import cli
from elixir_ray.errors import ConfigError

NODE_CPUS = (2, 4, 6)
DRIVER_ONLY_FD = 900  # a descriptor number no worker process has open


def base_config(name: str, out_dir: str, **sections) -> dict:
    cfg = {"name": name, "output_dir": out_dir, "model": {"size": "tiny", "n_layers": 2, "seq_len": 64},
           "data": {"path": "builtin"}, "train": {"micro_batch": 2}, "engine": {"time_kernels": False}}
    for key, value in sections.items():
        cfg.setdefault(key, {}).update(value)
    return cfg


def actor_at_step(name: str, rank: int, step: int):
    """The rank's actor once it has trained `step` steps, else None."""
    try:
        actor = ray.get_actor(f"{name}/worker-{rank}", namespace="elixir_ray")
        return actor if ray.get(actor.current_step.remote(), timeout=5) >= step else None
    except Exception:
        return None


def kill_a_rank_at(name: str, rank: int, step: int, killed: dict) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        actor = actor_at_step(name, rank, step)
        if actor is not None:
            ray.kill(actor, no_restart=True)
            killed["at"] = time.time()
            return
        time.sleep(0.05)


def add_node(cluster: Cluster, out_dir: str, index: int, cpus: int):
    return cluster.add_node(num_cpus=cpus, resources={"slot": 2}, object_store_memory=100 * 2**20,
                            env_vars={"XDG_CACHE_HOME": os.path.join(out_dir, f"cache-node{index}")})


def doctor_phase(dataset: str, out_dir: str) -> dict:
    """`elixir-ray doctor` as the command runs, on the prepared dataset (the built-in corpus is first
    built by the spread run's workers): what it prints."""
    overrides = {"name": "doctor", "output_dir": out_dir, "model.n_layers": 2, "model.seq_len": 64,
                 "data.path": dataset, "engine.time_kernels": "false", "cluster.num_workers": 6,
                 "cluster.resources_per_worker": "{slot: 1}"}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = cli.main(["doctor", "tiny", *(arg for key, value in overrides.items()
                                             for arg in ("--set", f"{key}={value}"))])
    return {"exit": code, "table": printed.getvalue()}


def elastic_phase(cluster: Cluster, nodes: list, dataset: str, out_dir: str) -> dict:
    shrunk = threading.Event()

    class ShrinkSeen(logging.Handler):
        """Hears the driver decide to go on with fewer workers: only then does a node join again."""

        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("continuing elastically"):
                shrunk.set()

    logging.getLogger("elixir_ray").addHandler(ShrinkSeen(level=logging.WARNING))
    cfg = base_config("elastic", out_dir, data={"path": dataset}, train={"steps": 15, "grad_accum": 2},
                      cluster={"num_workers": 3, "min_workers": 2, "cpus_per_worker": 1,
                               "resources_per_worker": {"slot": 2}},
                      checkpoint={"every_steps": 3},
                      fault={"max_restarts": 2, "wait_for_resources_s": 3, "detect_timeout_s": 30})
    outcome, removed, added = {}, {}, {}
    back = threading.Event()  # the removed node is in the cluster again

    def until_the_node_is_back(row: dict) -> None:
        """The run's first step on two workers waits for the node's return (up to 20 s, within
        fault.detect_timeout_s): however long the node takes to start, checkpoints are left to grow at."""
        if shrunk.is_set() and not back.is_set():
            back.wait(timeout=20)

    def run() -> None:
        try:
            outcome["result"] = elixir_ray.train(cfg, progress=False, on_metrics=until_the_node_is_back)
        finally:
            shrunk.set()  # a run that ended without shrinking lets the main thread go on

    # the run trains in a thread: the main thread changes the cluster (Ray starts a node's processes
    # from the main thread only)
    training = threading.Thread(target=run, daemon=True)
    training.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and "at" not in removed and training.is_alive():
        actor = actor_at_step("elastic", 2, 4)
        if actor is not None:
            node_id = ray.get(actor.node_info.remote(), timeout=5)["node_id"]
            index, victim = next((i, n) for i, n in enumerate(nodes) if n.node_id == node_id)
            removed["at"] = time.time()
            cluster.remove_node(victim, allow_graceful=False)
        time.sleep(0.05)
    if shrunk.wait(timeout=180) and training.is_alive():
        add_node(cluster, out_dir, index, NODE_CPUS[index])
        added["at"] = time.time()
    back.set()
    training.join()
    result = outcome["result"]
    shrunk_plan = next(plan for plan in result.plans if plan.world_size == 2)
    return {
        "config": cfg,
        "losses": result.metrics.column("loss").to_pylist(),
        "placed": [(p.step, len(p.node_ids)) for p in result.placements],
        "restores": [(r.step, r.source, r.world_size) for r in result.restores],
        "node_removed": "at" in removed, "node_added": "at" in added,
        "steps": result.metrics.column("step").to_pylist(),
        "world_sizes": [r.world_size for r in result.restarts],
        "restored_step": [r.restored_step for r in result.restarts],
        "plan_world_size": result.plan.world_size,
        "shrunk_plan_samples": shrunk_plan.micro_batch * shrunk_plan.grad_accum,
        "checkpoint": result.checkpoint_uri,
        "manifest_global_batch": elixir_ray.checkpoint.read_manifest(result.checkpoint_uri).get("global_batch"),
    }


def main(dataset: str, out_dir: str) -> None:
    os.environ["XDG_CACHE_HOME"] = os.path.join(out_dir, "cache-driver")
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": 150 * 2**20, "include_dashboard": False,
        "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                           "health_check_timeout_ms": 500},
    })
    nodes = [add_node(cluster, out_dir, i, cpus) for i, cpus in enumerate(NODE_CPUS)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="elixir_ray_multinode", log_to_driver=False)
    cpus_of = {node.node_id: cpus for node, cpus in zip(nodes, NODE_CPUS)}
    report: dict = {"seconds": {}}
    started = time.monotonic()

    report["doctor"] = doctor_phase(dataset, out_dir)
    report["seconds"]["doctor"] = round(time.monotonic() - started, 1)

    spread = elixir_ray.train(base_config("spread", out_dir, train={"steps": 3}, cluster={
        "num_workers": 3, "placement_strategy": "SPREAD"}, engine={"replicate": "none"}), progress=False)
    (placed,) = spread.placements
    report["spread"] = {"steps": spread.metrics.column("step").to_pylist(),
                        "node_cpus": [cpus_of.get(node) for node in placed.node_ids], "threads": placed.threads,
                        "caches_built": sorted(d for d in os.listdir(out_dir) if d.startswith("cache-") and os.listdir(
                            os.path.join(out_dir, d, "elixir_ray")))}
    report["seconds"]["spread"] = round(time.monotonic() - started, 1)

    killed: dict = {}
    threading.Thread(target=kill_a_rank_at, args=("restore", 1, 5, killed), daemon=True).start()
    restore = elixir_ray.train(base_config("restore", out_dir, train={"steps": 7},
                                           cluster={"num_workers": 4, "cpus_per_worker": 1},
                                           engine={"replicate": "none"}, checkpoint={"every_steps": 2},
                                           fault={"max_restarts": 1}),
                               progress=False, resume=spread.checkpoint_uri)
    report["restore"] = {"steps": restore.metrics.column("step").to_pylist(), "killed": "at" in killed,
                         "restores": [{"step": r.step, "source": r.source, "world_size": r.world_size,
                                       "read_bytes": r.read_bytes, "state_bytes": r.state_bytes}
                                      for r in restore.restores]}
    report["seconds"]["restore"] = round(time.monotonic() - started, 1)

    with open(dataset, "rb") as f:
        os.dup2(f.fileno(), DRIVER_ONLY_FD)
    try:
        elixir_ray.train(base_config("driver-only", out_dir, train={"steps": 1}, cluster={"num_workers": 1},
                                     data={"path": f"/proc/self/fd/{DRIVER_ONLY_FD}"}), progress=False)
        report["refused"] = None
    except ConfigError as exc:
        report["refused"] = str(exc)
    finally:
        os.close(DRIVER_ONLY_FD)
    report["seconds"]["refused"] = round(time.monotonic() - started, 1)

    report["elastic"] = elastic_phase(cluster, nodes, dataset, out_dir)
    report["seconds"]["elastic"] = round(time.monotonic() - started, 1)
    print(json.dumps(report))
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
