"""The Ray connection a run uses: `RAY_ADDRESS`'s cluster when set, otherwise an embedded local
cluster started here, shared by the runs of one process and shut down when the last one ends."""

from __future__ import annotations

import os
import threading
from typing import Optional

from elixir_ray.config import RunConfig
from elixir_ray.errors import ClusterError

REACH_TIMEOUT_S = 10.0


def _check_reachable(address: str, hint: str) -> None:
    """A host:port that nothing answers at fails here in seconds: Ray itself retries for minutes."""
    import socket

    host, sep, port = address.rpartition(":")
    if "://" in address or not sep or not port.isdigit():
        return  # "auto", ray:// and the rest: Ray's own message says what is wrong
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_TIMEOUT_S).close()
    except OSError as exc:
        raise ClusterError(f"cannot join the Ray cluster at RAY_ADDRESS={address!r}: nothing answers there "
                           f"({exc.strerror or type(exc).__name__}; {hint})") from None


class RayStartedByTrain:
    """The Ray connection `train()` started in this process, shared by every run in it: runs started
    from threads (a sweep's) join it, and only the last to end shuts it down. Without the count the
    first run to end would shut Ray down under the others (their workers vanish mid-run), and two
    starting at once would race in ray.init. Process-wide by nature, as Ray's own connection is."""

    def __init__(self):
        self.lock = threading.Lock()
        self.runs = 0  # runs using the connection train() started; 0 when it started none
        self.keeper_done: Optional[threading.Event] = None  # ends the thread that started Ray

    def join(self, cfg: RunConfig) -> bool:
        """Connect (or join this process's connection); True if this run must `leave()` at its end."""
        with self.lock:
            if threading.current_thread() is threading.main_thread():
                started = _ensure_ray(cfg)
            else:
                started = self._start_in_a_keeper_thread(cfg)
            if started or self.runs:
                self.runs += 1
                return True
            return False

    def _start_in_a_keeper_thread(self, cfg: RunConfig) -> bool:
        """A local cluster's processes are killed when the thread that started them ends (Ray sets
        the parent-death signal, which follows the starting thread, not the process): started from
        a sweep's thread, it would die with the first run to finish. So a thread of its own starts
        it and lives until the last run leaves."""
        ready, done, outcome = threading.Event(), threading.Event(), {}

        def keep() -> None:
            try:
                outcome["started"] = _ensure_ray(cfg)
            except BaseException as exc:  # raised in the run's thread below
                outcome["error"] = exc
            ready.set()
            if outcome.get("started"):
                done.wait()

        threading.Thread(target=keep, name="elixir-ray-keeper", daemon=True).start()
        ready.wait()
        if "error" in outcome:
            raise outcome["error"]
        if outcome["started"]:
            self.keeper_done = done
        return outcome["started"]

    def leave(self) -> None:
        import ray

        with self.lock:
            self.runs -= 1
            if self.runs == 0:
                ray.shutdown()
                if self.keeper_done is not None:
                    self.keeper_done.set()
                    self.keeper_done = None


RAY_STARTED_BY_TRAIN = RayStartedByTrain()


def _ensure_ray(cfg: RunConfig) -> bool:
    """Connect to RAY_ADDRESS when set; otherwise start an embedded local cluster. True if started here.

    `address="local"` always starts a new cluster: a bare `ray.init()` would join a cluster that
    `ray start` left on this machine instead (and refuse the `num_cpus` given here).
    """
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]
        hint = "give the head's GCS address, host:6379, or unset RAY_ADDRESS for a local cluster"
        _check_reachable(address, hint)
        try:
            ray.init(namespace=cfg.cluster.namespace)
        except (ValueError, ConnectionError) as exc:  # a bad or unreachable address: one line, not a traceback
            text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
            raise ClusterError(f"cannot join the Ray cluster at RAY_ADDRESS={address!r}: {text[:600]} "
                               f"({hint})") from None
    else:
        ray.init(address="local", num_cpus=local_cpus(cfg), include_dashboard=False, namespace=cfg.cluster.namespace)
    return True


def local_cpus(cfg: RunConfig) -> int:
    """The CPUs of the local cluster `train()` starts when RAY_ADDRESS is unset."""
    return cfg.cluster.local_num_cpus or max(2, os.cpu_count() or 2)

