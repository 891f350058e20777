"""Lost workers, corrupt checkpoints and failing storage, with a real Ray cluster and real processes."""

import os
import random
import re
import warnings

import numpy as np
import pytest

from elixir_ray import ClusterError, ConfigError, train
from elixir_ray.checkpoint import list_checkpoints, load_checkpoint, load_newest_valid
from elixir_ray.cluster.chaos import WorkerKiller
from elixir_ray.cluster.worker import worker_actor_name

from conftest import tiny_config

pytestmark = pytest.mark.slow


def _final_model(result) -> dict:
    _, tensors = load_checkpoint(result.checkpoint_uri)
    return {k: v for k, v in tensors.items() if k.startswith("model/")}


def _assert_same_model(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=atol, rtol=0, err_msg=k)


def test_sigkill_of_worker_1_recovers_with_identical_result(ray_cluster, tiny_dataset, tmp_path, caplog):
    every = 3
    seed = int(os.environ.get("ELIXIR_RAY_TEST_SEED", random.randrange(1 << 30)))
    kill_step = random.Random(seed).randint(1, 10)
    print(f"killing worker-1 at step {kill_step} (ELIXIR_RAY_TEST_SEED={seed})")
    base = dict(train={"steps": 12}, checkpoint={"every_steps": every}, fault={"max_restarts": 2})
    clean = train(tiny_config(tiny_dataset, tmp_path / "clean", **base), progress=False)
    killer = WorkerKiller(worker_actor_name("t", 1), kill_step)
    killer.start()
    with caplog.at_level("INFO", logger="elixir_ray"):
        result = train(tiny_config(tiny_dataset, tmp_path / "killed", **base), progress=False)
    killer.join(timeout=5)
    assert killer.killed_at is not None, "the worker was never killed"
    assert len(result.restarts) == 1, result.restarts
    # the restart is onto the profiled node with as many workers: the plan is not searched again
    assert caplog.text.count("plan for 2 worker(s) searched in") == 1, caplog.text
    assert "the plan for 2 worker(s) searched before from the same profiles, budget and batch is kept" in caplog.text
    record = result.restarts[0]
    # the survivor's collective fails first ("connection reset by peer"): the reason names the dead one
    assert "rank 0" not in record.reason, record.reason
    # before the first checkpoint there is nothing to restore: the run starts over, as it should. The
    # killer fires once step `every` has completed, which can be before the driver has collected that
    # step's snapshot, so a kill at step `every` itself may also start over.
    assert record.restored_from in ("object_store", "durable") or (record.restored_step == 0 and
                                                                    killer.killed_step <= every)
    assert killer.killed_step - record.restored_step <= every, (killer.killed_step, record)
    assert result.metrics.column("step").to_pylist() == list(range(1, 13))
    _assert_same_model(_final_model(result), _final_model(clean), atol=1e-6)
    np.testing.assert_allclose(result.metrics.column("loss").to_pylist(),
                               clean.metrics.column("loss").to_pylist(), rtol=0, atol=1e-6)
    print(f"recovery: {record.resumed_at - killer.killed_at:.2f}s from kill to the first step after restore")


@pytest.mark.extended
def test_no_restarts_left_fails_with_the_reason(ray_cluster, tiny_dataset, tmp_path):
    killer = WorkerKiller(worker_actor_name("t", 1), 2)
    killer.start()
    cfg = tiny_config(tiny_dataset, tmp_path, train={"steps": 200}, fault={"max_restarts": 0})
    with pytest.raises(ClusterError, match=r"(?s)worker 1 died.*giving up after 0 restart"):
        train(cfg, progress=False)
    assert killer.killed_at is not None, "the worker was never killed"


