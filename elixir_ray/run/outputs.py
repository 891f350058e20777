"""What a run writes and reports: its metrics (Parquet, written while it trains and at its end), its
plan (`plan.json`), and the `Result` whose summary the command prints."""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import time
from dataclasses import dataclass
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq

from elixir_ray import storage
from elixir_ray.config import RunConfig
from elixir_ray.run.resolved import ResolvedRun
from elixir_ray.run_plan import RunPlan

log = logging.getLogger("elixir_ray")


@dataclass
class Result:
    metrics: pa.Table
    checkpoint_uri: Optional[str]  # the newest committed checkpoint; None if none could be written
    plan: Optional[RunPlan]  # None only for a run stopped before it planned
    run_dir: str
    metrics_uri: str
    seconds: float
    restarts: list = dataclasses.field(default_factory=list)  # RestartRecord per recovery
    persist_errors: list = dataclasses.field(default_factory=list)
    snapshot_stalls: list = dataclasses.field(default_factory=list)
    checkpoint_via: str = ""  # "object_store" or "storage" (checkpoint.via, resolved)
    final_step: int = 0  # the last step trained
    checkpoint_step: Optional[int] = None  # the step checkpoint_uri holds
    start_step: int = 0  # the --resume checkpoint's step (the metrics hold the steps before it too)
    config: Optional[RunConfig] = None  # the config the run used, overrides applied (what a sweep compares)
    placements: list = dataclasses.field(default_factory=list)  # controller.Placement per group placed
    restores: list = dataclasses.field(default_factory=list)  # controller.RestoreRecord per restore
    plans: list = dataclasses.field(default_factory=list)  # every plan trained with (an elastic run's several)
    stopped: bool = False  # ended on request (`run.stop()`, a sweep's scheduler) before train.steps

    @property
    def final_loss(self) -> Optional[float]:
        """The training loss of the last step (None when no step ran)."""
        losses = self.metrics.column("loss").to_pylist() if self.metrics.num_rows else []
        return losses[-1] if losses else None

    @property
    def final_eval_loss(self) -> Optional[float]:
        """The held-out loss of the last evaluation (None without `eval.path`)."""
        if "eval_loss" not in self.metrics.column_names:
            return None
        values = [v for v in self.metrics.column("eval_loss").to_pylist() if v is not None]
        return values[-1] if values else None

    @property
    def final_checkpoint_written(self) -> bool:
        """Whether the state after the last step was persisted (a failed write leaves an older one)."""
        return self.checkpoint_uri is not None and self.checkpoint_step == self.final_step

    def summary(self) -> str:
        losses = self.metrics.column("loss").to_pylist()
        steps = self.final_step - self.start_step
        resumed = f", resumed from step {self.start_step}" if self.start_step else ""
        ended = f"run stopped on request at step {self.final_step}:" if self.stopped else "run finished:"
        where = (f"on {self.plan.world_size} worker(s) ({self.plan.strategy}, {self.plan.dtype}{resumed})"
                 if self.plan is not None else "before its plan was made")
        return "\n".join([
            f"{ended} {steps} steps in {self.seconds:.1f}s {where}",
            f"loss: first {losses[0]:.4f} -> last {losses[-1]:.4f}" if losses else "loss: no steps",
            *_eval_line(self.metrics),
            *_step_time_line(self.metrics, getattr(self.plan, "predicted_step_seconds", 0.0), self.start_step,
                             _plan_device(self.plan)),
            *(f"restart: {r.reason}; " + (f"restored step {r.restored_step} from {r.restored_from} on "
                                          f"{r.world_size} worker(s)" if r.restored_from
                                          else "failed again before its restore") for r in self.restarts),
            *(f"warning: {e}" for e in self.persist_errors),
            f"metrics:    {shown(self.metrics_uri)}",
            f"checkpoint: {_checkpoint_line(self)}",
            *([f"plan:       {shown(os.path.join(self.run_dir, 'plan.json'))}"] if self.plan is not None else []),
        ])


def shown(uri: str) -> str:
    """A local path in full (a job's working directory is not where it was submitted from)."""
    return uri if "://" in uri else os.path.abspath(uri)


def _checkpoint_line(result: Result) -> str:
    via = {"storage": " (written by the workers)", "object_store": ""}.get(result.checkpoint_via, "")
    if result.checkpoint_uri is None:
        return "none written" + (" (see the warnings above)" if result.persist_errors else "")
    if not result.final_checkpoint_written:
        return (f"{shown(result.checkpoint_uri)} is step {result.checkpoint_step}, NOT the final step "
                f"{result.final_step}: its checkpoint could not be written (see the warnings above)")
    return f"{shown(result.checkpoint_uri)}{via}"


