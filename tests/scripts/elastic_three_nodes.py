"""A 3-node simulated cluster (ray.cluster_utils.Cluster), one worker per node; a node is removed mid-run.

Run by tests/test_multinode.py in its own process, because it needs a cluster of its own.
Prints one JSON line with what happened.
"""

import json
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
    removed = {}

    def remove_a_node_mid_run():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                actor = ray.get_actor("elastic/worker-2", namespace="elixir_ray")
                if ray.get(actor.current_step.remote(), timeout=5) >= 4:
                    node_id = ray.get(actor.node_info.remote(), timeout=5)["node_id"]
                    victim = next(n for n in nodes if n.node_id == node_id)
                    removed["at"] = time.time()
                    cluster.remove_node(victim, allow_graceful=False)
                    return
            except Exception:
                pass
            time.sleep(0.05)

    threading.Thread(target=remove_a_node_mid_run, daemon=True).start()
    cfg = {
        "name": "elastic", "output_dir": out_dir,
        "model": {"size": "tiny", "n_layers": 2, "seq_len": 64},
        "data": {"path": dataset},
        "train": {"steps": 30, "micro_batch": 2, "grad_accum": 2},
        "cluster": {"num_workers": 3},
        "checkpoint": {"every_steps": 3},
        "fault": {"max_restarts": 2, "elastic": True, "wait_for_resources_s": 3, "detect_timeout_s": 30},
    }
    result = elixir_ray.train(cfg, progress=False)
    print(json.dumps({
        "steps": result.metrics.column("step").to_pylist(),
        "world_sizes": [r.world_size for r in result.restarts],
        "restored_from": [r.restored_from for r in result.restarts],
        "restored_step": [r.restored_step for r in result.restarts],
        "plan_world_size": result.plan.world_size,
        "plan_micro_batch": result.plan.micro_batch,
        "plan_grad_accum": result.plan.grad_accum,
        "node_removed": "at" in removed,
        "checkpoint": result.checkpoint_uri,
        "manifest_global_batch": elixir_ray.checkpoint.read_manifest(result.checkpoint_uri).get("global_batch"),
    }))
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
