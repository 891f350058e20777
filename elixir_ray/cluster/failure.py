"""What counts as a worker-group failure, and what to do about it (the policy, apart from the mechanism)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Optional, Sequence


class FailureKind(enum.Enum):
    """How the group failed: only a raised error can be the run's own fault, repeated on every try."""

    DIED = "died"  # a worker's process (or its node) is gone
    RAISED = "raised"  # a worker raised an exception
    SILENT = "silent"  # a worker stopped answering, or no step completed in time
    OTHER = "other"  # the ranks disagreed, or the workers could not be placed or joined


# Words of the errors a rank's collective raises when a peer died, hung or cannot be reached: the
# rank that raises one is a survivor, and its line (a gloo timeout has no address in it) says
# nothing about the run's own inputs.
PEER_ERROR_MARKERS = ("gloo", "nccl", "timed out", "connection reset", "connection closed", "connection refused",
                      "broken pipe", "watchdog", "process group")


def is_peer_error(exc: BaseException) -> bool:
    try:
        from torch.distributed import DistError
    except ImportError:  # a torch built without distributed
        DistError = ()  # noqa: N806
    text = str(exc).lower()
    return isinstance(exc, DistError) or any(marker in text for marker in PEER_ERROR_MARKERS)


def error_line(exc: BaseException) -> str:
    """An exception's type and the first line of its message: what two tries compare. Empty for a
    collective's error, which never counts as the run's own."""
    if is_peer_error(exc):
        return ""
    lines = str(exc).splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


class StepError(RuntimeError):
    """A rank's training step raised. It keeps the error apart from the rank that surfaced it and
    from the traceback, so that the same error is recognised whichever rank reports it first."""

    def __init__(self, rank: int, step: int, message: str, error: str, trace: str):
        super().__init__(rank, step, message, error, trace)  # args: how a pickled exception is rebuilt
        self.rank, self.step, self.message, self.trace = rank, step, message, trace
        self.error = error  # error_line() of the exception the step raised ("" for a collective's)

    def __str__(self) -> str:
        head = f"rank {self.rank} failed at step {self.step}: {self.message}"
        return f"{head}\n{self.trace}" if self.trace else head


class WorkerGroupFailure(Exception):
    """A rank died, raised, or went silent; the whole group is rebuilt from a checkpoint."""

    def __init__(self, phase: str, reason: str, kind: FailureKind = FailureKind.OTHER, error: str = ""):
        super().__init__(f"{reason} (while {phase})")
        self.phase, self.reason, self.kind = phase, reason, kind
        self.error = error  # for RAISED: error_line() of what the worker raised ("" never counts as a repeat)
        # the last step trained before it failed: the raising rank's own for a step's error, else
        # the last step the driver saw (set by the controller)
        self.step: Optional[int] = None

    def repeats(self, earlier: "WorkerGroupFailure") -> bool:
        """The same error raised in the same phase with no step trained in between: a restart from a
        checkpoint replays the same inputs, so a third try would fail the same way."""
        return (self.kind is FailureKind.RAISED and earlier.kind is FailureKind.RAISED and bool(self.error)
                and (self.phase, self.error, self.step) == (earlier.phase, earlier.error, earlier.step))


class Decision(enum.Enum):
    RESTART = "restart"
    FAIL = "fail"  # the restart budget is spent
    FAIL_REPEATED = "fail_repeated"  # the run's own error, raised again after a restart


@dataclass
class RestartPolicy:
    """Restart after a worker-group failure until max_restarts restarts have been spent, except
    that an error raised again, the same way at the same step, ends the run at once: lost workers
    and flaky links are what restarts are for, and they do not fail identically twice in a row,
    while a bad config or a model that cannot run at this size does, on every try."""

    max_restarts: int

    def decide(self, failure: WorkerGroupFailure, earlier: Sequence[WorkerGroupFailure]) -> Decision:
        if earlier and failure.repeats(earlier[-1]):
            return Decision.FAIL_REPEATED
        if len(earlier) >= self.max_restarts:
            return Decision.FAIL
        return Decision.RESTART


# a predicted step within this share of fault.detect_timeout_s gets a warning: steps on the H100 have
# run up to 1.65 times the prediction made at the run (2026-11-27; 1.03 to 1.09 re-costed by the
# cost model in use), more on a busy CPU, and a step that outlasts the timeout is taken for a hung rank
STEP_WARN_SHARE = 1 / 3


def step_against_timeout(predicted_step_s: float, detect_timeout_s: float,
                         where: str = "") -> tuple[Optional[str], Optional[str]]:
    """(error, warning) for a run whose plan predicts `predicted_step_s` a step (all its
    micro-steps) while the driver takes `detect_timeout_s` without a finished step for a hung
    rank. A step predicted to outlast the timeout would fail every try the same way, spending the
    restarts on a healthy run: that is an error to stop at before training, with the settings that
    fix it. `where`: how the plan was made, when not at the run's start (" for 2 worker(s) after a
    restart (before it, 4)"), for the messages."""
    if not predicted_step_s or not predicted_step_s > 0:
        return None, None
    enough = math.ceil(3 * predicted_step_s)
    if predicted_step_s >= detect_timeout_s:
        return (f"the plan{where} predicts {predicted_step_s:,.1f} s a step, and fault.detect_timeout_s is "
                f"{detect_timeout_s:g} s: every step would be taken for a hung worker. Set fault.detect_timeout_s "
                f"to at least {enough} (three steps), or make the step shorter (fewer micro-steps, "
                f"train.grad_accum; a smaller train.micro_batch or model.seq_len; more workers)"), None
    if predicted_step_s >= STEP_WARN_SHARE * detect_timeout_s:
        return None, (f"the plan{where} predicts {predicted_step_s:,.1f} s a step, over a third of "
                      f"fault.detect_timeout_s ({detect_timeout_s:g} s): a step slower than predicted would be "
                      f"taken for a hung worker and restart the run; consider fault.detect_timeout_s={enough}")
    return None, None