def _plan_device(plan) -> str:
    """The device type the run's engine plan was made for ("cpu", "cuda"), or "" when unknown."""
    engine = getattr(plan, "engine", None) or {}
    return str((engine.get("hardware") or {}).get("device", "")).split(":")[0]


def _step_time_line(metrics, predicted: float, start_step: int = 0, device: str = "") -> list[str]:
    """The run's step time beside its plan's prediction: whether the automatic plan held on this
    machine (the rates it was searched with are a short profile's). This run's steps only (a
    resumed run's metrics hold the steps before it too, with another plan), and the first, which
    also builds and warms up, left out where there are others; a median, so that the first steps
    after a restart do not move it much."""
    if not metrics.num_rows or "step_seconds" not in metrics.column_names:
        return []
    steps, times = metrics.column("step").to_pylist(), metrics.column("step_seconds").to_pylist()
    seconds = [t for step, t in zip(steps, times) if step > start_step and t]
    if not seconds:
        return []
    steady = seconds[1:] if len(seconds) > 1 else seconds
    median = statistics.median(steady)
    line = (f"step time: median {median:.3f}s over {len(steady)} step(s)"
            + (" after the first" if len(seconds) > 1 else ""))
    if predicted and predicted > 0:
        line += f"; the plan predicted {predicted:.3f}s (measured {median / predicted:.2f}x)"
        if device == "cpu" and median > 1.3 * predicted:
            line += (" (on a CPU the model leaves out the engine's per-chunk Python work, much of a small "
                     "model's step: docs/planner.md, \"Limits, honestly\")")
    return [line]


def _eval_line(metrics) -> list[str]:
    """The held-out loss at the first and last evaluation, if the run evaluated."""
    if "eval_loss" not in metrics.column_names:
        return []
    rows = [(s, v) for s, v in zip(metrics.column("step").to_pylist(), metrics.column("eval_loss").to_pylist())
            if v is not None]
    if not rows:
        return []
    (s0, v0), (s1, v1) = rows[0], rows[-1]
    if len(rows) == 1:
        return [f"eval loss: step {s0} {v0:.4f}"]
    return [f"eval loss: step {s0} {v0:.4f} -> step {s1} {v1:.4f} ({len(rows)} evaluations)"]


SCHEMA = pa.schema([
    ("step", pa.int64()), ("loss", pa.float64()), ("lr", pa.float64()), ("grad_norm", pa.float64()),
    ("tokens", pa.int64()), ("step_seconds", pa.float64()), ("tokens_per_s", pa.float64()),
    ("samples_consumed", pa.int64()),
    ("eval_loss", pa.float64()),  # null at steps without an evaluation (eval.every_steps)
])


def metrics_table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist([{k: r.get(k) for k in SCHEMA.names} for r in rows], schema=SCHEMA)


def write_metrics(table: pa.Table, uri: str) -> None:
    fs, path = storage.resolve(uri)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    storage.write_bytes_atomic(fs, path, sink.getvalue().to_pybytes())


def read_metrics(uri: str) -> list[dict]:
    """A metrics file's rows ([] where there is none yet)."""
    fs, path = storage.resolve(uri)
    if not storage.exists(fs, path):
        return []
    with fs.open_input_file(path) as f:
        return pq.read_table(f).to_pylist()


def metrics_uri_of(cfg: RunConfig) -> str:
    """Where a run's metrics are written: `metrics.parquet` in its run directory."""
    return os.path.join(cfg.run_dir, "metrics.parquet")


METRICS_SAVE_EVERY_S = 10.0  # how often a run's metrics so far are written while it trains


class MetricsSaver:
    """Writes the run's metrics so far (atomically, the whole table), at most every so often while
    it trains and once more when it stops: a run stopped (`ray job stop`) or failed midway keeps
    the metrics of the steps it trained, not only a run that reaches its end."""

    def __init__(self, uri: str, rows):
        self.uri, self.rows = uri, rows
        self.saved_at = time.monotonic()
        # A save converts only the rows added since the last one (converting every row again costs
        # O(rows so far) per save, O(steps^2) over a long run with frequent checkpoints). The state,
        # replaced whole by each save: the list converted from (a restore replaces it), how many of
        # its rows, the last of them (the same object while the list only grows), the Arrow parts.
        self._state: tuple = (None, 0, None, [])

    def _table(self, source: list) -> pa.Table:
        rows = list(source)  # the rows as of now (the list's owner may append while this converts)
        held, converted, last, parts = self._state
        same = (source is held and len(rows) >= converted
                and (converted == 0 or rows[converted - 1] is last))
        # another list (a restore keeps the rows up to its step), or this one cut back: start over
        converted, parts = (converted, list(parts)) if same else (0, [])
        if len(rows) > converted:
            parts.append(metrics_table(rows[converted:]))
            if len(parts) > 32:  # a handful of record batches, not one per save
                parts = [pa.concat_tables(parts).combine_chunks()]
        # committed in one store: an interrupt (Ctrl-C, SIGTERM) before it leaves the old state whole,
        # and the save the interrupt makes converts the same rows again, once
        self._state = (source, len(rows), rows[-1] if rows else None, parts)
        return pa.concat_tables(parts)

    def save(self, every_s: float = 0.0) -> None:
        if time.monotonic() - self.saved_at < every_s:
            return
        self.saved_at = time.monotonic()
        rows = self.rows()
        if not rows:
            return
        try:
            write_metrics(self._table(rows), self.uri)  # the atomic write makes the run directory
        except Exception as exc:  # never what stops a run: the end of the run writes them again
            log.warning("could not write the metrics so far to %s: %s", self.uri, exc)


