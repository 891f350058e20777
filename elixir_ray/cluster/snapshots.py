"""The two checkpoint tiers on the driver: snapshots in the object store, persisted in the background.

A snapshot is every worker's shard of the training state, each returned by an actor method, so
the driver owns them and they outlive the worker processes. The persister thread joins the shards
into whole tensors, puts that into the driver's own object store (`ray.put`, on the driver's node,
so it also survives the loss of a worker's node) and writes it durably through pyarrow.fs. A failed
write (or any error on the way, such as a full object store) is recorded and reported; training
never waits for it, the thread goes on with the next snapshot, and a half-written checkpoint is
never committed. `checkpoint.keep` prunes only the checkpoints this run committed: another run's
in the same directory (an earlier run of the same name) are never deleted for this one's.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

import ray

from elixir_ray.checkpoint import CheckpointError, delete_checkpoint, read_manifest, save_checkpoint
from elixir_ray.checkpoint.shards import join_rank_shards
from elixir_ray.cluster.shard_parts import copy_here, fetch_whole
from elixir_ray.engine import JoinedState

log = logging.getLogger("elixir_ray")

# Errors meaning "this object is gone" rather than "the code is wrong".
OBJECT_GONE = (
    ray.exceptions.ObjectLostError,
    ray.exceptions.OwnerDiedError,
    ray.exceptions.ObjectReconstructionFailedError,
    ray.exceptions.GetTimeoutError,
    ray.exceptions.RayActorError,
)
FETCH_TIMEOUT_S = 600.0  # joining a large model's shards across nodes is minutes of copying, not a loss


def _readable(path: str) -> bool:
    try:
        read_manifest(path)
        return True
    except CheckpointError:
        return False


def join_shards(results: list[dict]) -> JoinedState:
    """Whole tensors from the workers' `state_shard` results (rank order), each joined when read."""
    return join_rank_shards([r["tensors"] for r in results], results[0]["layout"])


@dataclass
class Snapshot:
    step: int
    samples_consumed: int
    extra: dict  # what the manifest records beside the tensors (plan, config, world size)
    # each worker's shard (a ref of its state_shard result, or its parts: shard_parts.RankShardRefs),
    # driver-owned, stored on that worker's node
    worker_refs: list
    # the same shards copied to the driver's node (so the snapshot outlives a worker's node); None
    # until the persister makes them, and never when every shard is on the driver's node already
    driver_refs: Optional[list] = None
    on_driver_node: bool = False  # every worker ran on the driver's node: no copy is worth making
    taken_at: float = field(default_factory=time.time)

    def fetch(self, timeout_s: float = FETCH_TIMEOUT_S) -> Optional[Mapping]:
        """Whole tensors (joined as each is read), from the driver's copies or else the workers'
        shards; None if they are gone."""
        found = self.live_shards(timeout_s)
        return join_shards(found[1]) if found is not None else None

    def live_shards(self, timeout_s: float = FETCH_TIMEOUT_S) -> Optional[tuple[list, list]]:
        """(refs, shards) of a copy that can still be read, the driver's first; None if both are gone.
        A restore hands the refs to the workers, so the state is not put in the store once more."""
        # the persister sets driver_refs and then empties worker_refs: read them in the other order
        worker_refs = self.worker_refs
        driver_refs = self.driver_refs
        for refs in (driver_refs, worker_refs):
            if not refs:
                continue
            try:
                return refs, fetch_whole(refs, timeout_s)
            except (*OBJECT_GONE, ray.exceptions.RayTaskError):  # gone, or a rank failed to make its shard
                continue
        return None


