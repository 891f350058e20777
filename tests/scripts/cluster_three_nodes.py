"""A 3-node simulated cluster (ray.cluster_utils.Cluster) of 2, 4 and 6 CPUs, each node with a cache
directory of its own ($XDG_CACHE_HOME), the driver's node hosting no worker. In one cluster:

- `elixir-ray doctor`'s table, six probes spread two to a node;
- a run of three workers, SPREAD, `cpus_per_worker: auto`, on the built-in corpus (built on each
  node in its own cache directory);
- a run of four workers that resumes the first run's checkpoint from durable storage, loses a rank
  mid-run and restores from the object store: what each rank read at each restore;
- a run whose data.path only the driver's process can read (a descriptor it holds open, as a disk
  only the driver's machine has), refused before training.

Run by tests/test_multinode.py in its own process, because it needs a cluster of its own.
Prints one JSON line with what happened.
"""

import json
import os
import sys
import threading
import time

import ray
from ray.cluster_utils import Cluster

import elixir_ray
from elixir_ray.cluster.doctor import diagnose
from elixir_ray.config import config_from_dict
from elixir_ray.errors import ConfigError
from elixir_ray.run.resolved import resolve_run

NODE_CPUS = (2, 4, 6)
DRIVER_ONLY_FD = 900  # a descriptor number no worker process has open


def base_config(name: str, out_dir: str, **sections) -> dict:
    cfg = {"name": name, "output_dir": out_dir, "model": {"size": "tiny", "n_layers": 2, "seq_len": 64},
           "data": {"path": "builtin"}, "train": {"micro_batch": 2}, "engine": {"time_kernels": False}}
    for key, value in sections.items():
        cfg.setdefault(key, {}).update(value)
    return cfg


def kill_a_rank_at(name: str, rank: int, step: int, killed: dict) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            actor = ray.get_actor(f"{name}/worker-{rank}", namespace="elixir_ray")
            if ray.get(actor.current_step.remote(), timeout=5) >= step:
                ray.kill(actor, no_restart=True)
                killed["at"] = time.time()
                return
        except Exception:
            pass
        time.sleep(0.05)


def main(dataset: str, out_dir: str) -> None:
    os.environ["XDG_CACHE_HOME"] = os.path.join(out_dir, "cache-driver")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": 150 * 2**20})
    nodes = [cluster.add_node(num_cpus=cpus, object_store_memory=100 * 2**20,
                              env_vars={"XDG_CACHE_HOME": os.path.join(out_dir, f"cache-node{i}")})
             for i, cpus in enumerate(NODE_CPUS)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="elixir_ray_multinode", log_to_driver=False)
    cpus_of = {node.node_id: cpus for node, cpus in zip(nodes, NODE_CPUS)}
    report: dict = {}

    doctor_cfg = resolve_run(config_from_dict(base_config("doctor", out_dir, cluster={
        "num_workers": 6, "placement_strategy": "SPREAD"}))).config
    doctor = diagnose(doctor_cfg)
    report["doctor_table"] = doctor.table()
    report["doctor_rows"] = [{"cpus": r.cpus, "ranks": r.ranks, "ram_total": r.ram_total, "h2d": r.h2d_gbps,
                              "d2h": r.d2h_gbps, "adam": r.cpu_adam_params_per_s, "threads": r.threads,
                              "within": r.within_gbps, "across": r.across_gbps, "reads": r.reads}
                             for r in doctor.rows]

    spread = elixir_ray.train(base_config("spread", out_dir, train={"steps": 3}, cluster={
        "num_workers": 3, "placement_strategy": "SPREAD"}, engine={"replicate": "none"}), progress=False)
    (placed,) = spread.placements
    report["spread"] = {"steps": spread.metrics.column("step").to_pylist(),
                        "node_cpus": [cpus_of.get(node) for node in placed.node_ids], "threads": placed.threads,
                        "caches_built": sorted(d for d in os.listdir(out_dir) if d.startswith("cache-") and os.listdir(
                            os.path.join(out_dir, d, "elixir_ray")))}

    killed: dict = {}
    threading.Thread(target=kill_a_rank_at, args=("restore", 1, 6, killed), daemon=True).start()
    restore = elixir_ray.train(base_config("restore", out_dir, train={"steps": 8}, cluster={"num_workers": 4},
                                           engine={"replicate": "none"}, checkpoint={"every_steps": 2},
                                           fault={"max_restarts": 1}),
                               progress=False, resume=spread.checkpoint_uri)
    report["restore"] = {"steps": restore.metrics.column("step").to_pylist(), "killed": "at" in killed,
                         "restores": [{"step": r.step, "source": r.source, "world_size": r.world_size,
                                       "read_bytes": r.read_bytes, "state_bytes": r.state_bytes}
                                      for r in restore.restores]}

    with open(dataset, "rb") as f:
        os.dup2(f.fileno(), DRIVER_ONLY_FD)
    try:
        elixir_ray.train(base_config("driver-only", out_dir, train={"steps": 1}, cluster={"num_workers": 3},
                                     data={"path": f"/proc/self/fd/{DRIVER_ONLY_FD}"}), progress=False)
        report["refused"] = None
    except ConfigError as exc:
        report["refused"] = str(exc)
    finally:
        os.close(DRIVER_ONLY_FD)
    print(json.dumps(report))
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