def test_a_cluster_busy_at_the_start_is_not_a_worker_failure(ray_cluster, tiny_dataset, tmp_path):
    """Another run (here a placement group) holds the CPUs: the first placement timing out is said
    as such, without a restart or "after a worker failure" (no worker had failed)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    hold = placement_group([{"CPU": 3}])
    ray_cluster.get(hold.ready(), timeout=30)
    try:
        cfg = tiny_config(tiny_dataset, tmp_path, cluster={"placement_timeout_s": 2}, fault={"max_restarts": 3})
        with pytest.raises(ClusterError, match=r"could not reserve 2 x .* free now: 1 CPU\): other runs or tasks "
                                               r"hold them; free them, or raise cluster.placement_timeout_s") as err:
            train(cfg, progress=False)
        assert "restart" not in str(err.value) and "worker failure" not in str(err.value)
    finally:
        remove_placement_group(hold)


@pytest.mark.extended
def test_a_failed_run_keeps_its_metrics_and_says_where_to_resume(ray_cluster, tiny_dataset, tmp_path):
    """A run that gives up writes the metrics of the steps it trained and names its newest
    checkpoint; resumed in the same run directory, its metrics start at step 1 again."""
    from elixir_ray.run.outputs import read_metrics

    killer = WorkerKiller(worker_actor_name("t", 1), 7)
    killer.start()
    cfg = tiny_config(tiny_dataset, tmp_path, train={"steps": 200}, checkpoint={"every_steps": 3, "keep": 2},
                      fault={"max_restarts": 0})
    with pytest.raises(ClusterError, match=r"giving up after 0 restart.*\nthe newest checkpoint is step (\d+): "
                                           r"continue with --resume (\S+)") as err:
        train(cfg, progress=False)
    killer.join(timeout=5)
    step, uri = re.search(r"step (\d+): continue with --resume (\S+)", str(err.value)).groups()
    assert int(step) >= 3 and os.path.basename(uri) == f"step-{int(step):08d}"
    kept = [row["step"] for row in read_metrics(os.path.join(str(tmp_path / "runs"), "t", "metrics.parquet"))]
    assert kept[:int(step)] == list(range(1, int(step) + 1)), kept  # every step trained, from the first
    resumed = train({**cfg, "train": {**cfg["train"], "steps": int(step) + 2}, "fault": {"max_restarts": 1}},
                    progress=False, resume=uri)
    assert resumed.metrics.column("step").to_pylist() == list(range(1, int(step) + 3))
    assert resumed.start_step == int(step) and "2 steps in" in resumed.summary()
    assert f"resumed from step {step}" in resumed.summary()
    assert "step time: median" in resumed.summary() and "over 1 step(s) after the first" in resumed.summary()


def _cli_run_stopped(tiny_dataset, tmp_path, every_steps: int, ready, signal_number) -> tuple[int, str]:
    """`elixir-ray train` of an endless tiny run in a process of its own, sent `signal_number` once
    `ready()` holds: its exit status and output."""
    import subprocess
    import sys
    import time

    import yaml

    cfg = tiny_config(tiny_dataset, tmp_path, train={"steps": 100000}, checkpoint={"every_steps": every_steps},
                      cluster={"num_workers": 1, "local_num_cpus": 2})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([sys.executable, "-m", "elixir_ray", "train", str(path), "--quiet"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while not ready() and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.5)
    proc.send_signal(signal_number)
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out


@pytest.mark.extended
def test_a_run_stopped_by_sigterm_keeps_its_metrics(tiny_dataset, tmp_path):
    """`ray job stop` sends SIGTERM: the run ends as on Ctrl-C, with the metrics so far written."""
    import signal

    from elixir_ray.run.outputs import read_metrics

    checkpoints = tmp_path / "runs" / "t" / "checkpoints"
    code, out = _cli_run_stopped(tiny_dataset, tmp_path, 3,
                                 lambda: checkpoints.exists() and bool(list_checkpoints(str(checkpoints))),
                                 signal.SIGTERM)
    assert code != 0, out
    steps = [row["step"] for row in read_metrics(str(tmp_path / "runs" / "t" / "metrics.parquet"))]
    assert len(steps) >= 3 and steps == list(range(1, len(steps) + 1)), (steps, out)
    assert "run stopped (SystemExit)\nthe newest checkpoint is step" in out and "continue with --resume" in out, out


@pytest.mark.extended
def test_ctrl_c_before_the_first_checkpoint_says_so_without_a_traceback(tiny_dataset, tmp_path):
    """Ctrl-C (SIGINT) ends `elixir-ray train` with exit status 130 and what the run kept (its
    metrics; no checkpoint yet, so nothing to resume from), not Python's traceback."""
    import signal

    metrics = tmp_path / "runs" / "t" / "metrics.parquet"
    code, out = _cli_run_stopped(tiny_dataset, tmp_path, 100000, metrics.exists,  # written 10 s into training
                                 signal.SIGINT)
    assert code == 130, out
    assert ("run stopped (KeyboardInterrupt)\nno checkpoint was written yet: there is nothing to resume from\n"
            f"metrics so far: {metrics}") in out, out
    assert "Traceback" not in out and out.rstrip().endswith("elixir-ray: stopped"), out