class CheckpointPersister:
    """One background thread that makes the driver copy and writes the newest pending snapshot."""

    def __init__(self, uri: str, keep: int, on_error: Callable[[str], None] | None = None,
                 on_commit: Callable[[int, str], None] | None = None):
        self.uri, self.keep = uri, keep
        self.on_error = on_error or (lambda msg: None)
        self.on_commit = on_commit or (lambda step, path: None)  # a sweep's trial registers each with Ray Tune
        self.errors: list[str] = []
        self.committed: list[tuple[int, str]] = []
        self._pending: Optional[Snapshot] = None
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="elixir-ray-persist", daemon=True)
        self._thread.start()

    def submit(self, snapshot: Snapshot) -> None:
        """Queue a snapshot; an older one still waiting is superseded (only the newest matters)."""
        with self._cond:
            self._pending = snapshot
            self._cond.notify_all()

    def flush(self, timeout_s: Optional[float] = None) -> bool:
        """Wait until nothing is pending or being written."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._pending is not None or self._busy:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def close(self) -> None:
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    @property
    def newest(self) -> Optional[str]:
        return self.committed[-1][1] if self.committed else None

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:
                    return
                snap, self._pending, self._busy = self._pending, None, True
            try:
                self._persist(snap)
            except Exception as exc:  # the thread must outlive any one snapshot: flush() waits on it
                self._report(f"could not persist the checkpoint of step {snap.step}: {type(exc).__name__}: {exc}")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _persist(self, snap: Snapshot) -> None:
        if snap.driver_refs is None and not snap.on_driver_node:
            # a batch of objects at a time (`copy_here`), so the driver's node holds little beyond the copies
            try:
                copies = copy_here(snap.worker_refs, FETCH_TIMEOUT_S)
            except (*OBJECT_GONE, ray.exceptions.RayTaskError):
                copies = None
            if copies is not None:
                snap.driver_refs = copies
                snap.worker_refs = []  # the copies supersede the shards: free them
        tensors = snap.fetch()
        if tensors is None:
            self._report(f"checkpoint of step {snap.step} was lost from the object store before it was persisted")
            return
        try:
            start = time.monotonic()
            path = save_checkpoint(self.uri, snap.step, tensors, {"samples_consumed": snap.samples_consumed,
                                                                  **snap.extra})
            log.info("persisted step %d to %s in %.2fs", snap.step, path, time.monotonic() - start)
        except Exception as exc:  # a full disk or an unwritable URI must not stop training
            self.forget_unreadable(snap.step)
            self._report(f"could not persist the checkpoint of step {snap.step} to {self.uri}: {exc}")
            return
        self.record(snap.step, path)

    def record(self, step: int, path: str) -> None:
        """A committed checkpoint (by this thread, or by the workers straight to storage): counted
        among this run's commits (a step written again after a restart replaces its earlier commit),
        and older ones pruned as `keep` says."""
        with self._cond:
            self.committed = [(s, p) for s, p in self.committed if p != path] + [(step, path)]
        self.on_commit(step, path)
        self._prune()

    def forget_unreadable(self, step: int) -> None:
        """After a failed write of `step`: a rewrite of a step committed before (after a restart) may
        have deleted that commit, which restores must then not count on."""
        with self._cond:
            suspects = [p for s, p in self.committed if s == step]
        gone = {p for p in suspects if not _readable(p)}  # read outside the lock: submit() must not wait
        with self._cond:
            self.committed = [(s, p) for s, p in self.committed if p not in gone]

    def report(self, message: str) -> None:
        """A checkpoint that could not be persisted: logged and listed in the run's result."""
        self._report(message)

    def _prune(self) -> None:
        """Keep this run's newest `keep` commits (the list of them is what `newest` and restores read)."""
        if not self.keep:
            return
        with self._cond:
            victims = self.committed[:-self.keep]
        for step, path in victims:  # deleted outside the lock: submit() must not wait on storage
            try:
                delete_checkpoint(path)  # manifest first: never listed as committed half-deleted
            except (OSError, ValueError) as exc:
                self._report(f"could not delete the old checkpoint of step {step} at {path}: {exc}")
                return
            with self._cond:
                self.committed = [(s, p) for s, p in self.committed if p != path]

    def _report(self, message: str) -> None:
        """Once, as a log record: the CLI shows it as one line, and Python shows it without logging set
        up (a warning beside it printed the same message twice, with a source line); the run's summary
        lists it again at the end."""
        self.errors.append(message)
        log.error(message)
        self.on_error(message)
