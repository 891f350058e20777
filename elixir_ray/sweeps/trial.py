"""One trial of a sweep: a Ray Tune function trainable that runs the project's own controller.

Tune reserves the trial's placement group (`packing.TrialResources.bundles`: the driver's bundle,
then one per rank) and starts `run_trial` inside it. The trial starts its run with `start()`,
placing the ranks into the rank bundles (`GivenPlacement`), and reports every metrics row to Tune
as it arrives. Its checkpoints are the run's own, in `<sweep>/<trial>/checkpoints`; Tune is given
a small pointer to each (`POINTER_FILE`), so that Tune's trial state (PBT's exploit, a restored
sweep) names the project's checkpoint without a copy of it.

A scheduler's stop reaches the trial as Tune's `stop` call on its actor, whose `cleanup` a
function trainable runs without waiting for the function; `StopsItsRun` (mixed into the trainable)
first stops the run (the step the ranks agree on, its checkpoint, the workers killed) and only
then lets Tune tear the trial down. A worker lost inside the trial is the controller's to restore,
as in any run: Tune sees no failure. A trial whose run fails as a whole fails with its one-line
error, and the sweep goes on.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from elixir_ray import storage
from elixir_ray.checkpoint import CheckpointError, list_checkpoints, read_manifest

log = logging.getLogger("elixir_ray")

POINTER_FILE = "elixir_ray_checkpoint.json"  # what Tune's checkpoint of a trial holds: {"uri", "step", "trial"}
TRIAL_LOG = "trial.log"  # <sweep>/<trial>/trial.log: what the trial did (reused plans, restarts, its stop)
TRIAL_SUMMARY = "trial.json"  # <sweep>/<trial>/trial.json: how it ended, for the sweep's results
STOP_TIMEOUT_S = 60.0  # how long Tune's stop waits for the run's last checkpoint (a tiny model's takes ~1 s)
CHECKPOINT_WAIT_S = 30.0  # how long a checkpoint step's row waits for its checkpoint before it is reported


@dataclass(frozen=True)
class TrialSetup:
    """What every trial of a sweep shares (given to the trainable with `tune.with_parameters`)."""

    spec: Any  # the sweep's `spec.SweepSpec`
    num_workers: int
    device_memory: Optional[int]  # each rank's budget when trials are packed (trials_per_gpu > 1)
    checkpoint_every: int  # checkpoint.every_steps of every trial

    @property
    def plan_cache_uri(self) -> str:
        return f"{self.spec.sweep_dir}/plan_cache"


class TrialRuns:
    """The run of each trial in this process, by trial id: `cleanup` runs on the actor's main
    thread and the function on a thread of Tune's, and Tune hands the function no object of the
    trainable's. One trial per actor process (actors are not reused), so it holds at most one."""

    def __init__(self):
        self._lock = threading.Lock()
        self._runs: dict[str, Any] = {}

    def add(self, trial_id: str, run) -> None:
        with self._lock:
            self._runs[trial_id] = run

    def get(self, trial_id: str):
        with self._lock:
            return self._runs.get(trial_id)

    def pop(self, trial_id: str) -> None:
        with self._lock:
            self._runs.pop(trial_id, None)


TRIAL_RUNS = TrialRuns()


class StopsItsRun:
    """Mixed into the trial's Tune trainable: Tune's stop (a scheduler's decision, the end of the
    sweep) stops the run and waits for its checkpoint before the trainable's own cleanup."""

    def cleanup(self):
        run = TRIAL_RUNS.get(self.trial_id)
        if run is not None:
            asked = time.time()
            try:
                result = run.stop(timeout=STOP_TIMEOUT_S)
            except BaseException as exc:  # the run's own failure: the function reports it
                log.warning("trial %s: its run ended with %s", self.trial_id, _first_line(exc))
                result = None
            if result is None and not run.done():
                log.warning("trial %s: its run did not stop within %gs", self.trial_id, STOP_TIMEOUT_S)
            elif result is not None and result.stopped:  # else it had trained every step already
                log.info("trial %s: Ray Tune stopped it; the run stopped at step %d and its workers were killed "
                         "in %.2fs", self.trial_id, result.final_step, time.time() - asked)
                _write_summary(run, self.trial_id, stop_requested_at=asked, stopped_at=time.time())
        super().cleanup()