def test_a_stopped_run_names_the_checkpoint_to_resume_from_its_own_else_the_one_it_started_from(tiny_dataset,
                                                                                              tmp_path):
    """Read from the persister (a second Ctrl-C can cut short the teardown after which the outcome
    is filled in); a resumed run stopped before a checkpoint of its own names the one it resumed from."""
    from elixir_ray.run.outputs import where_to_resume
    from elixir_ray.run.resolved import as_config
    from elixir_ray.cluster.controller import RestoreSource, TrainController
    from elixir_ray.cluster.placement import WorkerShape
    from elixir_ray.cluster.snapshots import CheckpointPersister

    cfg = as_config(tiny_config(tiny_dataset, tmp_path))
    controller = TrainController(cfg, WorkerShape(num_workers=1, use_gpu=False, cpus_per_worker=1))
    assert where_to_resume(controller, "m.parquet") == ""  # nothing trained: nothing to say
    controller.outcome.metrics = [{"step": 1}]
    assert where_to_resume(controller, "m.parquet").startswith("\nno checkpoint was written yet")
    controller.resume = RestoreSource("runs/old/checkpoints/step-00000040")
    assert where_to_resume(controller, "m.parquet").startswith(
        "\nno checkpoint written since the start: continue with --resume runs/old/checkpoints/step-00000040\n")
    controller.persister = CheckpointPersister(cfg.checkpoint_uri, 3)
    controller.persister.committed = [(44, "runs/t/checkpoints/step-00000044")]
    assert where_to_resume(controller, "m.parquet").startswith(
        "\nthe newest checkpoint is step 44: continue with --resume runs/t/checkpoints/step-00000044\n")
    controller.persister.close()


def test_resume_continues_a_stopped_run_exactly(ray_cluster, tiny_dataset, tmp_path):
    base = dict(train={"steps": 8}, checkpoint={"every_steps": 4, "keep": 3})
    full = train(tiny_config(tiny_dataset, tmp_path / "full", **base), progress=False)
    ckpts = list_checkpoints(os.path.join(str(tmp_path / "full"), "runs", "t", "checkpoints"))
    assert [p[-8:] for p in ckpts] == ["00000004", "00000008"]
    resumed = train(tiny_config(tiny_dataset, tmp_path / "resumed", **base), progress=False, resume=ckpts[0])
    assert resumed.metrics.column("step").to_pylist() == [5, 6, 7, 8]
    _assert_same_model(_final_model(resumed), _final_model(full), atol=1e-6)


