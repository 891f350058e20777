"""`elixir_ray.train(config) -> Result`: the whole run from the driver's side.

The config is resolved once (`resolved.resolve_run`) and checked before Ray is touched
(`preflight`); then the run claims its directories, joins or starts Ray (`embedded_ray`), sizes its
workers against the cluster, and hands them to the cluster's `TrainController`; its metrics, plan
and summary are written as it goes and at its end (`outputs`).
"""

from __future__ import annotations

import sys
import time
from typing import Optional, Union

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


def train(config: Union[RunConfig, dict, str], overrides: Optional[list[str]] = None,
          progress: bool = True, resume: Optional[str] = None, *, worker_group_cls: Optional[type] = None) -> Result:
    """Run training on Ray; `resume` names a checkpoint (or a directory of them) to continue from,
    or is "auto": this run's newest checkpoint if it has one, else a fresh start (said on stderr).
    `worker_group_cls`: the `cluster.worker_group.WorkerGroup` subclass that places and watches the
    ranks (one that injects faults, in tests); WorkerGroup itself when None."""
    run = resolve_run(as_config(config, overrides))
    check_storage(run.config)  # each URI's filesystem, before anything opens one
    check_data(run)
    check_model_step(run)
    if resume == AUTO:
        resume, line = resolve_auto_resume(run.config)
        print(line, file=sys.stderr, flush=True)
    if resume is not None:
        check_resume(run, resume)
    check_output_dir(run.config)
    check_checkpoint_space(run)
    check_local_cluster_shape(run.config)
    claim = claim_outputs(run.config)
    if resume is None:
        warn_of_earlier_checkpoints(run.config)
    try:
        return _train_claimed(run, progress, resume, worker_group_cls)
    finally:
        claim.release()


def _show_step(bar: ProgressBar, m: dict) -> None:
    bar.update(m["step"], m["loss"], m["tokens_per_s"])
    if m.get("eval_loss") is not None:
        bar.note(f"step {m['step']}: eval loss {m['eval_loss']:.4f}")


def _train_claimed(run: ResolvedRun, progress: bool, resume: Optional[str], worker_group_cls: Optional[type]) -> Result:
    import ray

    from elixir_ray.cluster.controller import RestoreSource, TrainController
    from elixir_ray.cluster.worker_group import WorkerGroup

    cfg = run.config
    started_here = RAY_STARTED_BY_TRAIN.join(cfg)
    try:
        run = run.sized_for(ray.cluster_resources())
        warn_if_data_under_one_batch(run, run.worker_shape.num_workers)
        bar = ProgressBar(cfg.train.steps, every=cfg.train.log_every) if progress else None
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

        start = time.monotonic()
        on_note = bar.note if bar else (lambda text: None)
        controller = TrainController(cfg, run.worker_shape, on_metrics=on_metrics, on_note=on_note,
                                     resume=RestoreSource(resume) if resume else None,
                                     worker_group_cls=worker_group_cls or WorkerGroup)
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
