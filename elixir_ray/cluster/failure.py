"""What counts as a worker-group failure, and what to do about it (the policy, apart from the mechanism)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class WorkerGroupFailure(Exception):
    """A rank died, raised, or went silent; the whole group is rebuilt from a checkpoint."""

    def __init__(self, phase: str, reason: str):
        super().__init__(f"{reason} (while {phase})")
        self.phase, self.reason = phase, reason


class Decision(enum.Enum):
    RESTART = "restart"
    FAIL = "fail"


@dataclass
class RestartPolicy:
    """Restart after any worker-group failure until max_restarts restarts have been spent."""

    max_restarts: int

    def decide(self, failure: WorkerGroupFailure, restarts_so_far: int) -> Decision:
        del failure  # every failure kind costs one restart; a per-kind budget would go here
        return Decision.RESTART if restarts_so_far < self.max_restarts else Decision.FAIL
