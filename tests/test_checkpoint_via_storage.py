"""checkpoint.via=storage: the workers write their shards straight to durable storage (a state too
large for the object store), on a real Ray cluster with real worker processes."""

import os
import warnings

import numpy as np
import pytest

from elixir_ray import train
from elixir_ray.checkpoint import list_checkpoints, load_checkpoint, read_manifest
from elixir_ray.checkpoint.shards import SHARDS_FORMAT
from elixir_ray.cluster import controller
from elixir_ray.cluster.chaos import WorkerKiller
from elixir_ray.cluster.worker import worker_actor_name

from conftest import tiny_config

pytestmark = pytest.mark.slow


def _model(uri: str) -> dict:
    _, tensors = load_checkpoint(uri)
    return {k: np.array(v) for k, v in tensors.items() if k.startswith("model/")}


def test_a_killed_worker_restores_from_the_shards_the_workers_wrote(ray_cluster, tiny_dataset, tmp_path):
    """Sharded chunks over two workers, each writing its own shard files at every checkpoint: worker 1
    killed after step 5 restarts from the step-4 checkpoint on storage (no object-store snapshot
    exists), and the run ends with the losses and weights of an uninterrupted object-store run."""
    base = dict(train={"steps": 8}, checkpoint={"every_steps": 2, "keep": 2}, fault={"max_restarts": 2},
                engine={"replicate": "none"})
    clean = train(tiny_config(tiny_dataset, tmp_path / "clean", **base), progress=False)
    assert clean.checkpoint_via == "object_store"  # auto: the tiny state is nothing to the object store
    killer = WorkerKiller(worker_actor_name("t", 1), 5)
    killer.start()
    cfg = tiny_config(tiny_dataset, tmp_path / "killed", **base)
    cfg["checkpoint"]["via"] = "storage"
    result = train(cfg, progress=False)
    killer.join(timeout=5)
    assert killer.killed_at is not None, "the worker was never killed"
    assert result.checkpoint_via == "storage" and not result.persist_errors, result.persist_errors
    (record,) = result.restarts
    assert record.restored_from == "durable" and killer.killed_step - record.restored_step <= 2, record
    assert result.metrics.column("step").to_pylist() == list(range(1, 9))
    np.testing.assert_allclose(result.metrics.column("loss").to_pylist(),
                               clean.metrics.column("loss").to_pylist(), rtol=0, atol=1e-6)
    manifest = read_manifest(result.checkpoint_uri)
    assert manifest["format"] == SHARDS_FORMAT and manifest["shards"]["world"] == 2
    assert {info["rank"] for info in manifest["files"].values()} == {0, 1}
    assert any(c["sharded"] for c in manifest["shards"]["layout"]["chunks"])
    root = os.path.dirname(result.checkpoint_uri)
    assert [p[-8:] for p in list_checkpoints(root)] == ["00000006", "00000008"]  # keep=2
    assert not [n for n in os.listdir(root) if n.startswith(".tmp-step-")]
    mine, theirs = _model(result.checkpoint_uri), _model(clean.checkpoint_uri)
    assert mine.keys() == theirs.keys()
    for k in mine:
        np.testing.assert_allclose(mine[k], theirs[k], atol=1e-6, rtol=0, err_msg=k)


def test_auto_picks_storage_for_a_state_large_against_the_object_store_and_resume_reads_it(
        ray_cluster, tiny_dataset, tmp_path, monkeypatch):
    """`auto` has the workers write when the state is over the object-store share (made tiny here);
    `--resume` of that checkpoint onto one worker (the workers read it themselves) continues as the
    two-worker run did, and its weights export."""
    from elixir_ray.cli import main

    monkeypatch.setattr(controller, "OBJECT_STORE_SHARE", 1e-9)
    base = dict(train={"steps": 6, "micro_batch": 4}, checkpoint={"every_steps": 3, "keep": 3})
    full = train(tiny_config(tiny_dataset, tmp_path / "full", **base), progress=False)
    assert full.checkpoint_via == "storage"
    first = list_checkpoints(os.path.dirname(full.checkpoint_uri))[0]
    one = tiny_config(tiny_dataset, tmp_path / "one", **base)
    one["cluster"] = {"num_workers": 1}
    one["train"]["micro_batch"] = 8  # the same global batch on one worker
    resumed = train(one, progress=False, resume=first)
    assert resumed.metrics.column("step").to_pylist() == [4, 5, 6]
    np.testing.assert_allclose(resumed.metrics.column("loss").to_pylist(),
                               full.metrics.column("loss").to_pylist()[3:], rtol=0, atol=1e-5)
    out = tmp_path / "model.safetensors"
    assert main(["export", full.checkpoint_uri, str(out)]) == 0
    from safetensors.numpy import load_file

    exported = load_file(str(out))
    for k, v in _model(full.checkpoint_uri).items():
        np.testing.assert_array_equal(exported[k[len("model/"):]], v)


def test_a_storage_error_while_the_workers_write_is_reported_and_training_goes_on(ray_cluster, tiny_dataset,
                                                                                 tmp_path, capsys):
    """The progress output says when the workers write (training waits then); a write that fails is
    reported and training goes on."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the checkpoint directory should be")
    cfg = tiny_config(tiny_dataset, tmp_path, train={"steps": 4},
                      checkpoint={"every_steps": 2, "uri": str(blocker / "ck"), "via": "storage"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = train(cfg, progress=True)
    assert result.metrics.column("step").to_pylist() == [1, 2, 3, 4]
    assert result.checkpoint_uri is None and not result.restarts
    assert result.persist_errors and "could not persist the checkpoint of step 2" in result.persist_errors[0]
    err = capsys.readouterr().err
    assert "step 2: the workers are writing the checkpoint" in err and "checkpoint written" not in err
