"""One run at a time per run directory and checkpoint directory (RunClaim), with real files."""

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from elixir_ray import ConfigError, train
from elixir_ray.run.claim import CLAIM_FILE, STALE_S, _pid_namespace, claim_outputs
from elixir_ray.run.resolved import as_config

from conftest import tiny_config


def _cfg(tiny_dataset, tmp_path, **sections):
    return as_config(tiny_config(tiny_dataset, tmp_path, **sections))


def test_a_run_directory_in_use_is_refused_naming_the_run_and_what_to_change(tiny_dataset, tmp_path):
    first = _cfg(tiny_dataset, tmp_path, cluster={"namespace": "a"})
    claim = claim_outputs(first)
    try:
        same_dir = _cfg(tiny_dataset, tmp_path, cluster={"namespace": "b"})  # the same name and output_dir
        with pytest.raises(ConfigError, match=r"output_dir '.*/runs/t' is in use by the run 't' \(Ray namespace "
                                              r"'a', pid \d+ on .*\): .* Give this run another name or output_dir"):
            claim_outputs(same_dir)
        # the refused run left the first one's claim as it was
        held = json.loads((tmp_path / "runs" / "t" / CLAIM_FILE).read_text())
        assert held["token"] == claim.info["token"]
    finally:
        claim.release()
    assert not (tmp_path / "runs" / "t" / CLAIM_FILE).exists()
    claim_outputs(first).release()  # free again once released


def test_a_checkpoint_directory_shared_by_two_names_is_refused(tiny_dataset, tmp_path):
    shared = {"uri": str(tmp_path / "shared-checkpoints")}
    claim = claim_outputs(_cfg(tiny_dataset, tmp_path, checkpoint=shared))
    try:
        other = as_config({**tiny_config(tiny_dataset, tmp_path, checkpoint=shared), "name": "k2"})
        with pytest.raises(ConfigError, match=r"checkpoint.uri '.*shared-checkpoints' is in use by the run 't'.*"
                                              r"Give this run another checkpoint.uri"):
            claim_outputs(other)
        assert not (tmp_path / "runs" / "k2" / CLAIM_FILE).exists()  # its run directory's claim was undone
    finally:
        claim.release()


def test_the_claim_of_a_run_that_is_gone_is_taken_over(tiny_dataset, tmp_path, caplog):
    cfg = _cfg(tiny_dataset, tmp_path)
    path = tmp_path / "runs" / "t" / CLAIM_FILE
    path.parent.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    now, here = time.time(), {"host": socket.gethostname(), "pid_namespace": _pid_namespace()}
    gone = [
        {"token": "x", "name": "old", **here, "pid": int(dead.stdout), "heartbeat": now},  # killed outright
        {"token": "y", "name": "old", "host": "another-host", "pid": 1, "heartbeat": now - STALE_S - 1},
        {"token": "w", "name": "old", **here, "pid": os.getpid(), "heartbeat": now - STALE_S - 1},  # pid reused
        {},  # unreadable: a crash's leftover (a live claim is always written whole)
    ]
    for held in gone:
        path.write_text(json.dumps(held) if held else "{trunc")
        claim = claim_outputs(cfg)
        assert json.loads(path.read_text())["token"] == claim.info["token"]
        claim.release()
    assert "which is gone: this run takes it over" in caplog.text
    path.write_text(json.dumps({"token": "z", "name": "elsewhere", "host": "another-host", "pid": 1,
                                "heartbeat": now}))  # a live run on another host: its heartbeat is fresh
    with pytest.raises(ConfigError, match="in use by the run 'elsewhere'"):
        claim_outputs(cfg)


def test_the_heartbeat_refreshes_the_claim(tiny_dataset, tmp_path):
    claim = claim_outputs(_cfg(tiny_dataset, tmp_path))
    try:
        path = tmp_path / "runs" / "t" / CLAIM_FILE
        before = json.loads(path.read_text())["heartbeat"]
        time.sleep(0.01)
        claim.beat()
        assert json.loads(path.read_text())["heartbeat"] > before
    finally:
        claim.release()


def test_train_refuses_a_run_directory_in_use_before_ray_starts(tiny_dataset, tmp_path):
    import ray

    cfg = tiny_config(tiny_dataset, tmp_path)
    claim = claim_outputs(as_config(cfg))
    try:
        was_up = ray.is_initialized()
        with pytest.raises(ConfigError, match="is in use by the run 't'"):
            train(cfg, progress=False)
        assert ray.is_initialized() == was_up
        assert not os.path.exists(tmp_path / "runs" / "t" / "metrics.parquet")
    finally:
        claim.release()


def test_a_checkpoint_directory_that_is_the_run_directory_is_claimed_once(tiny_dataset, tmp_path):
    claim = claim_outputs(_cfg(tiny_dataset, tmp_path, checkpoint={"uri": str(tmp_path / "runs" / "t")}))
    assert len(claim.paths) == 1
    claim.release()


def test_a_heartbeat_during_the_release_does_not_write_the_claim_back(tiny_dataset, tmp_path, monkeypatch):
    from elixir_ray.run import claim as run_claim

    claim = claim_outputs(_cfg(tiny_dataset, tmp_path))
    write = run_claim.storage.write_bytes_atomic
    writing = threading.Event()

    def slow_write(fs, path, payload):  # an object store's PUT
        writing.set()
        time.sleep(0.3)
        write(fs, path, payload)

    monkeypatch.setattr(run_claim.storage, "write_bytes_atomic", slow_write)
    beat = threading.Thread(target=claim.beat)
    beat.start()
    writing.wait(5)
    claim.release()
    beat.join()
    assert not (tmp_path / "runs" / "t" / CLAIM_FILE).exists()


def test_of_two_runs_taking_over_a_stale_claim_at_once_one_wins(tiny_dataset, tmp_path):
    cfg = _cfg(tiny_dataset, tmp_path)
    path = tmp_path / "runs" / "t" / CLAIM_FILE
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"token": "old", "host": "gone-host", "pid": 1, "heartbeat": 0}))
    start, won, refused = threading.Barrier(4), [], []

    def run():
        start.wait()
        try:
            won.append(claim_outputs(cfg))
        except ConfigError:
            refused.append(1)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(refused) == 3
    assert json.loads(path.read_text())["token"] == won[0].info["token"]
    won[0].release()
