"""`elixir_ray.train(config) -> Result`: the whole run from the driver's side.

The config is resolved once (`resolved.resolve_run`) and checked before Ray is touched
(`preflight`); then the run claims its directories, joins or starts Ray (`embedded_ray`), sizes its
workers against the cluster (or takes the bundles it is given), and hands them to the cluster's
`TrainController`; its metrics, plan and summary are written as it goes and at its end (`outputs`).
`start()` (`handle.py`) runs the same in a thread of its own and returns a handle that stops it.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Union

from elixir_ray.config import RunConfig, check_storage
from elixir_ray.errors import ClusterError, NonFiniteLossError
from elixir_ray.progress import ProgressBar
from elixir_ray.run.auto_resume import AUTO, resolve_auto_resume
from elixir_ray.run.claim import claim_outputs
from elixir_ray.run.embedded_ray import RAY_STARTED_BY_TRAIN
from elixir_ray.run.outputs import (METRICS_SAVE_EVERY_S, MetricsSaver, Result, after_nonfinite_loss, earlier_metrics,
                                    metrics_uri_of, where_to_resume, write_outputs)
from elixir_ray.run.preflight import (check_checkpoint_space, check_data, check_local_cluster_shape,
                                      check_model_step, check_output_dir, check_resume, warn_if_data_under_one_batch,
                                      warn_of_earlier_checkpoints)
from elixir_ray.run.resolved import ResolvedRun, as_config, resolve_run
from elixir_ray.run.schedule import keep_schedule

if TYPE_CHECKING:  # the cluster package imports Ray
    from elixir_ray.cluster.plan_cache import PlanCache
    from elixir_ray.cluster.worker_group import GivenPlacement


@dataclass(frozen=True)
class RunOptions:
    """How one run is driven, besides its config: what `train()` and `start()` hand the controller."""

    progress: bool = True  # the progress bar on stderr
    resume: Optional[str] = None  # a checkpoint, or a directory of them, to continue from
    on_metrics: Optional[Callable[[dict], None]] = None  # each metrics row as it arrives
    worker_group_cls: Optional[type] = None  # the WorkerGroup subclass (fault injection); WorkerGroup when None
    placement: Optional[GivenPlacement] = None  # bundles reserved by the caller (a Ray Tune trial's)
    stop_requested: Optional[threading.Event] = None  # set: end after the step the ranks agree on
    on_checkpoint: Optional[Callable[[int, str], None]] = None  # (step, uri) of each checkpoint committed
    plan_cache: Optional[PlanCache] = None  # profiles and plans shared with runs of the same shape


def train(config: Union[RunConfig, dict, str], overrides: Optional[list[str]] = None, *, progress: bool = True,
          resume: Optional[str] = None, on_metrics: Optional[Callable[[dict], None]] = None,
          worker_group_cls: Optional[type] = None) -> Result:
    """Run training on Ray; `resume` names a checkpoint (or a directory of them) to continue from,
    or is "auto": this run's newest checkpoint if it has one, else a fresh start (said on stderr).
    `on_metrics` gets each metrics row (a dict: step, loss, lr, tokens_per_s, eval_loss...) as it
    arrives, on the calling thread. `worker_group_cls`: the `cluster.worker_group.WorkerGroup`
    subclass that places and watches the ranks (one that injects faults, in tests); WorkerGroup
    itself when None. `elixir_ray.start()` runs the same in the background, stoppable."""
    options = RunOptions(progress=progress, resume=resume, on_metrics=on_metrics, worker_group_cls=worker_group_cls)
    run, claim, options = checked_and_claimed(config, overrides, options)
    try:
        return train_claimed(run, options)
    finally:
        claim.release()


def checked_and_claimed(config: Union[RunConfig, dict, str], overrides: Optional[list[str]], options: RunOptions):
    """The resolved run, checked before Ray is touched, and the claim on its directories. A resume
    of "auto" is resolved here: the options returned name the checkpoint, or none."""
    run = resolve_run(as_config(config, overrides))
    check_storage(run.config)  # each URI's filesystem, before anything opens one
    check_data(run)
    check_model_step(run)
    if options.resume == AUTO:
        resume, line = resolve_auto_resume(run.config)
        print(line, file=sys.stderr, flush=True)
        options = dataclasses.replace(options, resume=resume)
    if options.resume is not None:
        check_resume(run, options.resume)
    check_output_dir(run.config)
    check_checkpoint_space(run)
    if options.placement is None:
        check_local_cluster_shape(run.config)
    if options.resume is not None:
        run = keep_schedule(run, options.resume)
    claim = claim_outputs(run.config)
    if options.resume is None:
        warn_of_earlier_checkpoints(run.config)
    return run, claim, options


def _show_step(bar: ProgressBar, m: dict) -> None:
    bar.update(m["step"], m["loss"], m["tokens_per_s"])
    if m.get("eval_loss") is not None:
        bar.note(f"step {m['step']}: eval loss {m['eval_loss']:.4f}")


def train_claimed(run: ResolvedRun, options: RunOptions) -> Result:
    """The run, once checked and its directories claimed: Ray joined (or started), the controller
    run, the outputs written."""
    import ray

    from elixir_ray.cluster.controller import RestoreSource, TrainController
    from elixir_ray.cluster.worker_group import WorkerGroup

    cfg, resume = run.config, options.resume
    started_here = RAY_STARTED_BY_TRAIN.join(cfg)
    try:
        run = run.placed_in(options.placement) if options.placement else run.sized_for(ray.cluster_resources())
        warn_if_data_under_one_batch(run, run.worker_shape.num_workers)
        bar = ProgressBar(cfg.train.steps, every=cfg.train.log_every) if options.progress else None
        controller = None
        saver = MetricsSaver(metrics_uri_of(cfg), lambda: controller.outcome.metrics if controller else [])

        every = cfg.checkpoint.every_steps

        def on_metrics(m: dict) -> None:
            if bar:
                _show_step(bar, m)
            # at a checkpoint's step at once: a run resumed from it (after its driver was killed) then
            # finds every step before the checkpoint in the metrics on disk
            at_checkpoint = bool(every) and m["step"] % every == 0
            saver.save(every_s=0.0 if at_checkpoint else METRICS_SAVE_EVERY_S)
            if options.on_metrics is not None:
                plan = controller.outcome.plan
                options.on_metrics({**m, "predicted_step_seconds": plan.predicted_step_seconds if plan else None})

        start = time.monotonic()
        on_note = bar.note if bar else (lambda text: None)
        controller = TrainController(cfg, run.worker_shape, on_metrics=on_metrics, on_note=on_note,
                                     resume=RestoreSource(resume) if resume else None,
                                     worker_group_cls=options.worker_group_cls or WorkerGroup,
                                     placement=options.placement, stop_requested=options.stop_requested,
                                     on_checkpoint=options.on_checkpoint or (lambda step, uri: None),
                                     plan_cache=options.plan_cache)
        if resume is not None:  # the steps before the checkpoint, as the run that wrote it logged them
            controller.outcome.metrics = earlier_metrics(cfg)
        try:
            outcome = controller.run()
        except BaseException as exc:  # SIGTERM too (`ray job stop`): Ray's driver turns it into SystemExit
            if bar:
                bar.close()  # the lines below start on a line of their own, not after the bar's
            saver.save()  # a run stopped or failed midway keeps the metrics of what it trained
            if isinstance(exc, NonFiniteLossError):
                raise ClusterError(f"{exc}{after_nonfinite_loss(controller, saver.uri, exc.step)}") from exc
            if isinstance(exc, ClusterError):
                raise ClusterError(f"{exc}{where_to_resume(controller, saver.uri)}") from exc
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):  # Ctrl-C, `ray job stop`
                where = where_to_resume(controller, saver.uri)
                if where:
                    print(f"run stopped ({type(exc).__name__}){where}", file=sys.stderr, flush=True)
            raise
        if bar:
            bar.close()
        seconds = time.monotonic() - start
        return write_outputs(run, outcome, seconds)
    finally:
        # the controller and the metrics callbacks refer to each other: without this the cycle (and
        # what the controller holds in the object store) lives on until the next garbage collection
        controller = None  # noqa: F841
        if started_here:
            RAY_STARTED_BY_TRAIN.leave()
