"""RunClaim: one run at a time writes a run directory, and a checkpoint directory.

Two runs given the same outputs (one name and output_dir under two Ray namespaces, or one
`checkpoint.uri` shared by two names) overwrote each other's metrics and checkpoints without a
word, and each Result named the other's checkpoint. So a run claims each directory it writes with
a small file naming it, and a run that finds a live claim is refused before it starts. A claimant
is gone when, on this host, its process no longer exists, or, from another host, its heartbeat
(rewritten every HEARTBEAT_S while it runs) is older than STALE_S: a driver killed outright
leaves its claim behind, and the next run takes it over.
"""

from __future__ import annotations

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

log = logging.getLogger("elixir_ray")


@dataclass
class RunClaim:
    info: dict  # token, name, namespace, host, pid, started, heartbeat
    paths: list[tuple[pafs.FileSystem, str]] = field(default_factory=list)  # claim files written
    stop: threading.Event = field(default_factory=threading.Event)

    def beat(self) -> None:
        """Rewrite the claims with a fresh heartbeat (one taken over by another run is left to it)."""
        self.info["heartbeat"] = time.time()
        for fs, path in self.paths:
            try:
                if (_read(fs, path) or {}).get("token") == self.info["token"]:
                    storage.write_bytes_atomic(fs, path, _encode(self.info))
            except OSError as exc:  # a heartbeat missed is not what stops a run
                log.warning("could not refresh the run's claim %s: %s", path, exc)

    def release(self) -> None:
        self.stop.set()
        for fs, path in self.paths:
            try:
                if (_read(fs, path) or {}).get("token") == self.info["token"]:
                    fs.delete_file(path)
            except OSError as exc:
                log.warning("could not remove the run's claim %s: %s", path, exc)
        self.paths = []


def claim_outputs(cfg: RunConfig) -> RunClaim:
    """Claim the run directory and (when outside it) the checkpoint directory, or raise a
    ConfigError naming the live run that holds one and what to change."""
    now = time.time()
    claim = RunClaim(info={"token": uuid.uuid4().hex, "name": cfg.name, "namespace": cfg.cluster.namespace,
                           "host": socket.gethostname(), "pid": os.getpid(), "started": now, "heartbeat": now})
    targets = [(cfg.run_dir, "output_dir")]
    run_root = storage.resolve(cfg.run_dir)[1].rstrip("/")
    if not storage.resolve(cfg.checkpoint_uri)[1].startswith(run_root + "/"):
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
    held = _read(fs, path)
    if held is not None and _alive(held):
        raise ConfigError(_in_use(uri, key, path, held))
    if held is not None:
        log.warning("%s %s was claimed by run %r (pid %s on %s), which is gone: this run takes it over",
                    key, uri, held.get("name"), held.get("pid"), held.get("host"))
    local = isinstance(fs, pafs.LocalFileSystem)
    if local and held is None:
        try:  # created only if absent: of two runs starting at once, one wins
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            raise ConfigError(_in_use(uri, key, path, _read(fs, path) or {})) from None
        with os.fdopen(fd, "wb") as out:
            out.write(_encode(info))
    else:
        storage.write_bytes_atomic(fs, path, _encode(info))
        mine = _read(fs, path) or {}
        if mine.get("token") != info["token"]:  # another run wrote its claim in between
            raise ConfigError(_in_use(uri, key, path, mine))
    return fs, path


def _alive(held: dict) -> bool:
    if held.get("host") == socket.gethostname() and isinstance(held.get("pid"), int):
        try:
            os.kill(held["pid"], 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    heartbeat = held.get("heartbeat")
    return isinstance(heartbeat, (int, float)) and time.time() - heartbeat < STALE_S


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
