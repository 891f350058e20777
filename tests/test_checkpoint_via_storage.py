"""checkpoint.via=storage: the workers write their shards straight to durable storage (a state too
large for the object store), on a real Ray cluster with real worker processes."""

import errno
import os
import time

import numpy as np
import pytest

from elixir_ray import train
from elixir_ray.checkpoint import list_checkpoints, load_checkpoint, read_manifest
from elixir_ray.checkpoint.shards import SHARDS_FORMAT
from elixir_ray.cluster import controller
from elixir_ray.cluster.chaos import WorkerKiller
from elixir_ray.cluster.worker import RankWorker, worker_actor_name

from conftest import group_of, tiny_config

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


@pytest.mark.extended
def test_auto_picks_storage_for_a_state_large_against_the_object_store_and_resume_reads_it(
        ray_cluster, tiny_dataset, tmp_path, monkeypatch, caplog):
    """`auto` has the workers write when the state is over the object-store share (made tiny here);
    with every chunk replicated only rank 0 writes the chunks; `--resume` of that checkpoint onto one
    worker (the workers read it themselves) continues as the two-worker run did, and its weights export."""
    from safetensors.numpy import load_file

    from elixir_ray.cli import main

    monkeypatch.setattr(controller, "OBJECT_STORE_SHARE", 1e-9)
    base = dict(train={"steps": 6, "micro_batch": 4}, checkpoint={"every_steps": 3, "keep": 3},
                engine={"replicate": "all"})
    full = train(tiny_config(tiny_dataset, tmp_path / "full", **base), progress=False)
    assert full.checkpoint_via == "storage"
    first = list_checkpoints(os.path.dirname(full.checkpoint_uri))[0]
    rank1 = [name for name, info in read_manifest(first)["files"].items() if info["rank"] == 1]
    assert rank1 and all(set(load_file(os.path.join(first, n))) <= {"slots/step", "rng/torch_cpu"} for n in rank1)
    one = tiny_config(tiny_dataset, tmp_path / "one", **base)
    one["cluster"] = {"num_workers": 1}
    one["train"]["micro_batch"] = 8  # the same global batch on one worker
    resumed = train(one, progress=False, resume=first)
    half = tiny_config(tiny_dataset, tmp_path / "half", **base)
    half["cluster"] = {"num_workers": 1}
    with caplog.at_level("WARNING", logger="elixir_ray"):
        train({**half, "train": {**half["train"], "steps": 4, "seed": 5}}, progress=False, resume=first)
    assert "the checkpoint's run had a global batch of 8 (2 worker(s) x micro-batch 4 x grad_accum 1), this run " \
           "has 4" in caplog.text
    assert "the checkpoint's run had train.seed=0, this run has 5" in caplog.text
    assert resumed.metrics.column("step").to_pylist() == [4, 5, 6]
    np.testing.assert_allclose(resumed.metrics.column("loss").to_pylist(),
                               full.metrics.column("loss").to_pylist()[3:], rtol=0, atol=1e-5)
    out = tmp_path / "model.safetensors"
    assert main(["export", full.checkpoint_uri, str(out)]) == 0
    exported = load_file(str(out))
    for k, v in _model(full.checkpoint_uri).items():
        np.testing.assert_array_equal(exported[k[len("model/"):]], v)


def _slow_or_stalled_writer(marker: str, stall_at: int) -> type:
    """A worker group whose rank 0 (which writes the replicated chunks too) writes its shard in 16 KiB blocks with a pause
    after each (a slow filesystem: the write moves), except once at step `stall_at`, where it first
    stops for 15 s (a hung mount)."""

    class SlowWriter(RankWorker):
        def write_shard(self, work_uri):
            if self.rank == 0:
                from elixir_ray.checkpoint import safetensors_io

                real = getattr(safetensors_io, "_real_write", safetensors_io.write)
                safetensors_io._real_write = real

                def slow(out, names, get, spec, metadata=None, on_bytes=None):
                    def tick(n):
                        time.sleep(0.025)
                        on_bytes(n)
                    return real(out, names, get, spec, metadata, on_bytes=tick if on_bytes else None)

                safetensors_io.write, safetensors_io.WRITE_BLOCK = slow, 16 * 2**10
                if self.trainer.state.step == stall_at and not os.path.exists(marker):
                    open(marker, "w").close()
                    time.sleep(15)
            return super().write_shard(work_uri)

    return group_of(SlowWriter)


@pytest.mark.extended
def test_a_slow_write_is_waited_for_and_a_stalled_one_restarts(ray_cluster, tiny_dataset, tmp_path):
    """A write is as slow as its storage: one that keeps moving for longer than fault.detect_timeout_s
    completes; one where no rank writes a byte for that long fails the group, which restarts from the
    previous checkpoint and finishes."""
    slow = _slow_or_stalled_writer(str(tmp_path / "stalled"), stall_at=4)
    cfg = tiny_config(tiny_dataset, tmp_path, train={"steps": 4},
                      checkpoint={"every_steps": 2, "via": "storage", "keep": 3},
                      fault={"max_restarts": 1, "detect_timeout_s": 5})
    result = train(cfg, progress=False, worker_group_cls=slow)
    (record,) = result.restarts
    assert "no rank wrote anything for 5s" in record.reason and record.restored_step == 2, record
    assert max(result.snapshot_stalls) > 5  # the slow writes took longer than detect_timeout_s
    assert result.metrics.column("step").to_pylist() == list(range(1, 5)) and not result.persist_errors
    assert [p[-8:] for p in list_checkpoints(os.path.dirname(result.checkpoint_uri))] == ["00000002", "00000004"]


@pytest.mark.extended
def test_a_last_checkpoint_that_cannot_be_started_leaves_the_run_unsaved(ray_cluster, tiny_dataset, tmp_path,
                                                                         monkeypatch):
    """A disk that fills after the first checkpoint: the last one's directory cannot be made. The run
    trained to step 4 and saved step 2, so it must say its final checkpoint was not written (it said
    it was: the step it reached was set only once a write got that far)."""
    real = controller.begin_checkpoint

    def full_at_4(uri, step):
        if step == 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(uri, step)

    monkeypatch.setattr(controller, "begin_checkpoint", full_at_4)
    cfg = tiny_config(tiny_dataset, tmp_path, train={"steps": 4}, checkpoint={"every_steps": 2, "via": "storage"})
    result = train(cfg, progress=False)
    assert result.metrics.column("step").to_pylist() == [1, 2, 3, 4]
    assert (result.final_step, result.checkpoint_step) == (4, 2) and not result.final_checkpoint_written
    (error,) = result.persist_errors
    assert "step 4" in error and "No space left on device" in error
