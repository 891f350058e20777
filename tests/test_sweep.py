"""Sweeps with real Ray and real Ray Tune: ASHA stopping trials, plan reuse, a worker lost inside a
trial, and a sweep whose driver is SIGKILLed and resumed. Several acceptance checks per sweep run:
each run of a sweep is tens of seconds."""

import glob
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import warnings

import pytest
import pyarrow.parquet as pq

from elixir_ray.checkpoint import read_manifest
from elixir_ray.cli import main
from elixir_ray.cluster.chaos import WorkerKiller

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sweep_file(path, tiny_dataset, storage, *, name, lrs, scheduler, steps, every, workers, namespace,
                trials_per_gpu=1) -> str:
    base = {"name": "t", "model": {"size": "tiny", "n_layers": 2, "seq_len": 64}, "data": {"path": tiny_dataset},
            "train": {"steps": steps, "micro_batch": 4, "log_every": 1}, "optim": {"warmup_steps": 0},
            "cluster": {"num_workers": workers, "namespace": namespace},
            "checkpoint": {"every_steps": every, "keep": 2},
            "engine": {"time_kernels": False, "search_checkpointing": False}}  # as tiny_config (conftest.py: why)
    spec = {"name": name, "base": base, "space": {"optim.lr": {"grid": lrs}}, "scheduler": scheduler,
            "max_concurrent_trials": 2, "trials_per_gpu": trials_per_gpu, "storage": str(storage)}
    path.write_text(json.dumps(spec))  # JSON is YAML
    return str(path)


def _worker_actors(prefix: str = "") -> list[str]:
    """The names of the rank actors alive on the cluster whose run name starts with `prefix`."""
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if "/worker-" in a["name"] and a["name"].startswith(prefix)]


def _log(trial_dir: str) -> str:
    with open(os.path.join(trial_dir, "trial.log")) as f:
        return f.read()