@pytest.mark.extended
def test_corrupt_newest_checkpoint_falls_back_with_a_warning(ray_cluster, tiny_dataset, tmp_path):
    cfg = tiny_config(tiny_dataset, tmp_path, train={"steps": 6}, checkpoint={"every_steps": 2, "keep": 3})
    result = train(cfg, progress=False)
    root = os.path.dirname(result.checkpoint_uri)
    # the restore would take the newest valid checkpoint (step 6): past train.steps=5, refused up front
    with pytest.raises(ConfigError, match=r"is at step 6, and train.steps=5: nothing is left to train"):
        train({**cfg, "name": "short", "train": {**cfg["train"], "steps": 5}}, progress=False, resume=root)
    newest = os.path.join(root, "step-00000006", "part-00000.safetensors")
    data = bytearray(open(newest, "rb").read())
    data[len(data) // 2] ^= 0x01  # one flipped bit
    open(newest, "wb").write(bytes(data))
    with pytest.warns(UserWarning, match="does not match its checksum"):
        path, manifest, _ = load_newest_valid(root)
    assert manifest["step"] == 4
    # a truncated file is caught the same way
    middle = os.path.join(root, "step-00000004", "part-00000.safetensors")
    with open(middle, "r+b") as f:
        f.truncate(100)
    with pytest.warns(UserWarning):
        path, manifest, _ = load_newest_valid(root)
    assert manifest["step"] == 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = train({**cfg, "name": "resumed"}, progress=False, resume=root)
    assert any("checksum" in str(w.message) for w in caught)
    assert resumed.metrics.column("step").to_pylist() == [3, 4, 5, 6]


@pytest.mark.extended
def test_checkpoint_of_another_model_is_refused(ray_cluster, tiny_dataset, tmp_path):
    cfg = tiny_config(tiny_dataset, tmp_path, train={"steps": 2})
    result = train(cfg, progress=False)
    other = {**cfg, "model": {**cfg["model"], "d_model": 64}}
    with pytest.raises(ConfigError, match=r"'model/wte.weight' has shape \(257, 128\) in the checkpoint but \(257, 64\)"):
        train(other, progress=False, resume=result.checkpoint_uri)
    # a checkpoint at or past train.steps leaves nothing to train: refused, not a run of 0 steps
    with pytest.raises(ConfigError, match=r"is at step 2, and train.steps=2: nothing is left to train"):
        train(cfg, progress=False, resume=result.checkpoint_uri)


@pytest.mark.parametrize("via", ["object_store", "storage"])
@pytest.mark.extended
def test_unwritable_checkpoint_uri_does_not_stop_training(ray_cluster, tiny_dataset, tmp_path, monkeypatch, capsys,
                                                          via):
    """A checkpoint.uri under a file is refused before the run; storage that fails during the run
    (the same path, past the up-front check, as a disk that fills later) is reported and training
    goes on, whether the persister or the workers write, and the summary says the final state was
    not saved. The progress output says when the workers write (training waits then)."""
    import elixir_ray.run.train as run_train

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the checkpoint directory should be")
    cfg = tiny_config(tiny_dataset, tmp_path, train={"steps": 4},
                      checkpoint={"every_steps": 2, "uri": str(blocker / "ck"), "via": via})
    with pytest.raises(ConfigError, match=r"is a file, not a directory: point checkpoint.uri at a directory"):
        train(cfg, progress=False)
    monkeypatch.setattr(run_train, "check_checkpoint_space", lambda run: None)
    result = train(cfg, progress=True)
    assert result.metrics.column("step").to_pylist() == [1, 2, 3, 4] and not result.restarts
    assert result.checkpoint_uri is None and not result.final_checkpoint_written
    assert result.persist_errors and "could not persist the checkpoint of step 2" in result.persist_errors[0]
    assert "warning: could not persist" in result.summary()
    err = capsys.readouterr().err
    assert ("step 2: the workers are writing the checkpoint" in err) == (via == "storage")
    assert "checkpoint written" not in err


@pytest.mark.extended
def test_export_gives_a_state_dict_the_module_accepts(ray_cluster, tiny_dataset, tmp_path):
    import torch
    from safetensors.torch import load_file

    from elixir_ray.run.resolved import as_config
    from elixir_ray.cli import main
    from elixir_ray.model.factory import build_model

    cfg = tiny_config(tiny_dataset, tmp_path, train={"steps": 2})
    result = train(cfg, progress=False)
    out = tmp_path / "export" / "model.safetensors"
    assert main(["export", os.path.dirname(result.checkpoint_uri), "--to", "safetensors", str(out)]) == 0
    module = build_model(as_config(cfg))
    state = load_file(str(out))
    module.load_state_dict(state)  # strict: same keys and shapes
    _, tensors = load_checkpoint(result.checkpoint_uri)
    assert torch.equal(module.blocks[0].mlp.up.weight, torch.from_numpy(tensors["model/blocks.0.mlp.up.weight"].copy()))
    assert main(["export", str(tmp_path / "nothing-here"), str(tmp_path / "x.safetensors")]) == 2
    # the trained model writes text from the same directory (the config and tokenizer its checkpoint keeps)
    assert main(["sample", os.path.dirname(result.checkpoint_uri), "--prompt", "def ", "--tokens", "4",
                 "--device", "cpu"]) == 0


@pytest.mark.extended
def test_a_restart_never_restores_an_earlier_runs_checkpoint(ray_cluster, tiny_dataset, tmp_path):
    """A run of the same name left checkpoints in the directory; this one fails before its first."""
    base = dict(train={"steps": 6}, checkpoint={"every_steps": 5}, fault={"max_restarts": 2})
    first = train(tiny_config(tiny_dataset, tmp_path, **base), progress=False)
    killer = WorkerKiller(worker_actor_name("t", 1), 1)
    killer.start()
    with pytest.warns(UserWarning, match="of an earlier run"):  # the earlier run's checkpoints: said, then left alone
        second = train(tiny_config(tiny_dataset, tmp_path, **base), progress=False)
    killer.join(timeout=5)
    assert killer.killed_at is not None, "the worker was never killed"
    (record,) = second.restarts
    assert record.restored_step <= killer.killed_step, record  # not the earlier run's step 6
    assert second.metrics.column("step").to_pylist() == list(range(1, 7))
    np.testing.assert_allclose(second.metrics.column("loss").to_pylist(),
                               first.metrics.column("loss").to_pylist(), rtol=0, atol=1e-6)


@pytest.mark.extended
def test_a_lost_final_checkpoint_is_not_reported_as_the_result(ray_cluster, tiny_dataset, tmp_path, monkeypatch,
                                                                capsys):
    """Step 2's checkpoint is written and step 4's (the last) fails: the summary names step 2 as NOT
    the final step, and `elixir-ray train` exits 1 so that a job does not read as a success."""
    import yaml

    import elixir_ray.cluster.snapshots as snapshots
    from elixir_ray.cli import main

    real = snapshots.save_checkpoint

    def full_disk_at_step_4(uri, step, *args, **kwargs):
        if step == 4:
            raise OSError(28, "No space left on device")
        return real(uri, step, *args, **kwargs)

    monkeypatch.setattr(snapshots, "save_checkpoint", full_disk_at_step_4)
    cfg = tiny_config(tiny_dataset, tmp_path, train={"steps": 4}, checkpoint={"every_steps": 2, "via": "object_store"})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["train", str(path), "--quiet"]) == 1
    out, err = capsys.readouterr()
    assert "step-00000002 is step 2, NOT the final step 4: its checkpoint could not be written" in out
    assert "error: training reached step 4, but its checkpoint was not written" in err