def run_trial(config: dict, setup: TrialSetup) -> None:
    """The function Tune runs for each trial (`config`: the sampled values, by dotted key)."""
    from ray import tune
    from ray.util.placement_group import get_current_placement_group

    from elixir_ray.cluster.plan_cache import PlanCache
    from elixir_ray.cluster.worker_group import GivenPlacement
    from elixir_ray.run.handle import start
    from elixir_ray.sweeps.spec import trial_config

    trial_id = tune.get_context().get_trial_id()
    cfg = trial_config(setup.spec, config, trial_id, num_workers=setup.num_workers,
                       device_memory=setup.device_memory, checkpoint_every=setup.checkpoint_every)
    with _trial_log(cfg.run_dir):
        log.info("trial %s: %s", trial_id, ", ".join(f"{k}={v}" for k, v in config.items()))
        resume = resume_point(cfg, tune.get_checkpoint(), trial_id)
        if resume is not None and resume[1] >= cfg.train.steps:  # finished before the sweep's driver was lost
            log.info("trial %s: already trained %d step(s) (%s): not run again", trial_id, resume[1], resume[0])
            _report_finished(cfg, resume)
            return
        group = get_current_placement_group()
        first = group.bundle_count - setup.num_workers  # an empty driver bundle is dropped from the group
        placement = GivenPlacement(group, tuple(range(first, group.bundle_count)))
        events: queue.Queue = queue.Queue()
        run = start(cfg, progress=False, resume=resume[0] if resume else None,
                    on_metrics=lambda row: events.put(("row", row)),
                    on_checkpoint=lambda step, uri: events.put(("checkpoint", step, uri)),
                    placement=placement, plan_cache=PlanCache(setup.plan_cache_uri))
        TRIAL_RUNS.add(trial_id, run)
        try:
            _report_rows(run, events, cfg, trial_id)
            _write_summary(run, trial_id)
            result = run.result()  # a run that failed fails the trial, with its error
            log.info("trial %s: %s", trial_id, result.summary().splitlines()[0])
        finally:
            TRIAL_RUNS.pop(trial_id)


run_trial.__mixins__ = (StopsItsRun,)  # Tune builds the trainable class from the function with these first


def _report_rows(run, events: queue.Queue, cfg, trial_id: str) -> None:
    """Every metrics row to Tune as it arrives. A row at a checkpoint step waits (a moment) for that
    checkpoint, so that it reaches Tune with it; each new checkpoint goes with the next row."""
    from ray import tune

    every, total = cfg.checkpoint.every_steps, cfg.train.steps
    rows: list[dict] = []
    newest: Optional[tuple[int, str]] = None
    registered: Optional[tuple[int, str]] = None
    waiting_since: Optional[float] = None
    while True:
        if rows or not run.done() or not events.empty():
            try:
                event = events.get(timeout=0.2 if not rows else 0.05)
                if event[0] == "row":
                    rows.append(event[1])
                else:
                    newest = (event[1], event[2])
                continue
            except queue.Empty:
                pass
        if not rows:
            if run.done() and events.empty():
                return
            continue
        row = rows[0]
        at_checkpoint = (every and row["step"] % every == 0) or row["step"] == total
        if at_checkpoint and (newest is None or newest[0] < row["step"]) and not run.done():
            waiting_since = waiting_since or time.monotonic()
            if time.monotonic() - waiting_since < CHECKPOINT_WAIT_S:
                continue
        waiting_since = None
        rows.pop(0)
        pointer = newest if newest is not None and newest != registered else None
        _report(tune, row, pointer, trial_id)
        registered = newest if pointer else registered


def _report(tune, row: dict, pointer: Optional[tuple[int, str]], trial_id: str) -> None:
    metrics = {k: float(v) if isinstance(v, float) else v for k, v in row.items() if v is not None}
    if pointer is None:
        tune.report(metrics)
        return
    folder = tempfile.mkdtemp(prefix="elixir_ray-pointer-")
    try:
        with open(os.path.join(folder, POINTER_FILE), "w") as f:
            json.dump({"uri": pointer[1], "step": pointer[0], "trial": trial_id}, f)
        tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(folder))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def read_pointer(checkpoint) -> Optional[dict]:
    """The project checkpoint a Tune checkpoint of a trial points to, or None."""
    if checkpoint is None:
        return None
    try:
        with checkpoint.as_directory() as folder:
            with open(os.path.join(folder, POINTER_FILE)) as f:
                return json.load(f)
    except (OSError, ValueError) as exc:
        log.warning("Ray Tune's checkpoint %s does not name a checkpoint of this project (%s)", checkpoint, exc)
        return None


