"""Placement decisions that are pure functions of the cluster's shape."""

from elixir_ray.cluster.placement import WorkerShape, cpu_thread_hint


def test_gpu_workers_left_on_one_thread_of_a_big_node_are_told_the_share_to_set():
    shape = WorkerShape(num_workers=2, use_gpu=True, cpus_per_worker=1)
    hint = cpu_thread_hint(shape, {"a": 1, "b": 1}, {"a": 16.0, "b": 8.0}, {"a": 1.0, "b": 1.0})
    # the smallest node's share: a larger setting could not be placed on node b
    assert hint is not None and "cluster.cpus_per_worker=8 " in hint and "on 1 thread(s)" in hint
    assert "for 7 update threads" in hint


def test_the_share_is_per_gpu_of_the_node_not_per_worker_of_this_run():
    # 2 of a 64-CPU node's 8 GPUs: 8 CPUs each, leaving the other GPUs theirs
    hint = cpu_thread_hint(WorkerShape(2, True, 1), {"a": 2}, {"a": 64.0}, {"a": 8.0})
    assert "cluster.cpus_per_worker=8 " in hint
    assert "cluster.cpus_per_worker=8 " in cpu_thread_hint(WorkerShape(2, True, 1), {"a": 2}, {"a": 16.0}, {"a": 2.0})


def test_no_hint_unless_the_share_at_least_doubles_the_update_threads():
    # 2 CPUs per GPU would still give one update thread: nothing to gain
    assert cpu_thread_hint(WorkerShape(1, True, 1), {"a": 1}, {"a": 2.0}, {"a": 1.0}) is None
    # 2 -> 3 CPUs takes the update threads from 1 to 2
    assert "cluster.cpus_per_worker=3 " in cpu_thread_hint(WorkerShape(1, True, 2), {"a": 1}, {"a": 3.0}, {"a": 1.0})
    assert cpu_thread_hint(WorkerShape(1, True, 12), {"a": 1}, {"a": 16.0}, {"a": 1.0}) is None
    assert cpu_thread_hint(WorkerShape(2, False, 1), {"a": 2}, {"a": 64.0}, {}) is None  # CPU workers
    assert cpu_thread_hint(WorkerShape(1, True, 1), {"a": 1}, {}, {}) is None  # a node Ray no longer lists