@pytest.mark.extended
def test_the_metrics_on_disk_reach_every_checkpoint_step(ray_cluster, tiny_dataset, tmp_path, monkeypatch):
    """A driver killed outright writes nothing more: its metrics file must already hold every step up
    to the checkpoint a resume takes (they were written every 10 s only, and the resume's metrics had
    a gap). Here the timed writes never come and the end's write fails, as after a SIGKILL."""
    import elixir_ray.run.train as run_train
    from elixir_ray.run.outputs import read_metrics

    def killed(*args, **kwargs):
        raise SystemExit("the driver is gone")

    monkeypatch.setattr(run_train, "METRICS_SAVE_EVERY_S", 1e9)
    monkeypatch.setattr(run_train, "write_outputs", killed)
    cfg = tiny_config(tiny_dataset, tmp_path, train={"steps": 7}, checkpoint={"every_steps": 3},
                      cluster={"num_workers": 1})
    with pytest.raises(SystemExit):
        train(cfg, progress=False)
    steps = [row["step"] for row in read_metrics(str(tmp_path / "runs" / "t" / "metrics.parquet"))]
    assert steps[:6] == [1, 2, 3, 4, 5, 6], steps


@pytest.mark.extended
def test_a_resume_from_a_checkpoint_uri_outside_the_run_directory_keeps_the_earlier_metrics(
        ray_cluster, tiny_dataset, tmp_path):
    """The README's s3:// setup puts checkpoints outside the run directory: a resume of the same run
    there overwrote its metrics with the resumed steps only."""
    cfg = tiny_config(tiny_dataset, tmp_path, train={"steps": 4}, checkpoint={"every_steps": 2,
                                                                              "uri": str(tmp_path / "ck")},
                      cluster={"num_workers": 1})
    first = train(cfg, progress=False)
    assert first.checkpoint_uri.startswith(str(tmp_path / "ck"))
    resumed = train({**cfg, "train": {**cfg["train"], "steps": 6}}, progress=False, resume=str(tmp_path / "ck"))
    assert resumed.metrics.column("step").to_pylist() == [1, 2, 3, 4, 5, 6]
    # another run's checkpoint (a fork under a new name, sharing checkpoint.uri) is not this run's
    # history, whatever this run's directory holds: its metrics start at the resumed step
    from elixir_ray.run.outputs import metrics_table, write_metrics

    write_metrics(metrics_table([{"step": s, "loss": 9.0} for s in range(1, 6)]),
                  str(tmp_path / "runs" / "fork" / "metrics.parquet"))
    fork = train({**cfg, "name": "fork", "train": {**cfg["train"], "steps": 6}}, progress=False,
                 resume=first.checkpoint_uri)
    assert fork.metrics.column("step").to_pylist() == [5, 6]


