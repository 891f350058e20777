"""Placement decisions that are pure functions of the cluster's shape."""

import pytest

from elixir_ray.cluster.cpu_shares import node_shares
from elixir_ray.cluster.elastic import grows_back, minimum_workers, workers_after_loss
from elixir_ray.cluster.placement import WorkerShape, cpu_thread_hint, resolve_worker_shape
from elixir_ray.config import config_from_dict
from elixir_ray.errors import ConfigError


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


def test_auto_gives_each_rank_its_share_of_its_nodes_cpus():
    # one rank on each of three nodes of 2, 4 and 6 CPUs, the driver elsewhere: each its whole node
    assert node_shares(["a", "b", "c"], {"a": 2, "b": 4, "c": 6}, {}, "head", use_gpu=False) == [2, 4, 6]
    # two ranks on the 6-CPU node share it; the driver's node keeps one CPU back
    assert node_shares(["c", "c", "a"], {"a": 2, "c": 6}, {}, "c", use_gpu=False) == [2, 2, 2]
    # GPU ranks share per GPU of the node: 2 ranks of a 64-CPU, 8-GPU node leave the other GPUs theirs
    assert node_shares(["g", "g"], {"g": 64}, {"g": 8}, "head", use_gpu=True) == [8, 8]
    assert node_shares(["a"], {"a": 1}, {}, "a", use_gpu=False) == [1]  # at least one


def test_auto_reserves_one_cpu_a_worker_and_custom_resources_are_in_each_bundle():
    cfg = config_from_dict({"cluster": {"num_workers": 3, "placement_strategy": "SPREAD",
                                        "resources_per_worker": {"fast_disk": 1}}})
    shape = resolve_worker_shape(cfg, {"CPU": 3, "fast_disk": 3})
    assert shape.threads_from_node and shape.cpus_per_worker == 1 and shape.strategy == "SPREAD"
    assert shape.bundle == {"CPU": 1, "fast_disk": 1}
    assert cpu_thread_hint(WorkerShape(1, True, 1, threads_from_node=True), {"a": 1}, {"a": 64.0}, {"a": 1.0}) is None
    with pytest.raises(ConfigError, match=r"^cluster.resources_per_worker.fast_disk=1 x 3 worker\(s\) needs 3 but "
                                          r"the Ray cluster has 2 fast_disk"):
        resolve_worker_shape(cfg, {"CPU": 3, "fast_disk": 2})


def test_an_elastic_run_goes_on_with_what_splits_its_global_batch_and_grows_back_when_the_rest_fits():
    assert minimum_workers(config_from_dict({}), 4) == 4  # not elastic: all of them
    assert minimum_workers(config_from_dict({"fault": {"elastic": True}}), 4) == 1
    assert minimum_workers(config_from_dict({"cluster": {"min_workers": 2}}), 4) == 2
    assert workers_after_loss(fit=3, full=4, minimum=1, global_batch=16) == 2  # 3 does not split 16
    assert workers_after_loss(fit=3, full=4, minimum=3, global_batch=16) is None
    assert workers_after_loss(fit=5, full=4, minimum=2, global_batch=12) == 4
    shape = WorkerShape(2, False, 1)
    assert grows_back(shape, 3, {"CPU": 1.0}) and not grows_back(shape, 3, {"CPU": 0.5})
    assert not grows_back(WorkerShape(3, False, 1), 3, {"CPU": 8.0})  # already whole
