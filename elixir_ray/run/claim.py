"""RunClaim: one run at a time writes a run directory, and a checkpoint directory.

Two runs given the same outputs (one name and output_dir under two Ray namespaces, or one
`checkpoint.uri` shared by two names) would overwrite each other's metrics and checkpoints without
a word, and each Result would name the other's checkpoint. So a run claims each directory it writes with
a small file naming it, and a run that finds a live claim is refused before it starts. A claim is
live while its heartbeat (rewritten every HEARTBEAT_S while the run goes on) is under STALE_S old
and, when it was made in this process namespace of this host, its process still exists: a driver
killed outright leaves its claim behind, and the next run takes it over (at once on the same host).

On a local disk the check and the write happen under a lock on the directory, and the claim is
written whole (a temporary file renamed), so of two runs starting at once exactly one wins. Object
stores have neither: there a claim is read back after a pause, which catches all but a near tie.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

import pyarrow.fs as pafs

from elixir_ray import storage
from elixir_ray.config import RunConfig
from elixir_ray.errors import ConfigError

CLAIM_FILE = ".elixir_ray_run.json"
HEARTBEAT_S = 10.0
STALE_S = 60.0
READ_BACK_S = 1.0  # on an object store: how long a claim waits before reading itself back

log = logging.getLogger("elixir_ray")


@dataclass
class RunClaim:
    info: dict  # token, name, namespace, host, process namespace, pid, started, heartbeat
    paths: list[tuple[pafs.FileSystem, str]] = field(default_factory=list)  # claim files written
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)  # a beat and the release, one at a time

    def beat(self) -> None:
        """Rewrite the claims with a fresh heartbeat. One that another run holds now is left to it,
        loudly: that run judged this one gone, and both may be writing the directory."""
        with self.lock:
            if self.stop.is_set():  # released: a beat must not write the claim back
                return
            self.info["heartbeat"] = time.time()
            for fs, path in self.paths:
                try:
                    held = _read(fs, path) or {}
                    if self._holds(held):
                        storage.write_bytes_atomic(fs, path, _encode(self.info))
                    else:
                        log.error("this run's claim %s was taken by the run %r (pid %s on %s): both may be writing "
                                  "there now", path, held.get("name"), held.get("pid"), held.get("host"))
                except Exception as exc:  # a heartbeat missed is not what stops a run
                    log.warning("could not refresh the run's claim %s: %s", path, exc)

    def _holds(self, held: dict) -> bool:
        """Whether a claim read back is still this run's (another run may have taken it over)."""
        return held.get("token") == self.info["token"]

    def release(self) -> None:
        with self.lock:
            self.stop.set()
            for fs, path in self.paths:
                try:
                    if self._holds(_read(fs, path) or {}):
                        fs.delete_file(path)
                except OSError as exc:
                    log.warning("could not remove the run's claim %s: %s", path, exc)
            self.paths = []


def claim_outputs(cfg: RunConfig) -> RunClaim:
    """Claim the run directory and (when outside it) the checkpoint directory, or raise a
    ConfigError naming the live run that holds one and what to change."""
    now = time.time()
    claim = RunClaim(info={"token": uuid.uuid4().hex, "name": cfg.name, "namespace": cfg.cluster.namespace,
                           "host": socket.gethostname(), "pid_namespace": _pid_namespace(), "pid": os.getpid(),
                           "started": now, "heartbeat": now})
    targets = [(cfg.run_dir, "output_dir")]
    run_root = storage.resolve(cfg.run_dir)[1].rstrip("/")
    checkpoint_root = storage.resolve(cfg.checkpoint_uri)[1].rstrip("/")
    if checkpoint_root != run_root and not checkpoint_root.startswith(run_root + "/"):
        targets.append((cfg.checkpoint_uri, "checkpoint.uri"))
    try:
        for uri, key in targets:
            try:
                claim.paths.append(_claim(uri, key, claim.info))
            except OSError as exc:
                if key == "output_dir":
                    raise ConfigError(f"{key} {uri!r} cannot be written: {exc}") from None
                # checkpoint storage that fails is reported by each write and does not stop the run
                log.warning("could not claim %s %s (%s): another run could write checkpoints there too",
                            key, uri, exc)
    except BaseException:
        claim.release()
        raise
    threading.Thread(target=_heartbeat, args=(claim,), name="elixir-ray-claim", daemon=True).start()
    return claim


def _heartbeat(claim: RunClaim) -> None:
    while not claim.stop.wait(HEARTBEAT_S):
        claim.beat()


def _claim(uri: str, key: str, info: dict) -> tuple[pafs.FileSystem, str]:
    fs, root = storage.resolve(uri)
    fs.create_dir(root, recursive=True)
    path = f"{root}/{CLAIM_FILE}"
    local = isinstance(fs, pafs.LocalFileSystem)
    with _directory_lock(root) if local else contextlib.nullcontext():
        held = _read(fs, path)
        if held is not None and _alive(held):
            raise ConfigError(_in_use(uri, key, path, held))
        if held:
            log.warning("%s %s was claimed by the run %r (pid %s on %s), which is gone: this run takes it over",
                        key, uri, held.get("name"), held.get("pid"), held.get("host"))
        elif held is not None:
            log.warning("%s %s held an unreadable claim (left by a crash): this run takes it over", key, uri)
        storage.write_bytes_atomic(fs, path, _encode(info))  # whole or not at all: never read half-written
    if not local:  # no lock there: a run that wrote in between has overwritten this claim
        time.sleep(READ_BACK_S)
        mine = _read(fs, path) or {}
        if mine.get("token") != info["token"]:
            raise ConfigError(_in_use(uri, key, path, mine))
    return fs, path


@contextlib.contextmanager
def _directory_lock(root: str):
    """An exclusive lock on the directory itself (flock on its descriptor): the check and the
    write of a claim, one run at a time, with no lock file left behind."""
    import fcntl

    fd = os.open(root, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _pid_namespace() -> str:
    """Which processes a pid here names: two containers may share a hostname but not their pids."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def _alive(held: dict) -> bool:
    """A fresh heartbeat, and where the pid can be checked (this host and process namespace) a
    process that still exists: a pid reused after a crash keeps a claim for STALE_S at most."""
    heartbeat = held.get("heartbeat")
    if not (isinstance(heartbeat, (int, float)) and time.time() - heartbeat < STALE_S):
        return False
    here = held.get("host") == socket.gethostname() and held.get("pid_namespace") == _pid_namespace()
    if here and isinstance(held.get("pid"), int):
        try:
            os.kill(held["pid"], 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
    return True


def _in_use(uri: str, key: str, path: str, held: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(held.get("started", 0)))
    change = "name or output_dir" if key == "output_dir" else "checkpoint.uri"
    return (f"{key} {uri!r} is in use by the run {held.get('name')!r} (Ray namespace {held.get('namespace')!r}, "
            f"pid {held.get('pid')} on {held.get('host')}, started {since}): two runs writing one directory "
            f"overwrite each other's metrics and checkpoints. Give this run another {change}, or wait for that "
            f"one to end; if it is no longer running, delete {path}")


def _read(fs: pafs.FileSystem, path: str) -> Optional[dict]:
    try:
        with fs.open_input_stream(path) as f:
            held = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable (half-written by a crash): treated as a claim whose owner is unknown
    return held if isinstance(held, dict) else {}


def _encode(info: dict) -> bytes:
    return json.dumps(info, sort_keys=True).encode()
