"""The controller's states, driven through a real Ray cluster with a worker group class injected
that fails the first rendezvous: every transition is recorded, with its reason, in order."""

import pytest

from elixir_ray import ClusterError
from elixir_ray.run.preflight import check_data
from elixir_ray.run.resolved import as_config, resolve_run
from elixir_ray.cluster.controller import TrainController
from elixir_ray.cluster.failure import WorkerGroupFailure
from elixir_ray.cluster.placement import WorkerShape
from elixir_ray.cluster.worker_group import WorkerGroup

from conftest import tiny_config

pytestmark = pytest.mark.slow


def _first_rendezvous_fails() -> type:
    tries = []

    class FirstRendezvousFails(WorkerGroup):
        def rendezvous(self):
            tries.append(self.world_size)
            if len(tries) == 1:
                raise WorkerGroupFailure("initialising the process group", "injected")
            super().rendezvous()

    return FirstRendezvousFails


def _controller(tiny_dataset, tmp_path, **sections) -> TrainController:
    run = resolve_run(as_config({**tiny_config(tiny_dataset, tmp_path, **sections), "name": "states"}))
    check_data(run)
    cfg = run.config
    return TrainController(cfg, WorkerShape(num_workers=2, use_gpu=False, cpus_per_worker=1),
                           worker_group_cls=_first_rendezvous_fails())


def test_a_failed_rendezvous_restarts_and_every_transition_is_recorded(ray_cluster, tiny_dataset, tmp_path):
    controller = _controller(tiny_dataset, tmp_path, train={"steps": 2})
    outcome = controller.run()
    assert [t.state for t in outcome.transitions] == [
        "placing", "rendezvous", "restarting", "placing", "rendezvous", "profiling", "planning", "restoring",
        "training", "finished"]
    assert outcome.transitions[2].reason == "injected (while initialising the process group)"
    assert outcome.transitions[3].reason == "restart 1 on 2 worker(s)"
    assert [t.at for t in outcome.transitions] == sorted(t.at for t in outcome.transitions)
    (record,) = outcome.restarts
    assert (record.world_size, record.restored_from, record.restored_step) == (2, "scratch", 0)
    assert [m["step"] for m in outcome.metrics] == [1, 2] and outcome.checkpoint_step == 2
    assert controller.state.value == "finished" and controller.group is None  # the workers were killed


def test_a_failure_the_policy_does_not_restart_ends_in_errored(ray_cluster, tiny_dataset, tmp_path):
    controller = _controller(tiny_dataset, tmp_path, fault={"max_restarts": 0})
    with pytest.raises(ClusterError, match="giving up after 0 restart"):
        controller.run()
    assert [t.state for t in controller.outcome.transitions] == ["placing", "rendezvous", "errored"]
    assert "injected" in controller.outcome.transitions[-1].reason and controller.group is None
