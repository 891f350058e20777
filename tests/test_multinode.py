"""Scenarios that need a Ray cluster of their own (several simulated nodes, process-wide limits).

Each runs a script from tests/scripts/ in its own process and reads the JSON line it prints.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))


def test_node_lost_mid_run_continues_on_two_workers_and_grows_back_to_three(tiny_dataset, tmp_path):
    """cluster.min_workers: a node removed mid-run, the run goes on with the two workers left; a node
    added again, it grows back to three at its next checkpoint; every loss is the one an
    uninterrupted run takes at the same global batch."""
    from test_train_ray import reference_losses

    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "scripts", "elastic_three_nodes.py"), tiny_dataset, str(tmp_path)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "RAY_ADDRESS": ""},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["node_removed"]
    assert report["steps"] == list(range(1, 31))
    assert report["world_sizes"] == [2]  # the one restart, after the loss, went on with two
    assert [workers for _, workers in report["placed"]] == [3, 2, 3], report["placed"]
    grown_at = report["placed"][2][0]
    assert report["node_added"] and grown_at % 3 == 0 and grown_at > report["restored_step"][0], report
    assert report["restores"][-1] == [grown_at, "object_store", 3]
    assert report["plan_world_size"] == 3
    # the global batch (2 x 2 x 3 = 12) is kept: 2 workers take 6 samples each
    assert report["shrunk_plan_micro_batch"] * report["shrunk_plan_grad_accum"] == 6
    assert report["manifest_global_batch"] == 12  # what a resume compares its own with
    assert report["restored_step"][0] % 3 == 0
    assert report["checkpoint"]
    reference, _ = reference_losses(report["config"], world_size=3)  # one process, the global batch of 12
    np.testing.assert_allclose(report["losses"], reference, rtol=0, atol=1e-5)


def test_full_disk_during_persist_reports_and_keeps_training(tiny_dataset, tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "scripts", "full_disk.py"), tiny_dataset, str(tmp_path)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "RAY_ADDRESS": ""},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["steps"] == [1, 2, 3, 4]  # training went on
    assert report["checkpoint"] is None
    assert report["reported"] == len(report["errors"]) == 2  # each failed write logged once
    assert "File too large" in report["errors"][0] or "too large" in report["errors"][0].lower()
    assert report["committed"] == []  # nothing half-written is ever picked up
    assert report["leftovers"] == []  # and the temporary directories were cleaned away


def test_runs_started_from_threads_share_the_ray_that_train_starts(tiny_dataset, tmp_path):
    """A sweep's runs in threads of a process without Ray: the first to end shut Ray down under
    the others (their workers vanished), and two starting at once raced in ray.init."""
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "scripts", "runs_in_threads.py"), tiny_dataset, str(tmp_path)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "RAY_ADDRESS": ""},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["errors"] == {}
    assert report["results"] == {"short": 3, "same-time": 3, "long": 40}
    assert not report["ray_left_running"]  # the last run to end shut it down


def test_two_nodes_profile_their_links_and_the_plan_is_made_for_those_nodes(tiny_dataset, tmp_path):
    """The Ray path fills each rank's node from the workers' node ids, and the ranks' measured rates
    (within a node, across all ranks, between the nodes) reach the plan and its explanation."""
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "scripts", "two_nodes_network.py"), tiny_dataset, str(tmp_path)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "RAY_ADDRESS": ""},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["steps"] == [1, 2]
    assert report["node_of_rank"] == [0, 0, 1, 1]
    for scope in ("node", "world", "peers"):
        rates = report["network"][scope]
        assert rates["all_gather_gbps"] > 0 and rates["reduce_scatter_gbps"] > 0 and rates["latency_s"] > 0, scope
    assert len(report["network"]["peers"]["nodes"]) == 2 and len(report["network"]["node"]["nodes"]) == 1
    assert "collectives between nodes: all-gather" in report["explain"]


def test_three_nodes_share_cpus_spread_restore_in_parts_and_refuse_a_driver_only_path(tmp_path, tiny_dataset):
    """Nodes of 2, 4 and 6 CPUs: the doctor's table; `cpus_per_worker: auto` and SPREAD on the
    built-in corpus, built where each worker runs; a 4-rank restore from durable storage and from
    the object store reading at most 30% of the state per rank; a driver-only data.path refused."""
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "scripts", "cluster_three_nodes.py"), tiny_dataset, str(tmp_path)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "RAY_ADDRESS": ""},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])

    rows = report["doctor_rows"]
    assert sorted(row["cpus"] for row in rows) == [2, 4, 6] and all(len(row["ranks"]) == 2 for row in rows), rows
    for row in rows:
        for key in ("ram_total", "h2d", "d2h", "adam", "threads", "within", "across"):
            assert row[key] is not None and row[key] > 0, (key, row)
        assert row["threads"] == row["cpus"] // 2  # two ranks share each node
        assert row["reads"] == {"data.path": True, "checkpoint.uri": True}, row
    table = report["doctor_table"]
    assert "in-node GB/s" in table and "across GB/s" in table and "placement SPREAD" in table, table

    spread = report["spread"]
    assert spread["steps"] == [1, 2, 3]
    assert sorted(spread["node_cpus"]) == [2, 4, 6]  # one rank per node
    assert spread["threads"] == spread["node_cpus"]  # each rank its whole node (the driver's is the head)
    # the corpus was built in every node's own cache directory, and the driver's
    assert spread["caches_built"] == ["cache-driver", "cache-node0", "cache-node1", "cache-node2"]

    restore = report["restore"]
    assert restore["killed"] and restore["steps"] == [4, 5, 6, 7, 8]  # resumed at the first run's step 3
    sources = [(r["source"], r["world_size"]) for r in restore["restores"]]
    assert sources == [("durable", 4), ("object_store", 4)], sources
    for r in restore["restores"]:
        assert max(r["read_bytes"]) <= 0.3 * r["state_bytes"], r
        assert min(r["read_bytes"]) >= 0.2 * r["state_bytes"], r  # a quarter each: the figure is what was read

    refused = report["refused"]
    assert refused is not None and refused.startswith("data.path '/proc/self/fd/900' is read by the driver but not "
                                                      "where worker(s) 0, 1, 2"), refused
    assert "s3://" in refused and "gs://" in refused and "mounted at the same path on every node" in refused
