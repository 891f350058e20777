"""Fault injection for tests and the recovery benchmark: SIGKILL a named worker at a given step."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Optional

import ray


class WorkerKiller(threading.Thread):
    """Watches actor `name` and SIGKILLs its process once it has completed `at_step` steps.

    Only for a cluster on this machine: the pid is signalled locally.
    """

    def __init__(self, name: str, at_step: int, namespace: str = "elixir_ray", timeout_s: float = 120.0):
        super().__init__(daemon=True, name=f"kill-{name}")
        self.name_, self.at_step, self.namespace, self.timeout_s = name, at_step, namespace, timeout_s
        self.killed_at: Optional[float] = None
        self.killed_step: Optional[int] = None

    def run(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            try:
                actor = ray.get_actor(self.name_, namespace=self.namespace)
                step = ray.get(actor.current_step.remote(), timeout=5)
                if step >= self.at_step:
                    pid = ray.get(actor.node_info.remote(), timeout=5)["pid"]
                    self.killed_step, self.killed_at = step, time.time()
                    os.kill(pid, signal.SIGKILL)
                    return
            except (ValueError, ray.exceptions.RayError):  # not started yet, or being replaced
                pass
            time.sleep(0.02)