def resume_point(cfg, tune_checkpoint, trial_id: str) -> Optional[tuple[str, int]]:
    """(checkpoint to continue from, its step), or None to start afresh. Tune's checkpoint names
    another trial's after a Population Based Training exploit: that one (or, if that trial pruned
    it since, its newest). Otherwise the trial's own newest, which is never older than the one
    Tune last recorded (a sweep resumed after its driver was lost continues from there)."""
    pointer = read_pointer(tune_checkpoint)
    if pointer is not None and pointer.get("trial") != trial_id:
        found = _step_of(pointer["uri"]) or newest_checkpoint(os.path.dirname(pointer["uri"].rstrip("/")))
        if found is not None:
            log.info("trial %s: continues from trial %s's checkpoint %s (exploited by Population Based Training)",
                     trial_id, pointer.get("trial"), found[0])
            return found
        log.warning("trial %s: the checkpoint %s it was given is gone: starting afresh", trial_id, pointer["uri"])
    own = newest_checkpoint(cfg.checkpoint_uri)
    if own is not None:
        log.info("trial %s: continues from its own newest checkpoint %s (step %d)", trial_id, own[0], own[1])
    return own


def _step_of(path: str) -> Optional[tuple[str, int]]:
    try:
        return path, int(read_manifest(path)["step"])
    except (CheckpointError, OSError, KeyError, ValueError, TypeError):
        return None


def newest_checkpoint(directory: str) -> Optional[tuple[str, int]]:
    """The newest checkpoint in `directory` whose manifest reads (the restore verifies its files)."""
    try:
        paths = list_checkpoints(directory)
    except (CheckpointError, OSError):
        return None
    for path in reversed(paths):
        found = _step_of(path)
        if found is not None:
            return found
    return None


def _report_finished(cfg, resume: tuple[str, int]) -> None:
    """A trial whose run had finished when the sweep's driver was lost, and Tune's state from before
    that does not say so: its last row, with its checkpoint, tells Tune it is done."""
    from ray import tune

    from elixir_ray.run.outputs import metrics_uri_of, read_metrics

    rows = read_metrics(metrics_uri_of(cfg))
    last = rows[-1] if rows else {"step": resume[1]}
    _report(tune, last, (resume[1], resume[0]), cfg.name)


def _write_summary(run, trial_id: str, *, stop_requested_at: Optional[float] = None,
                   stopped_at: Optional[float] = None) -> None:
    """`trial.json` beside the trial's metrics: how its run ended, read by the sweep's results."""
    try:
        result = run.result(timeout=0)
        summary = {"trial": trial_id, "status": "stopped" if result.stopped else "finished",
                   "final_step": result.final_step, "checkpoint_uri": result.checkpoint_uri,
                   "checkpoint_step": result.checkpoint_step, "restarts": len(result.restarts), "error": None}
    except TimeoutError:
        summary = {"trial": trial_id, "status": "stopping", "error": None}
    except BaseException as exc:
        summary = {"trial": trial_id, "status": "error", "error": _first_line(exc)}
    if stop_requested_at is not None:
        summary.update(stop_requested_at=stop_requested_at, stopped_at=stopped_at,
                       stop_seconds=stopped_at - stop_requested_at)
    try:
        fs, path = storage.resolve(f"{run.config.run_dir}/{TRIAL_SUMMARY}")
        storage.write_bytes_atomic(fs, path, json.dumps(summary, indent=1).encode())
    except (OSError, ValueError) as exc:
        log.warning("trial %s: could not write %s: %s", trial_id, TRIAL_SUMMARY, exc)


class _trial_log:
    """The `elixir_ray` log of this trial at INFO into `<run_dir>/trial.log` (a local run directory
    only): reused plans, restarts, its stop. The records still reach the process's own handlers."""

    def __init__(self, run_dir: str):
        self.path = None
        local = storage.local_path(run_dir)
        if local is not None:
            os.makedirs(local, exist_ok=True)
            self.path = os.path.join(local, TRIAL_LOG)
        self.handler: Optional[logging.Handler] = None
        self.level = log.level

    def __enter__(self):
        if self.path is not None:
            self.handler = logging.FileHandler(self.path)
            self.handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
            self.handler.setLevel(logging.INFO)
            log.addHandler(self.handler)
            if log.getEffectiveLevel() > logging.INFO:
                log.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc):
        if self.handler is not None:
            log.removeHandler(self.handler)
            self.handler.close()
        log.setLevel(self.level)
        return False


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
