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
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import ray

from elixir_ray.checkpoint import CheckpointError, delete_checkpoint, read_manifest, save_checkpoint
from elixir_ray.engine import assemble

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


def join_shards(results: list[dict]) -> dict:
    """Whole tensors from the workers' `state_shard` results (rank order)."""
    tensors = assemble([r["tensors"] for r in results], results[0]["layout"])
    for rank, r in enumerate(results):  # each rank's random streams, restored per rank
        for key in ("rng/torch_cpu", "rng/torch_cuda"):
            if key in r["tensors"]:
                tensors[f"rng/rank{rank}/{key.split('/')[1]}"] = r["tensors"][key]
    return tensors


@dataclass
class Snapshot:
    step: int
    samples_consumed: int
    extra: dict  # what the manifest records beside the tensors (plan, config, world size)
    worker_refs: list  # each worker's state_shard result: driver-owned, stored on that worker's node
    driver_ref: Optional[ray.ObjectRef] = None  # the joined whole tensors, on the driver's node
    taken_at: float = field(default_factory=time.time)

    def fetch(self, timeout_s: float = FETCH_TIMEOUT_S) -> Optional[dict]:
        """Whole tensors, from the driver's copy or else the workers' shards; None if they are gone."""
        # the persister sets driver_ref and then empties worker_refs: read them in the other order
        worker_refs = self.worker_refs
        driver_ref = self.driver_ref
        if driver_ref is not None:
            try:
                return ray.get(driver_ref, timeout=timeout_s)
            except OBJECT_GONE:
                pass
        if not worker_refs:
            return None
        try:
            return join_shards(ray.get(worker_refs, timeout=timeout_s))
        except (*OBJECT_GONE, ray.exceptions.RayTaskError):  # a rank failed to make its shard: no snapshot
            return None


class CheckpointPersister:
    """One background thread that makes the driver copy and writes the newest pending snapshot."""

    def __init__(self, uri: str, keep: int, on_error: Callable[[str], None] | None = None):
        self.uri, self.keep = uri, keep
        self.on_error = on_error or (lambda msg: None)
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
        tensors = snap.fetch()
        if tensors is None:
            self._report(f"checkpoint of step {snap.step} was lost from the object store before it was persisted")
            return
        if snap.driver_ref is None:
            snap.driver_ref = ray.put(tensors)
            snap.worker_refs = []  # the joined copy supersedes the shards: free them
        try:
            start = time.monotonic()
            path = save_checkpoint(self.uri, snap.step, tensors, {"samples_consumed": snap.samples_consumed,
                                                                  **snap.extra})
            # a step written again after a restart replaces its earlier commit
            self.committed = [(step, p) for step, p in self.committed if p != path] + [(snap.step, path)]
            log.info("persisted step %d to %s in %.2fs", snap.step, path, time.monotonic() - start)
        except Exception as exc:  # a full disk or an unwritable URI must not stop training
            # a failed rewrite of a step committed before (after a restart) may have deleted that commit
            self.committed = [(step, p) for step, p in self.committed if step != snap.step or _readable(p)]
            self._report(f"could not persist the checkpoint of step {snap.step} to {self.uri}: {exc}")
            return
        self._prune()

    def _prune(self) -> None:
        """Keep this run's newest `keep` commits (the list of them is what `newest` and restores read)."""
        if not self.keep:
            return
        while len(self.committed) > self.keep:
            step, path = self.committed[0]
            try:
                delete_checkpoint(path)  # manifest first: never listed as committed half-deleted
            except (OSError, ValueError) as exc:
                self._report(f"could not delete the old checkpoint of step {step} at {path}: {exc}")
                return
            self.committed.pop(0)

    def _report(self, message: str) -> None:
        self.errors.append(message)
        warnings.warn(message, RuntimeWarning, stacklevel=1)
        log.error(message)
        self.on_error(message)
