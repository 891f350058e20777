"""`elixir_ray.start()`: a run in the background, stopped with a checkpoint of the step it reached.
Real Ray, real gloo, two ranks (which must agree on the step they stop at)."""

import time

import pytest

from elixir_ray import start
from elixir_ray.checkpoint import read_manifest

from conftest import tiny_config

pytestmark = pytest.mark.slow


def test_a_started_run_stops_promptly_at_one_step_with_its_checkpoint(ray_cluster, tiny_dataset, tmp_path):
    import ray

    rows = []
    run = start(tiny_config(tiny_dataset, tmp_path, train={"steps": 5000}), on_metrics=rows.append)
    deadline = time.monotonic() + 120
    while len(rows) < 3 and time.monotonic() < deadline and not run.done():
        time.sleep(0.05)
    assert len(rows) >= 3 and not run.done(), rows
    asked = time.monotonic()
    result = run.stop(timeout=60)
    took = time.monotonic() - asked
    print(f"stopped at step {result.final_step} in {took:.2f}s")
    assert result is not None and result.stopped and run.done() and took < 10, (took, result)
    assert 3 <= result.final_step < 5000
    # both ranks ended at the same step, and that step is the run's last checkpoint
    assert result.checkpoint_step == result.final_step == read_manifest(result.checkpoint_uri)["step"]
    assert result.metrics.column("step").to_pylist() == list(range(1, result.final_step + 1))
    assert [r["step"] for r in rows] == list(range(1, result.final_step + 1))
    assert result.summary().startswith(f"run stopped on request at step {result.final_step}:")
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("t/worker-")]
    assert run.result() is result  # kept