def test_an_output_dir_that_cannot_be_written_is_refused_before_the_run(tiny_dataset, tmp_path):
    """With checkpoint.uri elsewhere nothing checked output_dir: the run trained every step and then
    failed writing its metrics, without saying where its checkpoints were."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cfg = tiny_config(tiny_dataset, tmp_path, checkpoint={"uri": str(tmp_path / "ck")})
    cfg["output_dir"] = str(blocker / "runs")
    with pytest.raises(ConfigError, match=r"output_dir .*a-file is a file, not a directory: point output_dir at a "
                                          r"directory"):
        train(cfg, progress=False)


@pytest.mark.extended
def test_a_resume_with_dropout_onto_another_worker_count_warns_that_it_is_not_exact(
        ray_cluster, tiny_dataset, tmp_path, caplog):
    """Each rank's dropout masks come from its own saved random stream: the README said a resume with
    the same global batch continues exactly, which holds only on the same number of workers."""
    cfg = tiny_config(tiny_dataset, tmp_path, model={"dropout": 0.1}, train={"steps": 2, "micro_batch": 4},
                      cluster={"num_workers": 1})
    first = train(cfg, progress=False)
    more = {**cfg, "name": "two", "train": {**cfg["train"], "steps": 3, "micro_batch": 2},
            "cluster": {"num_workers": 2}}
    with caplog.at_level("WARNING", logger="elixir_ray"):
        train(more, progress=False, resume=first.checkpoint_uri)
    assert "model.dropout=0.1 and the run goes on on 2 worker(s) instead of 1" in caplog.text
    assert "the checkpoint.s run had a global batch" not in caplog.text  # 2 x 2 = 1 x 4: only the streams differ


def test_a_restarted_failure_is_kept_without_the_frames_it_came_through(ray_cluster, tiny_dataset, tmp_path):
    """The controller keeps each restarted failure for the policy's comparisons; with its traceback
    it kept the failed phase's frames, and the object refs in their locals (a snapshot's shards, a
    restore's whole state), pinned in the object store for the rest of the run."""
    import ray

    from elixir_ray.run.resolved import as_config
    from elixir_ray.cluster.controller import TrainController
    from elixir_ray.cluster.failure import FailureKind, WorkerGroupFailure
    from elixir_ray.cluster.placement import WorkerShape

    controller = TrainController(as_config(tiny_config(tiny_dataset, tmp_path, fault={"max_restarts": 2})),
                                 WorkerShape(num_workers=1, use_gpu=False, cpus_per_worker=1))

    def snapshot():
        pairs = [ray.put(b"x" * 2**16)]  # noqa: F841 (a snapshot's shard refs, in the frame that fails)
        try:
            raise RuntimeError("boom")
        except RuntimeError as exc:
            failure = WorkerGroupFailure("taking a snapshot", "rank 0 raised", FailureKind.RAISED,
                                         error="RuntimeError: boom")
            failure.step = 3
            raise failure from exc

    try:
        snapshot()
    except WorkerGroupFailure as failure:
        controller._recover_or_raise(failure)
    (kept,) = controller.failures
    assert (kept.__traceback__, kept.__cause__, kept.__context__) == (None, None, None)
    assert kept.phase == "taking a snapshot" and kept.error == "RuntimeError: boom" and kept.step == 3
    assert len(controller.outcome.restarts) == 1
