"""The worker group on its own: ranks placed into bundles of a placement group the caller reserved
(a Ray Tune trial's), joined in a gloo group, called, and killed, on a real Ray cluster."""

import pytest
import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from elixir_ray import ClusterError
from elixir_ray.run.resolved import as_config
from elixir_ray.cluster.placement import WorkerShape
from elixir_ray.cluster.worker_group import GivenPlacement, WorkerGroup

from conftest import tiny_config

pytestmark = pytest.mark.slow


@ray.remote(num_cpus=1)
def _in_bundle() -> bool:
    return True


def _bundle_is_free(pg, index: int, timeout_s: float) -> bool:
    """Whether a task needing the bundle's CPU runs in it within `timeout_s`."""
    ref = _in_bundle.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=index)).remote()
    ready, _ = ray.wait([ref], timeout=timeout_s)
    if not ready:
        ray.cancel(ref, force=True)
    return bool(ready)


def test_a_group_in_given_bundles_forms_answers_and_leaves_the_reservation(ray_cluster, tiny_dataset, tmp_path):
    cfg = as_config({**tiny_config(tiny_dataset, tmp_path), "name": "given"})
    shape = WorkerShape(num_workers=2, use_gpu=False, cpus_per_worker=1)
    pg = placement_group([{"CPU": 1}] * 3, strategy="PACK")
    ray.get(pg.ready(), timeout=60)
    try:
        with pytest.raises(ClusterError, match="holds 1 bundle"):
            WorkerGroup(cfg, shape, placement=GivenPlacement(pg, (0,))).place(first_try=True)
        group = WorkerGroup(cfg, shape, placement=GivenPlacement(pg, (2, 0)))
        try:
            group.place(first_try=True)
            group.rendezvous()
            assert group.world_size == 2 and group.on_driver_node
            assert list(group.workers_per_node.values()) == [2]
            assert group.get(group.call("current_step"), "asking for the step") == [0, 0]
            assert group.get([group.call_rank(1, "alive")], "pinging rank 1") == [True]
            # the ranks took the bundles given (2 and 0): bundle 1 is free, bundle 2 is not
            assert _bundle_is_free(pg, 1, timeout_s=30)
            assert not _bundle_is_free(pg, 2, timeout_s=2)
        finally:
            group.kill()
        assert group.world_size == 0
        # the reservation is the caller's: it stays, and a new group of the run's name takes it again
        assert placement_group_table(pg)["state"] == "CREATED"
        again = WorkerGroup(cfg, shape, placement=GivenPlacement(pg, (0, 1)))
        try:
            again.place(first_try=False)
            assert again.get(again.call("alive"), "pinging") == [True, True]
        finally:
            again.kill()
    finally:
        remove_placement_group(pg)