def test_an_asha_sweep_stops_weak_trials_promptly_and_later_trials_reuse_the_first_plan(
        ray_cluster, tiny_dataset, tmp_path, capsys):
    storage = tmp_path / "sweeps"
    path = _sweep_file(tmp_path / "sweep.yaml", tiny_dataset, storage, name="lr", lrs=[3e-3, 1e-3, 1e-5, 1e-6],
                       scheduler={"type": "asha", "grace_period": 2, "reduction_factor": 2}, steps=16, every=4,
                       workers=1, namespace="sweep-asha")
    start = time.monotonic()
    assert main(["sweep", path, "--quiet"]) == 0
    seconds = time.monotonic() - start
    out = capsys.readouterr().out
    sweep_dir = str(storage / "lr")
    table = pq.read_table(os.path.join(sweep_dir, "trials.parquet")).to_pylist()
    print(out, f"\nsweep of 4 trials: {seconds:.1f}s")
    assert len(table) == 4 and "rank  trial" in out and "best: " in out
    assert not [r for r in table if r["status"] == "error" or r["error"]], table  # Tune recorded no failure
    # the weak learning rates are stopped early, their workers gone within 10 s of Tune's decision,
    # each with a checkpoint of the step it reached
    stopped = [r for r in table if r["status"] == "stopped"]
    assert stopped and all(r["steps"] < 16 for r in stopped), table
    assert [r["status"] for r in table if r["optim.lr"] == 3e-3] == ["finished"], table
    for r in stopped:
        assert r["stop_seconds"] is not None and r["stop_seconds"] < 10, r
        assert read_manifest(r["checkpoint_uri"])["step"] == r["steps"], r
    assert not _worker_actors(), "workers of the sweep's trials are still alive"
    # the best trial's metric is the lowest in the table
    finals = [r["final_loss"] for r in table]
    best = [line for line in out.splitlines() if line.startswith("best: ")][0]
    assert f"final loss {min(finals):.4g}" in best
    assert [r for r in table if r["final_loss"] == min(finals)][0]["optim.lr"] == 3e-3
    with open(os.path.join(sweep_dir, "trials.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # Tune's loggers (TensorBoard, CSV, JSON) write under the sweep's storage, beside each trial's run
    for r in table:
        trial_dir = os.path.join(sweep_dir, r["trial_id"])
        assert glob.glob(os.path.join(trial_dir, "events.out.tfevents*")), os.listdir(trial_dir)
        assert os.path.exists(os.path.join(trial_dir, "progress.csv"))
        assert os.path.exists(os.path.join(trial_dir, "result.json"))
        assert os.path.exists(os.path.join(trial_dir, "metrics.parquet"))
    # of trials of one shape, one measures; the others skip their profiling round and say where
    # their plan came from
    logs = {r["trial_id"]: _log(os.path.join(sweep_dir, r["trial_id"])) for r in table}
    measured = [t for t, text in logs.items() if ": profiling (" in text]
    reused = [t for t, text in logs.items() if "profiles and plan reused from" in text]
    assert len(measured) == 1 and len(reused) == 3, logs
    assert all("plan_cache/" in logs[t] and f"measured by the run '{measured[0]}'" in logs[t] for t in reused)
    assert all(": profiling (" not in logs[t] for t in reused)


def test_more_trials_per_gpu_than_fit_are_refused_before_any_trial_naming_the_most_that_fit(
        ray_cluster, tiny_dataset, tmp_path):
    """On a CPU-only cluster trials pack into CPU slots: each rank's budget is the host's free memory
    over trials_per_gpu, and a share too small for any plan of the model is refused up front."""
    from elixir_ray import ConfigError, sweep

    base = {"name": "t", "model": {"size": "tiny", "n_layers": 2, "seq_len": 64}, "data": {"path": tiny_dataset},
            "train": {"steps": 2, "micro_batch": 4}, "cluster": {"num_workers": 2}}
    with pytest.raises(ConfigError, match=r"^trials_per_gpu=10000: each rank would get .* of the CPU slot \(the "
                                          r"host's memory\)'s .* free, and the planner finds no plan of this model "
                                          r"within it: at most trials_per_gpu=(\d+) fits$") as err:
        sweep(base, {"optim.lr": [1e-3]}, trials_per_gpu=10000, storage=str(tmp_path / "sweeps"), progress=False)
    most = int(re.search(r"at most trials_per_gpu=(\d+)", str(err.value)).group(1))
    assert 1 <= most < 10000
    assert not (tmp_path / "sweeps" / "t-sweep").exists()  # no trial started, nothing written


def test_a_trial_that_fails_as_a_whole_is_reported_in_one_line(ray_cluster, tiny_dataset, tmp_path, capsys):
    """A vocabulary smaller than the data's passes the config check but not the run's own checks:
    the trial fails at once, its error one line in the table, and the sweep still writes it all."""
    storage = tmp_path / "sweeps"
    path = tmp_path / "sweep.yaml"
    path.write_text(json.dumps({
        "name": "fails", "storage": str(storage), "scheduler": "none",
        "base": {"name": "t", "model": {"size": "tiny", "n_layers": 2, "seq_len": 64}, "data": {"path": tiny_dataset},
                 "train": {"steps": 2, "micro_batch": 4}, "cluster": {"num_workers": 1}},
        "space": {"model.vocab_size": [100]}}))
    with warnings.catch_warnings():
        # a warning raised in our own code is an error here: a chart with no curve asks for no legend
        warnings.filterwarnings("error", module=r"elixir_ray\.")
        assert main(["sweep", str(path), "--quiet"]) == 1  # every trial failed
    out = capsys.readouterr().out
    assert (storage / "fails" / "trials.png").read_bytes().startswith(b"\x89PNG")
    row, = pq.read_table(str(storage / "fails" / "trials.parquet")).to_pylist()
    assert row["status"] == "error" and row["steps"] == 0, row
    assert row["error"] == ("ConfigError: model.vocab_size=100 is smaller than the dataset's vocabulary (257): use at "
                            "least 257"), row
    assert f"error: {row['trial_id']}: {row['error']}" in out and "best: none" in out


def _newest_step(trial_dir: str) -> int:
    from elixir_ray.checkpoint import list_checkpoints

    paths = list_checkpoints(os.path.join(trial_dir, "checkpoints")) if os.path.isdir(trial_dir) else []
    return read_manifest(paths[-1])["step"] if paths else 0


def _kill_worker_of(trial_suffix: str, namespace: str, at_step: int, deadline_s: float) -> WorkerKiller:
    """A WorkerKiller for rank 0 of the trial whose id ends with `trial_suffix`, once it exists."""
    import ray

    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].endswith(f"{trial_suffix}/worker-0")]
        if names:
            killer = WorkerKiller(names[0], at_step, namespace=namespace, timeout_s=deadline - time.monotonic())
            killer.start()
            return killer
        time.sleep(0.1)
    raise AssertionError(f"no worker of trial *{trial_suffix} appeared")


