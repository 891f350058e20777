"""A 2-node simulated cluster (ray.cluster_utils.Cluster), two workers per node: the profiling round
times the collectives within each node, across all ranks and between the nodes, and the plan is
made for those nodes.

Run by tests/test_multinode.py in its own process, because it needs a cluster of its own.
Prints one JSON line with what happened.
"""

import json
import sys

import ray
from ray.cluster_utils import Cluster

import elixir_ray


def main(dataset: str, out_dir: str) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": 150 * 2**20,
                                                                 "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=2, object_store_memory=100 * 2**20)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="elixir_ray_multinode", log_to_driver=False)
    cfg = {
        "name": "two-nodes", "output_dir": out_dir,
        "model": {"size": "tiny", "n_layers": 2, "seq_len": 64},
        "data": {"path": dataset},
        "train": {"steps": 2, "micro_batch": 2},
        "cluster": {"num_workers": 4},
        "engine": {"time_kernels": False},
    }
    result = elixir_ray.train(cfg, progress=False)
    engine = elixir_ray.Plan.from_dict(result.plan.engine)
    print(json.dumps({
        "steps": result.metrics.column("step").to_pylist(),
        "node_of_rank": engine.node_of_rank,
        "network": engine.network,
        "explain": engine.explain(),
    }))
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
