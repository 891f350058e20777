"""What a failing run says: a non-finite loss ends it at that step, a stopped or dead worker is
named (not the healthy peer whose collective timed out after it), and the console carries one line
per failure, never a survivor's traceback. Real Ray, real gloo, real signals."""

import os
import re

import pytest
import yaml

from conftest import tiny_config

pytestmark = pytest.mark.slow


def test_a_non_finite_loss_stops_the_run_at_that_step_naming_the_last_good_checkpoint(
        ray_cluster, tiny_dataset, tmp_path, capsys):
    """optim.lr=1e6 trains to a NaN loss in a few steps: the run ends there with exit 2 (not a
    restart, which would replay the same steps), naming the step and the newest checkpoint whose
    weights still gave a finite loss, and the metrics of the steps before it are kept."""
    from elixir_ray.checkpoint import read_manifest
    from elixir_ray.cli import main
    from elixir_ray.run.outputs import read_metrics

    cfg = tiny_config(tiny_dataset, tmp_path, optim={"lr": 1e6}, train={"steps": 12},
                      checkpoint={"every_steps": 1, "keep": 3}, fault={"max_restarts": 2})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if line.startswith("elixir-ray: error:"))
    found = re.search(r"step (\d+): the loss is (nan|inf|-inf), not finite: the run stops there "
                      r"\(train.stop_on_nonfinite\); the last good checkpoint is step (\d+): fix the cause "
                      r"\(optim.lr too high\?\) and continue with --resume (\S+)$", line)
    assert found, err
    step, good, uri = int(found.group(1)), int(found.group(3)), found.group(4)
    assert 1 <= good < step - 1 and read_manifest(uri)["step"] == good
    assert "restart" not in err
    steps = [row["step"] for row in read_metrics(str(tmp_path / "runs" / "t" / "metrics.parquet"))]
    assert steps == list(range(1, step)), steps

