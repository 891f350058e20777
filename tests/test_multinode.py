"""Scenarios that need a Ray cluster of their own (several simulated nodes, process-wide limits).

Each runs a script from tests/scripts/ in its own process and reads the JSON line it prints.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))


def test_node_lost_mid_run_continues_elastically_on_two_workers(tiny_dataset, tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "scripts", "elastic_three_nodes.py"), tiny_dataset, str(tmp_path)],
        capture_output=True, text=True, timeout=420, env={**os.environ, "RAY_ADDRESS": ""},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["node_removed"]
    assert report["steps"] == list(range(1, 31))
    assert report["world_sizes"] == [2]
    assert report["plan_world_size"] == 2
    # the global batch (2 x 2 x 3 = 12) is kept: 2 workers take 6 samples each
    assert report["plan_micro_batch"] * report["plan_grad_accum"] == 6
    assert report["manifest_global_batch"] == 12  # what a resume compares its own with
    assert report["restored_step"][0] % 3 == 0
    assert report["checkpoint"]


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
