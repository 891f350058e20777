"""Failures at the awkward moments: a rank lost while handing over its snapshot (the last one
included), a rank that stalls without dying, another run's workers on the same cluster, and
checkpoints another run left in the same directory.

Faults are injected by real means: a worker subclass that exits its process (`os._exit`) or raises
once (a marker file says it already did), SIGSTOP of a worker's process, and a real actor holding a
name. The run then goes through the real controller, Ray cluster and gloo group.
"""

import json
import os
import signal
import threading
import time
import warnings

import numpy as np
import pytest
import ray

from elixir_ray import ClusterError, train
from elixir_ray.checkpoint import list_checkpoints, read_manifest
from elixir_ray.cluster.snapshots import CheckpointPersister, Snapshot
from elixir_ray.cluster.worker import RankWorker, worker_actor_name

from conftest import group_of, tiny_config


def _faulty_workers(marker, rank: int, at_step: int, how: str) -> type:
    """A worker group whose rank `rank`'s state_shard fails once, at step `at_step`: `how` is "exit"
    (the process dies) or "raise"."""

    class FaultyWorker(RankWorker):
        @ray.method(num_returns=2)
        def state_shard(self):
            if self.rank == rank and self.trainer.state.step == at_step and not os.path.exists(marker):
                open(marker, "w").close()
                if how == "exit":
                    os._exit(1)
                raise RuntimeError(f"injected: rank {rank} cannot hand over its shard at step {at_step}")
            return super().state_shard()

    return group_of(FaultyWorker)


def _steps(result):
    return result.metrics.column("step").to_pylist()


