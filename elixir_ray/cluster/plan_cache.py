"""Profiles and plans shared by runs of the same shape: the trials of a sweep.

A run's profiling round (every rank measures its copy, AdamW and matmul rates and times the model's
kernels) depends on the model, the micro-batch, the world size and the hardware, not on the
learning rate, the seed or the memory budget. So the first run of a shape writes its profiles and
plan here, under a hash of what they depend on, and a later run of that shape reads them instead
of measuring again. It takes the plan too when its budget is the one the plan was searched for;
with another (a resumed sweep whose budget no longer fits in what is free cuts another) it
searches its own from the profiles. On a local disk the first run also holds a lease on its key
while it measures, and a run of the same shape starting meanwhile waits for its entry rather than
measuring beside it (on one machine the two measurements would also disturb each other). Object stores have
no exclusive create: there concurrent runs may both measure, and the last entry written is kept.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Optional

from elixir_ray import storage
from elixir_ray.cluster.worker_profile import WorkerProfile
from elixir_ray.config import RunConfig
from elixir_ray.run_plan import PLAN_VERSION, RunPlan

log = logging.getLogger("elixir_ray")

# 2: plans searched with resident compute copies (Plan.resident); 3: keys without engine.device_memory.
# An entry of another version is measured again.
CACHE_VERSION = 3
LEASE_POLL_S = 0.5
# How long a run waits for another run's entry: a profiling round of a large model on a GPU takes a
# few minutes; a lease whose holder is gone (another host, SIGKILLed) is given up on after this.
LEASE_WAIT_S = 600.0


def plan_key(cfg: RunConfig, world_size: int, global_batch: int, node_kinds: list[str]) -> str:
    """The hash of what a run's profiles (and, its budget apart, its plan) depend on: the model, the
    batch split, the dtype, the engine's settings but its budget, clipping (whether updates may
    start in the backward), the CPUs each rank has, and the kind of node each rank is on."""
    engine = dataclasses.asdict(cfg.engine)
    del engine["device_memory"]  # the plan records its budget (RunPlan.device_memory_bytes)
    fields = {
        "cache": CACHE_VERSION, "plan": PLAN_VERSION, "model": dataclasses.asdict(cfg.model),
        "micro_batch": cfg.train.micro_batch, "grad_accum": cfg.train.grad_accum, "dtype": cfg.train.dtype,
        "engine": engine, "clips": cfg.optim.max_grad_norm is not None,
        "cpus_per_worker": cfg.cluster.cpus_per_worker, "world_size": world_size, "global_batch": global_batch,
        "nodes": sorted(node_kinds),
    }
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def node_kind(resources: dict) -> str:
    """A node's kind as Ray describes it: its CPUs, GPUs and accelerator type (`accelerator_type:H100`)."""
    accelerators = sorted(k.split(":", 1)[1] for k in resources if k.startswith("accelerator_type:"))
    return f"{resources.get('CPU', 0):g} CPU, {resources.get('GPU', 0):g} GPU {'/'.join(accelerators)}".strip()


@dataclass(frozen=True)
class CachedPlan:
    profiles: list  # WorkerProfile per rank, as the first run measured them
    plan: RunPlan
    source: str  # the name of the run that measured them
    uri: str  # the entry's file


class PlanCache:
    """Entries `<uri>/<key>.json`; `uri` is any path or pyarrow filesystem URI."""

    def __init__(self, uri: str):
        self.uri = uri.rstrip("/")

    def entry_uri(self, key: str) -> str:
        return f"{self.uri}/{key}.json"

    def get(self, key: str) -> Optional[CachedPlan]:
        """The entry for `key`, or None (none yet, or one that does not read: it is measured again)."""
        uri = self.entry_uri(key)
        fs, path = storage.resolve(uri)
        try:
            if not storage.exists(fs, path):
                return None
            with fs.open_input_stream(path) as f:
                data = json.loads(f.read())
            if data.get("version") != CACHE_VERSION:
                return None
            return CachedPlan(profiles=[WorkerProfile(**p) for p in data["profiles"]], plan=RunPlan(**data["plan"]),
                              source=str(data.get("source", "")), uri=uri)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            log.warning("the plan cache entry %s does not read (%s): measuring again", uri, exc)
            return None

    def put(self, key: str, profiles: list, plan: RunPlan, source: str) -> None:
        """Write the entry whole (a temporary file renamed); a failure is logged, never raised."""
        uri = self.entry_uri(key)
        payload = json.dumps({"version": CACHE_VERSION, "source": source, "written": time.time(),
                              "profiles": [p.to_dict() for p in profiles], "plan": plan.to_dict()}, indent=1)
        try:
            fs, path = storage.resolve(uri)
            fs.create_dir(os.path.dirname(path), recursive=True)
            storage.write_bytes_atomic(fs, path, payload.encode())
        except (OSError, ValueError) as exc:
            log.warning("could not write the plan cache entry %s: %s", uri, exc)

    # -- the lease of a key while its first run measures (local disks only) --------------------

    def _lease_path(self, key: str) -> Optional[str]:
        root = storage.local_path(self.uri)
        return None if root is None else os.path.join(root, f"{key}.lease")

    def take_lease(self, key: str, holder: str) -> bool:
        """True when this run is to measure `key` (it then calls `release`): it holds the lease, or
        the cache is on an object store (no leases). False while another live run holds it."""
        path = self._lease_path(key)
        if path is None:
            return True
        os.makedirs(os.path.dirname(path), exist_ok=True)
        for _ in range(2):  # a stale lease is removed once, then taken
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if not self._stale(path):
                    return False
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w") as f:
                json.dump({"holder": holder, "host": socket.gethostname(), "pid": os.getpid(), "at": time.time()}, f)
            return True
        return False

    def release(self, key: str) -> None:
        path = self._lease_path(key)
        if path is not None:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass

    def wait_for(self, key: str, timeout_s: float = LEASE_WAIT_S) -> Optional[CachedPlan]:
        """Another run's entry for `key` once it is written; None when its lease ends without one
        (that run failed), turns stale, or `timeout_s` passes."""
        path = self._lease_path(key)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self.get(key)
            if found is not None:
                return found
            if path is None or not os.path.exists(path) or self._stale(path):
                return self.get(key)
            time.sleep(LEASE_POLL_S)
        return None

    @staticmethod
    def _stale(path: str) -> bool:
        """A lease whose holder is a process of this host that no longer exists (or unreadable)."""
        try:
            with open(path) as f:
                lease = json.load(f)
        except (OSError, ValueError):
            return time.time() - _mtime(path) > LEASE_POLL_S * 4  # written between open and dump, or damaged
        if lease.get("host") != socket.gethostname():
            return False
        try:
            os.kill(int(lease["pid"]), 0)
        except ProcessLookupError:
            return True
        except (PermissionError, KeyError, TypeError, ValueError):
            return False
        return False


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return time.time()
