"""A 3-node simulated cluster (ray.cluster_utils.Cluster), one worker per node; a node is removed mid-run
and, once the run goes on with two workers, a node is added again: the run grows back to three at
its next checkpoint.

Run by tests/test_multinode.py in its own process, because it needs a cluster of its own.
Prints one JSON line with what happened.
"""

import json
import logging
import sys
import threading
import time

import ray
from ray.cluster_utils import Cluster

import elixir_ray
import elixir_ray.checkpoint


def main(dataset: str, out_dir: str) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0,  # the driver's node hosts no worker
        "object_store_memory": 150 * 2**20,
        "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                           "health_check_timeout_ms": 500},
    })
    nodes = [cluster.add_node(num_cpus=1, object_store_memory=100 * 2**20) for _ in range(3)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="elixir_ray_multinode", log_to_driver=False)
    removed, added = {}, {}

    shrunk = threading.Event()

    class ShrinkSeen(logging.Handler):
        """Hears the driver decide to go on with fewer workers: only then does a node join again."""

        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("continuing elastically"):
                shrunk.set()

    logging.getLogger("elixir_ray").addHandler(ShrinkSeen(level=logging.WARNING))

    cfg = {
        "name": "elastic", "output_dir": out_dir,
        "model": {"size": "tiny", "n_layers": 2, "seq_len": 64},
        "data": {"path": dataset},
        "train": {"steps": 30, "micro_batch": 2, "grad_accum": 2},
        "cluster": {"num_workers": 3, "min_workers": 2},
        "checkpoint": {"every_steps": 3},
        "fault": {"max_restarts": 2, "wait_for_resources_s": 3, "detect_timeout_s": 30},
    }
    outcome = {}

    def run() -> None:
        try:
            outcome["result"] = elixir_ray.train(cfg, progress=False)
        finally:
            shrunk.set()  # a run that ended without shrinking lets the main thread go on

    # the run trains in a thread: the main thread changes the cluster (Ray starts a node's processes
    # from the main thread only)
    training = threading.Thread(target=run, daemon=True)
    training.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and "at" not in removed and training.is_alive():
        try:
            actor = ray.get_actor("elastic/worker-2", namespace="elixir_ray")
            if ray.get(actor.current_step.remote(), timeout=5) >= 4:
                node_id = ray.get(actor.node_info.remote(), timeout=5)["node_id"]
                victim = next(n for n in nodes if n.node_id == node_id)
                removed["at"] = time.time()
                cluster.remove_node(victim, allow_graceful=False)
        except Exception:
            pass
        time.sleep(0.05)
    if shrunk.wait(timeout=240) and training.is_alive():
        cluster.add_node(num_cpus=1, object_store_memory=100 * 2**20)
        added["at"] = time.time()
    training.join()
    result = outcome["result"]
    shrunk_plan = next(plan for plan in result.plans if plan.world_size == 2)
    print(json.dumps({
        "config": cfg,
        "losses": result.metrics.column("loss").to_pylist(),
        "placed": [(p.step, len(p.node_ids)) for p in result.placements],
        "restores": [(r.step, r.source, r.world_size) for r in result.restores],
        "node_added": "at" in added,
        "steps": result.metrics.column("step").to_pylist(),
        "world_sizes": [r.world_size for r in result.restarts],
        "restored_from": [r.restored_from for r in result.restarts],
        "restored_step": [r.restored_step for r in result.restarts],
        "plan_world_size": result.plan.world_size,
        "shrunk_plan_micro_batch": shrunk_plan.micro_batch,
        "shrunk_plan_grad_accum": shrunk_plan.grad_accum,
        "node_removed": "at" in removed,
        "checkpoint": result.checkpoint_uri,
        "manifest_global_batch": elixir_ray.checkpoint.read_manifest(result.checkpoint_uri).get("global_batch"),
    }))
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
