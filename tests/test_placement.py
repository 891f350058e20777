"""Placement decisions that are pure functions of the cluster's shape."""

from elixir_ray.cluster.placement import WorkerShape, cpu_thread_hint


def test_gpu_workers_left_on_one_thread_of_a_big_node_are_told_the_share_to_set():
    shape = WorkerShape(num_workers=2, use_gpu=True, cpus_per_worker=1)
    hint = cpu_thread_hint(shape, {"a": 1, "b": 1}, {"a": 16.0, "b": 8.0})
    # the smallest node's share: a larger setting could not be placed on node b
    assert hint is not None and "cluster.cpus_per_worker=8" in hint and "cluster.cpus_per_worker=1 " in hint


def test_two_workers_on_a_node_split_its_cpus():
    shape = WorkerShape(num_workers=2, use_gpu=True, cpus_per_worker=1)
    assert "cluster.cpus_per_worker=8" in cpu_thread_hint(shape, {"a": 2}, {"a": 16.0})


def test_no_hint_when_the_workers_already_have_their_share_or_run_on_cpus():
    assert cpu_thread_hint(WorkerShape(1, True, 12), {"a": 1}, {"a": 16.0}) is None
    assert cpu_thread_hint(WorkerShape(2, True, 1), {"a": 2}, {"a": 3.0}) is None
    assert cpu_thread_hint(WorkerShape(2, False, 1), {"a": 2}, {"a": 64.0}) is None  # the CPU workers' compute
    assert cpu_thread_hint(WorkerShape(1, True, 1), {"a": 1}, {}) is None  # a node Ray no longer lists
