"""`--resume auto`: a driver killed outright (SIGKILL) and started again with the same command goes
on from its run's newest checkpoint, as a resubmitted `ray job submit` does; with no checkpoint the
same command starts afresh. Real processes, real Ray, real files."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from conftest import tiny_config

pytestmark = pytest.mark.slow


def test_a_killed_driver_started_again_with_resume_auto_continues_its_run(ray_cluster, tiny_dataset, tmp_path,
                                                                          capsys):
    from elixir_ray import train
    from elixir_ray.checkpoint import list_checkpoints
    from elixir_ray.cli import main

    steps = 20  # time for the test to see the first checkpoint and kill the driver before its end
    base = dict(train={"steps": steps}, checkpoint={"every_steps": 2, "keep": 3}, cluster={"num_workers": 1})
    clean = train(tiny_config(tiny_dataset, tmp_path / "clean", **base), progress=False)

    cfg = tiny_config(tiny_dataset, tmp_path, **{**base, "cluster": {"num_workers": 1, "local_num_cpus": 2}})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    argv = ["train", str(path), "--resume", "auto", "--quiet"]
    checkpoints = tmp_path / "runs" / "t" / "checkpoints"
    # the driver in a process of its own (its own local Ray cluster, which dies with it), killed
    # outright once it has written a checkpoint: nothing of its teardown runs
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    driver = subprocess.Popen([sys.executable, "-m", "elixir_ray", *argv], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while not (checkpoints.exists() and list_checkpoints(str(checkpoints))) and time.monotonic() < deadline:
        assert driver.poll() is None, driver.stdout.read()
        time.sleep(0.05)
    driver.send_signal(signal.SIGKILL)
    out, _ = driver.communicate(timeout=60)
    assert "--resume auto: run 't' has no checkpoint in" in out and "starting afresh" in out, out
    killed_at = max(int(os.path.basename(p)[5:]) for p in list_checkpoints(str(checkpoints)))
    assert killed_at < steps, out

    # the same command again (here in this process, on the test's Ray cluster)
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "--resume auto: continuing run 't' from its checkpoint of step " in err, err
    from elixir_ray.run.outputs import read_metrics

    rows = read_metrics(str(tmp_path / "runs" / "t" / "metrics.parquet"))
    assert [row["step"] for row in rows] == list(range(1, steps + 1)), rows
    np.testing.assert_allclose(rows[-1]["loss"], clean.final_loss, rtol=0, atol=1e-5)
