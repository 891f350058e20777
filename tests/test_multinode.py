"""Scenarios that need a Ray cluster of their own (several simulated nodes, process-wide limits).

Each runs a script from tests/scripts/ in its own process and reads the JSON line it prints.
"""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray]

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.extended
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


@pytest.mark.extended
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


@pytest.mark.extended
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


def test_three_nodes_doctor_share_cpus_restore_in_parts_refuse_driver_paths_and_grow_back(tmp_path, tiny_dataset):
    """One cluster of nodes with 2, 4 and 6 CPUs (tests/scripts/cluster_three_nodes.py): the doctor's
    table; `cpus_per_worker: auto` and SPREAD on the built-in corpus, built where each worker runs; a
    4-rank restore from durable storage and from the object store reading at most 30% of the state
    per rank; a driver-only data.path refused; and cluster.min_workers: a node removed mid-run, the
    run goes on with the two workers left, a node added again, it grows back to three at its next
    checkpoint, every loss the one an uninterrupted run takes at the same global batch."""
    from test_train_ray import reference_losses

    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "scripts", "cluster_three_nodes.py"), tiny_dataset, str(tmp_path)],
        capture_output=True, text=True, timeout=540, env={**os.environ, "RAY_ADDRESS": ""},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print("phases ended at (s):", report["seconds"])

    doctor = report["doctor"]
    assert doctor["exit"] == 0, doctor
    table = doctor["table"]
    print(table)
    head, *lines = table.splitlines()
    rows = [dict(zip(re.split(r"\s{2,}", head), re.split(r"\s{2,}", line))) for line in lines[:3]]
    assert sorted(int(row["CPUs"]) for row in rows) == [2, 4, 6], table
    for row in rows:
        assert len(row["ranks"].split(",")) == 2, table  # two probes on each node
        ram, free = (float(x) for x in row["RAM GiB (free)"].replace("(", "").replace(")", "").split())
        rates = [float(row[key]) for key in ("h2d GB/s", "d2h GB/s", "AdamW Mparam/s", "in-node GB/s", "across GB/s")]
        assert ram > 0 and free > 0 and all(rate > 0 for rate in rates), row
        assert int(row["threads/rank"]) == int(row["CPUs"]) // 2, row  # two ranks share each node
        assert row["data.path"] == row["checkpoint.uri"] == "yes", row
    assert "placement PACK" in table and "cluster.cpus_per_worker=auto" in table, table

    spread = report["spread"]
    assert spread["steps"] == [1, 2, 3]
    assert sorted(spread["node_cpus"]) == [2, 4, 6]  # one rank per node
    assert spread["threads"] == spread["node_cpus"]  # each rank its whole node (the driver's is the head)
    # the corpus was built in every node's own cache directory, and the driver's
    assert spread["caches_built"] == ["cache-driver", "cache-node0", "cache-node1", "cache-node2"]

    restore = report["restore"]
    assert restore["killed"] and restore["steps"] == [4, 5, 6, 7]  # resumed at the spread run's step 3
    sources = [(r["source"], r["world_size"]) for r in restore["restores"]]
    assert sources == [("durable", 4), ("object_store", 4)], sources
    for r in restore["restores"]:
        print(f"restore from {r['source']} onto 4 ranks: each read {[round(b / r['state_bytes'], 3) for b in r['read_bytes']]} "
              f"of the state's {r['state_bytes']} bytes")
        assert max(r["read_bytes"]) <= 0.3 * r["state_bytes"], r
        # all together the state about once (each rank's slices hold their share of the chunks'
        # padding too, 10 to 45% of a chunk in this plan): the figure is what was read
        assert 0.9 * r["state_bytes"] <= sum(r["read_bytes"]) <= 1.25 * r["state_bytes"], r

    refused = report["refused"]
    assert refused is not None and refused.startswith("data.path '/proc/self/fd/900' is read by the driver but not "
                                                      "where worker(s) 0 (node "), refused
    assert "s3://" in refused and "gs://" in refused and "mounted at the same path on every node" in refused

    elastic = report["elastic"]
    assert elastic["node_removed"]
    assert elastic["steps"] == list(range(1, 16))
    assert elastic["world_sizes"] == [2]  # the one restart, after the loss, went on with two
    assert [workers for _, workers in elastic["placed"]] == [3, 2, 3], elastic["placed"]
    grown_at = elastic["placed"][2][0]
    assert elastic["node_added"] and grown_at % 3 == 0 and grown_at > elastic["restored_step"][0], elastic
    assert elastic["restores"][-1] == [grown_at, "object_store", 3]
    assert elastic["plan_world_size"] == 3
    # the global batch (2 x 2 x 3 = 12) is kept: 2 workers take 6 samples each
    assert elastic["shrunk_plan_samples"] == 6
    assert elastic["manifest_global_batch"] == 12  # what a resume compares its own with
    assert elastic["restored_step"][0] % 3 == 0
    assert elastic["checkpoint"]
    reference, _ = reference_losses(elastic["config"], world_size=3)  # one process, the global batch of 12
    np.testing.assert_allclose(elastic["losses"], reference, rtol=0, atol=1e-5)