def earlier_metrics(cfg: RunConfig) -> list[dict]:
    """The metrics the run directory already holds: the controller keeps those up to the restored
    step when the checkpoint resumed is this run's (its manifest names this run), so a resumed run's
    metrics start at step 1."""
    try:
        return read_metrics(metrics_uri_of(cfg))
    except (OSError, ValueError) as exc:
        log.warning("the run's earlier metrics could not be read (%s): they start at the resumed step", exc)
        return []


def where_to_resume(controller, metrics_uri: str) -> str:
    """What a stopped or failed run kept: its newest checkpoint to resume from (its own, else the one
    it was resumed from), and its metrics. Read from the persister, not the outcome, which is filled
    in after the teardown that a second Ctrl-C can cut short."""
    if controller is None:
        return ""
    metrics = f"\nmetrics so far: {shown(metrics_uri)}" if controller.outcome.metrics else ""
    persister = controller.persister
    if persister is not None and persister.committed:
        step, uri = persister.committed[-1]
        return f"\nthe newest checkpoint is step {step}: continue with --resume {uri}" + metrics
    if controller.resume is not None:  # none of its own yet: the one it started from is still there
        return f"\nno checkpoint written since the start: continue with --resume {controller.resume.uri}" + metrics
    return "\nno checkpoint was written yet: there is nothing to resume from" + metrics if metrics else ""


def after_nonfinite_loss(controller, metrics_uri: str, step: int) -> str:
    """What a run stopped by a non-finite loss at `step` kept, to follow the error on its line: its
    last good checkpoint, the newest whose weights still gave a finite loss. That is one of a step
    before `step - 1`: the checkpoint of step `step - 1` holds the weights that gave the non-finite
    loss. The one it was resumed from counts too."""
    metrics = f"\nmetrics so far: {shown(metrics_uri)}" if controller.outcome.metrics else ""
    persister = controller.persister
    written = list(persister.committed) if persister is not None else []
    if controller.resume is not None:
        written.insert(0, (controller.outcome.start_step, controller.resume.uri))
    good = [(s, uri) for s, uri in written if s < step - 1]
    if good:
        s, uri = good[-1]
        return (f"; the last good checkpoint is step {s}: fix the cause (optim.lr too high?) and continue with "
                f"--resume {uri}") + metrics
    if written:
        return f"; no checkpoint is good: step {written[-1][0]}'s weights gave that loss" + metrics
    return "; no checkpoint was written before it" + metrics


def write_outputs(run: ResolvedRun, outcome, seconds: float) -> Result:
    """The metrics and the plan, written whole at the run's end, and the run's `Result`."""
    cfg = run.config
    run_dir = cfg.run_dir
    fs, run_path = storage.resolve(run_dir)
    fs.create_dir(run_path, recursive=True)
    table = metrics_table(outcome.metrics)
    uri = metrics_uri_of(cfg)
    write_metrics(table, uri)
    if outcome.plan is not None:  # None: stopped before planning
        storage.write_bytes_atomic(fs, f"{run_path}/plan.json", outcome.plan.to_json().encode())
    return Result(metrics=table, checkpoint_uri=outcome.checkpoint_uri, plan=outcome.plan, run_dir=run_dir,
                  metrics_uri=uri, seconds=seconds, restarts=outcome.restarts,
                  persist_errors=outcome.persist_errors, snapshot_stalls=outcome.snapshot_stalls,
                  checkpoint_via=outcome.checkpoint_via, final_step=outcome.final_step,
                  checkpoint_step=outcome.checkpoint_step, start_step=outcome.start_step, config=cfg,
                  placements=outcome.placements, restores=outcome.restores, plans=outcome.plans,
                  stopped=outcome.stopped)