def test_a_sweep_resumed_after_its_driver_is_killed_finishes_and_a_worker_lost_in_a_trial_changes_nothing(
        ray_cluster, tiny_dataset, tmp_path, capsys):
    storage = tmp_path / "sweeps"
    namespace = "sweep-resume"
    steps = 24
    path = _sweep_file(tmp_path / "sweep.yaml", tiny_dataset, storage, name="resumed", lrs=[2e-3, 2e-3],
                       scheduler="none", steps=steps, every=4, workers=1, namespace=namespace,
                       trials_per_gpu=2)
    sweep_dir = str(storage / "resumed")
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address, "PYTHONPATH": REPO}
    driver = subprocess.Popen([sys.executable, "-m", "elixir_ray", "sweep", path, "--quiet"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output: list[str] = []
    threading.Thread(target=lambda: output.extend(driver.stdout), daemon=True).start()
    try:
        # the second trial (the same config as the first) loses its only worker after step 3
        killer = _kill_worker_of("_00001", namespace, 3, deadline_s=80)
        # the driver is SIGKILLed once the first trial has finished and the second (behind it by its
        # restart) has a checkpoint
        deadline = time.monotonic() + 120
        first = second = None
        while time.monotonic() < deadline and second is None:
            done = glob.glob(os.path.join(sweep_dir, "*_00000", "trial.json"))
            if done and json.load(open(done[0]))["status"] == "finished":
                first = os.path.dirname(done[0])
                second = _newest_step(glob.glob(os.path.join(sweep_dir, "*_00001"))[0]) or None
            time.sleep(0.05)
        driver.send_signal(signal.SIGKILL)
        assert second is not None and second < steps, ("".join(output), second)
        driver.wait(timeout=30)
    finally:
        if driver.poll() is None:
            driver.kill()
    killer.join(timeout=30)
    assert killer.killed_at is not None, "the trial's worker was never killed"
    started = sorted(os.path.basename(p) for p in glob.glob(os.path.join(sweep_dir, "*_0000[01]")))
    first_metrics = os.path.join(first, "metrics.parquet")
    before = os.path.getmtime(first_metrics)
    start = time.monotonic()
    assert main(["sweep", path, "--resume"]) == 0
    print(f"resumed sweep: {time.monotonic() - start:.1f}s")
    said = capsys.readouterr().err
    table = {r["trial_id"]: r for r in pq.read_table(os.path.join(sweep_dir, "trials.parquet")).to_pylist()}
    # exactly the configured trials, each finished, none failed, the finished one not run again
    ids = sorted(table)
    assert len(ids) == 2 and ids == started, (started, table)
    assert all(r["status"] == "finished" and r["steps"] == steps and not r["error"] for r in table.values()), table
    assert os.path.getmtime(first_metrics) == before
    assert _log(first).count("placing (the run starts)") == 1, _log(first)
    # the trial that lost a worker (and then its driver) ends where the undisturbed one did
    a, b = (table[i] for i in ids)
    assert b["final_loss"] == pytest.approx(a["final_loss"], abs=1e-6, rel=0), (a, b)
    log = _log(os.path.join(sweep_dir, ids[1]))
    assert "worker group failed" in log and "restarting (worker 0 died" in log, log
    # it goes on from its newest checkpoint (the one seen before the kill, or one written just after)
    assert "continues from its own newest checkpoint" in log, log
    # its restart inside the trial kept its plan, and the resumed run measured nothing again: the
    # sweep's plan cache has its shape's profiles, and its plan where the resumed sweep kept the
    # trials' budget (it does while that fits in the host memory free now; else it cuts another)
    before_resume, after_resume = log.split("continues from its own newest checkpoint", 1)
    assert "searched before from the same profiles, budget and batch is kept" in before_resume, log
    assert "profiling (" not in after_resume, log
    assert "each trial reserves a driver (1 CPU) and 1 rank(s) of" in said and "a device-memory budget of" in said, said
    kept = "(the one its trials started with, within 1/2 of" in said
    reused = "profiles and plan reused from" if kept else "profiles (not the plan: another budget) reused from"
    assert reused in after_resume, (said, log)
    resumed_at = [int(s) for s in re.findall(r"starting at step (\d+) \(from durable\)", log)]
    assert len(resumed_at) == 1 and second <= resumed_at[0] < steps, (second, log)
    logged = [r["step"] for r in pq.read_table(os.path.join(sweep_dir, ids[1], "metrics.parquet")).to_pylist()]
    assert logged == list(range(1, steps + 1)), logged
    assert not _worker_actors(), "workers of the sweep's trials are still alive"