@pytest.mark.parametrize("how", ["exit", "raise"])
@pytest.mark.extended
def test_a_rank_lost_in_the_last_snapshot_restarts_and_the_last_step_is_persisted(
        ray_cluster, tiny_dataset, tmp_path, how):
    """Every rank's result is checked, not only rank 0's: otherwise the run would report success with
    step 2 as its checkpoint ("exit"), or the persister thread would die on the bad shard and the run
    hang ("raise")."""
    faulty = _faulty_workers(tmp_path / "fired", rank=1, at_step=4, how=how)
    cfg = tiny_config(tiny_dataset, tmp_path, train={"steps": 4}, checkpoint={"every_steps": 2},
                      fault={"max_restarts": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = train(cfg, progress=False, worker_group_cls=faulty)
    assert (tmp_path / "fired").exists()
    (record,) = result.restarts
    # the step-2 shards outlive the ranks that made them: they are on the node, owned by the driver
    assert "snapshot" in record.reason and record.restored_step == 2 and record.restored_from == "object_store", record
    assert _steps(result) == [1, 2, 3, 4]
    assert read_manifest(result.checkpoint_uri)["step"] == 4 and not result.persist_errors, result.persist_errors


def test_the_persister_outlives_a_snapshot_it_cannot_fetch(ray_cluster, tmp_path):
    """A snapshot whose shard is a failed task's result is reported, and the next one is still written."""

    @ray.remote
    def shard():
        raise RuntimeError("no shard")

    persister = CheckpointPersister(str(tmp_path / "ck"), keep=2)
    try:
        persister.submit(Snapshot(step=1, samples_consumed=4, extra={}, worker_refs=[shard.remote()]))
        assert persister.flush(timeout_s=60)
        layout = {"world": 1, "chunks": [{"size": 4, "sharded": False}], "buffers": [],
                  "slots": [{"name": "w", "keys": ["w"], "chunk": 0, "offset": 0, "numel": 4, "shape": [4]}]}
        good = ray.put({"tensors": {"chunk/0/master": np.arange(4, dtype=np.float32),
                                    "slots/step": np.zeros(1, dtype=np.int64)}, "layout": layout})
        persister.submit(Snapshot(step=2, samples_consumed=8, extra={}, worker_refs=[good], on_driver_node=True))
        assert persister.flush(timeout_s=60), "the persister thread stopped consuming snapshots"
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            persister.close()
    assert len(persister.errors) == 1 and "step 1" in persister.errors[0], persister.errors
    assert [step for step, _ in persister.committed] == [2]


@pytest.mark.extended
def test_a_stalled_rank_0_is_a_failure_after_detect_timeout(ray_cluster, tiny_dataset, tmp_path):
    """A SIGSTOPped rank 0 answers nothing: the driver's metrics poll must not wait for it forever."""
    name = "stall"
    stopped = {}

    def stop_rank_0():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not stopped:
            try:
                actor = ray.get_actor(worker_actor_name(name, 0), namespace="elixir_ray")
                if ray.get(actor.current_step.remote(), timeout=5) >= 2:
                    pid = ray.get(actor.node_info.remote(), timeout=5)["pid"]
                    os.kill(pid, signal.SIGSTOP)
                    stopped["pid"], stopped["at"] = pid, time.monotonic()
            except (ValueError, ray.exceptions.RayError):
                pass
            time.sleep(0.02)

    thread = threading.Thread(target=stop_rank_0, daemon=True)
    thread.start()
    cfg = {**tiny_config(tiny_dataset, tmp_path, train={"steps": 200}, checkpoint={"every_steps": 100},
                         fault={"max_restarts": 0, "detect_timeout_s": 8}), "name": name}
    try:
        with pytest.raises(ClusterError, match="giving up after 0 restart"):
            train(cfg, progress=False)
        noticed = time.monotonic()
    finally:
        thread.join(timeout=5)
        if "pid" in stopped:
            try:
                os.kill(stopped["pid"], signal.SIGCONT)  # the controller's teardown SIGKILLs it; be sure
            except ProcessLookupError:
                pass
    assert stopped, "rank 0 was never stopped"
    assert noticed - stopped["at"] < 8 + 30, noticed - stopped["at"]


@pytest.mark.extended
def test_another_runs_workers_on_the_cluster_are_named_in_the_error(ray_cluster, tiny_dataset, tmp_path):
    @ray.remote(num_cpus=0)
    class Holder:
        def ping(self):
            return True

    holder = Holder.options(name=worker_actor_name("busy", 0), namespace="elixir_ray").remote()
    ray.get(holder.ping.remote())
    try:
        with pytest.raises(ClusterError, match="a run named 'busy' already has workers on this Ray cluster"):
            train({**tiny_config(tiny_dataset, tmp_path), "name": "busy"}, progress=False)
    finally:
        ray.kill(holder)
    # a run of another name shares the cluster with it
    other = {**tiny_config(tiny_dataset, tmp_path, train={"steps": 1}), "name": "other"}
    assert _steps(train(other, progress=False)) == [1]


@pytest.mark.extended
def test_keep_never_deletes_what_this_run_just_wrote(ray_cluster, tiny_dataset, tmp_path):
    """An earlier run of the same name left higher steps in the directory: pruning by step alone would
    delete the new run's own checkpoint, and its result would name a directory that is gone."""
    first = train(tiny_config(tiny_dataset, tmp_path, train={"steps": 6}, checkpoint={"every_steps": 3, "keep": 2}),
                  progress=False)
    with pytest.warns(UserWarning, match=r"already holds 2 checkpoint\(s\) of an earlier run"):  # and goes on
        second = train(tiny_config(tiny_dataset, tmp_path, train={"steps": 2},
                                   checkpoint={"every_steps": 1, "keep": 1}), progress=False)
    assert os.path.isdir(second.checkpoint_uri) and read_manifest(second.checkpoint_uri)["step"] == 2
    steps = [os.path.basename(p) for p in list_checkpoints(os.path.dirname(first.checkpoint_uri))]
    # this run kept its newest one (step 2, its step 1 pruned); the earlier run's are left alone
    assert steps == ["step-00000002", "step-00000003", "step-00000006"], steps


def _listening_probe():
    """A function that lists the (address, port) of every TCP socket its process listens on, read
    from /proc (addresses as /proc writes them: hex, in the host's byte order). Made in here, so that
    Ray ships it to the workers by value."""
    def listening_addresses() -> set[tuple[str, int]]:
        inodes = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        found = set()
        for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
            with open(table) as f:
                for line in f.readlines()[1:]:
                    fields = line.split()
                    if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                        address, port = fields[1].split(":")
                        found.add((address, int(port, 16)))
        return found

    return listening_addresses


LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


def _listeners_of_a_run(tiny_dataset, tmp_path, group_cls=None) -> dict[int, list]:
    """Train one step with the ranks noting what they listen on once the process group is formed,
    beyond what their process listened on when the actor started (Ray's own worker port): the
    rendezvous store and gloo's pairs. {rank: [(address, port), ...]}."""
    from elixir_ray.cluster.worker import rank_actor
    from elixir_ray.cluster.worker_group import WorkerGroup

    listening_addresses = _listening_probe()
    out = str(tmp_path)

    class Watched(RankWorker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._listening_before = listening_addresses()

        def init_process_group(self, *args, **kwargs):
            super().init_process_group(*args, **kwargs)
            import json

            with open(os.path.join(out, f"rank{self.rank}.json"), "w") as f:
                json.dump(sorted(listening_addresses() - self._listening_before), f)

    group = type("WatchedGroup", (group_cls or WorkerGroup,), {"actor_cls": rank_actor(Watched)})
    train(tiny_config(tiny_dataset, tmp_path, train={"steps": 1}), progress=False, worker_group_cls=group)
    return {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)}


def test_a_one_node_run_opens_no_socket_beyond_loopback(ray_cluster, tiny_dataset, tmp_path):
    """torch's TCPStore listens on every interface whatever address it is given: one node's ranks meet
    through a file instead. (Ray's own worker port is Ray's, open before the group is formed.)"""
    opened = _listeners_of_a_run(tiny_dataset, tmp_path)
    wide = [(rank, a, p) for rank, sockets in opened.items() for a, p in sockets if a not in LOOPBACK]
    assert not wide, f"listening beyond loopback: {wide}"
    assert any(opened.values()), opened  # gloo's own sockets, on loopback: the probe does see sockets


def test_across_nodes_the_rendezvous_store_and_gloo_listen_on_the_nodes_address_only(
        ray_cluster, tiny_dataset, tmp_path):
    """Across nodes the ranks meet through a TCP store on rank 0, which torch binds to every interface
    when given an address and port: it is given a socket bound to the node's address instead, and
    gloo listens on the interface that holds that address. The path is taken here on one node, as
    if the ranks were on two."""
    import socket

    from elixir_ray.cluster.worker_group import WorkerGroup

    class AsIfAcrossNodes(WorkerGroup):
        def _init_method(self, *, one_node: bool, rank0_ip: str) -> str:
            return super()._init_method(one_node=False, rank0_ip=rank0_ip)

    node_ip = ray.util.get_node_ip_address()
    if node_ip.startswith("127."):
        pytest.skip(f"Ray's node address here is loopback ({node_ip}): no other interface to tell apart")
    ours = socket.inet_aton(node_ip)[::-1].hex().upper()  # /proc's form of the address (x86: little-endian)
    opened = _listeners_of_a_run(tiny_dataset, tmp_path, AsIfAcrossNodes)
    elsewhere = [(rank, a, p) for rank, sockets in opened.items() for a, p in sockets if a != ours]
    assert not elsewhere, f"listening beyond {node_ip}: {elsewhere}"
    assert len(opened[0]) > len(opened[1]) >= 1, opened  # rank 0: the store too; every rank: gloo's pairs


def test_a_run_name_cannot_cut_the_rendezvous_files_url_short():
    """A '#' or '?' in the name would end the file:// URL's path, and every try would share one file."""
    from urllib.parse import urlparse

    paths = {RankWorker.rendezvous_file(None, "exp#1?x=y") for _ in range(2)}
    RankWorker.remove_files(None, list(paths))
    assert len(paths) == 2
    for path in paths:
        assert urlparse(f"file://{path}").path == path and "exp_1_x_y" in path and not os.path.exists(path)


@pytest.mark.extended
def test_ranks_that_do_not_share_a_temp_directory_meet_over_loopback_tcp(ray_cluster, tiny_dataset, tmp_path,
                                                                           caplog):
    """Workers in containers of their own (a Ray image_uri) have a /tmp each: rank 1 here does not see
    rank 0's rendezvous file, so the group forms through a TCP store on 127.0.0.1 instead of timing out."""

    class OwnTmp(RankWorker):
        def sees_file(self, path):
            return self.rank == 0 and super().sees_file(path)

    with caplog.at_level("WARNING", logger="elixir_ray"):
        result = train(tiny_config(tiny_dataset, tmp_path, train={"steps": 1}), progress=False,
                       worker_group_cls=group_of(OwnTmp))
    assert "meeting through a TCP store on 127.0.0.1" in caplog.text
    assert _steps(result) == [1] and not result.restarts


@pytest.mark.extended
def test_a_rank_that_hangs_while_profiling_is_a_failure_and_the_run_restarts(ray_cluster, tiny_dataset, tmp_path):
    """Profiling, setting up and restoring are waited for as long as they take: a rank that stopped
    answering there (SIGSTOP: a process hung in a driver call looks the same) must not hold the driver
    forever."""
    marker = tmp_path / "stopped"

    class HangingWorker(RankWorker):
        def profile(self, micro_batch):
            if self.rank == 1 and not marker.exists():
                marker.write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP)  # the whole process: its other threads stop too
            return super().profile(micro_batch)

    cfg = tiny_config(tiny_dataset, tmp_path, train={"steps": 4}, checkpoint={"every_steps": 2},
                      fault={"max_restarts": 1, "detect_timeout_s": 8})
    started = time.monotonic()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = train(cfg, progress=False, worker_group_cls=group_of(HangingWorker))
    finally:
        if marker.exists():
            try:
                os.kill(int(marker.read_text()), signal.SIGCONT)  # the teardown SIGKILLs it; be sure
            except (ProcessLookupError, ValueError):
                pass
    (record,) = result.restarts
    assert "profiling the workers" in record.reason and "worker(s) 1 did not answer for 8s" in record.reason, record
    assert _steps(result) == [1, 2, 3, 4]
    assert time.monotonic() - started < 120


@pytest.mark.extended
def test_an_error_raised_again_at_the_same_step_after_a_restart_ends_the_run(ray_cluster, tiny_dataset, tmp_path):
    """A step that fails the same way on every try (a bad config, a model too big at this size) used to
    be restarted fault.max_restarts times, each time re-placing, re-profiling and restoring. Whichever
    rank reports the error first, the second identical failure ends the run with the error named."""
    tries, starts = tmp_path / "tries", tmp_path / "starts"

    class FailingWorker(RankWorker):
        """From step 3 on, one rank's step raises: rank 1 on the first try, rank 0 on the next ones."""

        def __init__(self, config, rank, world_size):
            super().__init__(config, rank, world_size)
            if rank == 0:  # one line per try, written before any rank trains
                with open(starts, "a") as f:
                    f.write("try\n")

        def run(self, num_steps):
            step, trainer = self.trainer.step, self.trainer
            failing_rank = 1 if len(starts.read_text().split()) == 1 else 0

            def failing_step(**kwargs):
                if trainer.state.step >= 2 and self.rank == failing_rank:
                    with open(tries, "a") as f:
                        f.write(f"{self.rank}\n")
                    raise FloatingPointError("injected: the loss is not finite")  # the run's error, not a worker's
                return step(**kwargs)

            trainer.step = failing_step
            return super().run(num_steps)

    cfg = tiny_config(tiny_dataset, tmp_path, train={"steps": 4}, checkpoint={"every_steps": 2},
                      fault={"max_restarts": 3})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ClusterError, match=r"(?s)injected: the loss is not finite.*raised after step 2 before "
                                               r"the last restart too.*giving up after 1 restart"):
            train(cfg, progress=False, worker_group_cls=group_of(FailingWorker))
    # two tries, not the four that max_restarts=3 allows
    assert tries.read_text().split() == ["1", "0"]
