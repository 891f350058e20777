"""`elixir_ray.sweep(base, space, ...) -> SweepResult`: many runs of one config, on Ray Tune.

The sweep is checked whole before Ray is touched (`spec.build_spec`), and what needs the cluster
(do the trials fit it, how many share a GPU) before any trial starts; then Ray Tune runs the
trials (`trial.run_trial`), each in a placement group of its own, with the scheduler stopping
the weak ones; a sweep stopped midway (its driver lost) is continued with `resume`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from contextlib import contextmanager
from typing import Any, Mapping, Optional, Union

from elixir_ray.config import RunConfig
from elixir_ray.errors import ConfigError
from elixir_ray.sweeps.results import SweepResult

RESUME_CHOICES = (False, True, "auto")
UNBOUNDED_CPUS = 2**20  # sizing a trial before the local cluster exists: its CPUs are what is being chosen
TRIAL_ID = re.compile(r"^[0-9a-f]+_\d{5}")  # Tune's trial ids: the experiment's hash, the trial's number


def sweep(base: Union[RunConfig, dict, str], space: Mapping[str, Any], *, metric: str = "loss", mode: str = "min",
          num_samples: int = 1, scheduler: Union[str, Mapping, None] = "asha",
          max_concurrent_trials: Optional[int] = None, trials_per_gpu: int = 1, name: Optional[str] = None,
          storage: Optional[str] = None, resume: Union[bool, str] = False, progress: bool = True) -> SweepResult:
    """Run a sweep of `base` (a config: path, shipped name, dict or RunConfig) over `space` (dotted
    config keys -> Tune search domains, e.g. `{"optim.lr": tune.loguniform(1e-4, 1e-2)}`, or plain
    lists: a grid), `num_samples` times each, on Ray Tune.

    `scheduler`: "asha", "median", "pbt", "none", or a mapping with `type` and the Tune scheduler's
    own settings (`{"type": "asha", "grace_period": 10}`). `trials_per_gpu`: how many trials share
    each GPU (each rank then gets that part of the GPU's free memory as its budget; on a CPU-only
    cluster, of a slot of cluster.cpus_per_worker CPUs). `storage`: a directory or pyarrow URI
    (default runs/sweeps); the sweep writes `<storage>/<name>/`. `resume`: True continues the
    sweep of that name (finished trials kept, running ones from their newest checkpoints), "auto"
    continues it if there is one, False refuses to overwrite one."""
    from elixir_ray.sweeps.spec import build_spec

    if resume not in RESUME_CHOICES:
        raise ConfigError(f"resume must be True, False or 'auto', got {resume!r}")
    spec = build_spec(base, space, metric=metric, mode=mode, num_samples=num_samples, scheduler=scheduler,
                      max_concurrent_trials=max_concurrent_trials, trials_per_gpu=trials_per_gpu, name=name,
                      storage=storage)
    return run_sweep(spec, resume=resume, progress=progress)


def run_sweep(spec, *, resume: Union[bool, str], progress: bool) -> SweepResult:
    """Run a checked `spec.SweepSpec` (what `sweep` and `elixir-ray sweep` build)."""
    from elixir_ray.run.embedded_ray import RAY_STARTED_BY_TRAIN
    from elixir_ray.sweeps.schedulers import make_scheduler, pbt_interval

    cfg = spec.base
    every = cfg.checkpoint.every_steps or pbt_interval(spec.scheduler, cfg.train.steps, 0) or 0
    mutations = {key: domain.mutation() for key, domain in spec.space.items()}
    scheduler = make_scheduler(spec.scheduler, steps=cfg.train.steps, mutations=mutations, checkpoint_every=every)
    restoring = _restoring(spec, resume)
    started = RAY_STARTED_BY_TRAIN.join(_with_local_cpus(spec, progress))
    try:
        import ray

        from elixir_ray.sweeps.packing import free_device_memory, packed, read_packing, trial_resources, write_packing

        resources = trial_resources(cfg, spec.trials_per_gpu, ray.cluster_resources())
        if spec.trials_per_gpu > 1:
            free = free_device_memory(resources, cfg.cluster.placement_timeout_s)
            resources = packed(cfg, resources, free, started_with=read_packing(spec.sweep_dir) if restoring else None)
            if not resources.budget_kept:  # what a later resume keeps: the budget the trials run with now
                write_packing(spec.sweep_dir, resources)
        if progress:
            print(f"sweep {spec.name}: each trial reserves {resources.describe()}", file=sys.stderr, flush=True)
        tuner = _tuner(spec, resources, scheduler, every, restoring, progress)
        with _metric_checks_for(spec.metric):
            grid = tuner.fit()
        result = collect_results(spec, grid)
    finally:
        if started:
            RAY_STARTED_BY_TRAIN.leave()
    if progress:
        print(result.leaderboard(), flush=True)
    return result


def _restoring(spec, resume: Union[bool, str]) -> bool:
    """Whether this continues an earlier sweep of the same name; refused in one line when `resume`
    and what is in the storage disagree."""
    from ray.tune import Tuner

    exists = Tuner.can_restore(spec.sweep_dir)
    if resume is True and not exists:
        raise ConfigError(f"--resume: there is no sweep named {spec.name!r} in {spec.storage} to continue "
                          f"(run it without --resume to start it)")
    if resume is False and exists:
        raise ConfigError(f"a sweep named {spec.name!r} is already in {spec.storage}: continue it with --resume "
                          f"(resume=True), or give this one another name")
    return exists


def _with_local_cpus(spec, progress: bool) -> RunConfig:
    """The base config, with the local cluster that a sweep starts (RAY_ADDRESS unset) given enough
    logical CPUs for its concurrent trials: a logical count only, the trials share the machine's
    cores as any processes do."""
    import ray
    import torch

    from elixir_ray.run.embedded_ray import local_cpus
    from elixir_ray.sweeps.packing import trial_resources

    cfg = spec.base
    if ray.is_initialized() or os.environ.get("RAY_ADDRESS"):
        return cfg
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    per_trial = trial_resources(cfg, spec.trials_per_gpu, {"CPU": UNBOUNDED_CPUS, "GPU": gpus}).cpus()
    concurrent = spec.max_concurrent_trials or 1
    cpus = max(local_cpus(cfg), math.ceil(per_trial * concurrent))
    if cpus > local_cpus(cfg) and progress:
        print(f"sweep {spec.name}: the local Ray cluster gets {cpus} logical CPUs for {concurrent} trial(s) at once "
              f"of {per_trial:g} each (this machine has {os.cpu_count()} cores)", file=sys.stderr, flush=True)
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, local_num_cpus=cpus))


def trial_dirname(trial) -> str:
    """A trial's directory is its id: the run directory the trial's run writes (`<sweep>/<trial>`)."""
    return trial.trial_id


def _tuner(spec, resources, scheduler, every: int, restoring: bool, progress: bool):
    from ray import tune
    from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback, TBXLoggerCallback

    from elixir_ray.sweeps.trial import TrialSetup, run_trial

    setup = TrialSetup(spec=spec, num_workers=resources.num_workers, device_memory=resources.device_memory,
                       checkpoint_every=every)
    trainable = tune.with_resources(tune.with_parameters(run_trial, setup=setup),
                                    tune.PlacementGroupFactory(resources.bundles, strategy="PACK"))
    if restoring:
        return tune.Tuner.restore(spec.sweep_dir, trainable, resume_unfinished=True, resume_errored=False,
                                  restart_errored=False)
    return tune.Tuner(
        trainable,
        param_space={key: domain.to_tune() for key, domain in spec.space.items()},
        tune_config=tune.TuneConfig(metric=spec.metric, mode=spec.mode, scheduler=scheduler,
                                    num_samples=spec.num_samples, max_concurrent_trials=spec.max_concurrent_trials,
                                    trial_dirname_creator=trial_dirname, reuse_actors=False),
        run_config=tune.RunConfig(
            name=spec.name, storage_path=spec.storage, verbose=1 if progress else 0,
            failure_config=tune.FailureConfig(max_failures=0, fail_fast=False),
            # every pointer kept (a few bytes each): the experiment state a restored sweep reads may name
            # one older than the newest few; the checkpoints they name are pruned by the runs themselves
            checkpoint_config=tune.CheckpointConfig(num_to_keep=None),
            callbacks=[CSVLoggerCallback(), JsonLoggerCallback(), TBXLoggerCallback()]))


@contextmanager
def _metric_checks_for(metric: str):
    """Tune refuses a result without the sweep's metric; eval_loss is in the rows of evaluation
    steps only (the metric is checked against what the runs report before the sweep starts)."""
    if metric != "eval_loss":
        yield
        return
    before = os.environ.get("TUNE_DISABLE_STRICT_METRIC_CHECKING")
    os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TUNE_DISABLE_STRICT_METRIC_CHECKING", None)
        else:
            os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = before


def collect_results(spec, grid) -> SweepResult:
    """The sweep's table, chart and best trial, written beside its trials."""
    from elixir_ray.sweeps.results import (CHART_FILE, TRIALS_FILE, best_trial, trial_row, trials_table, write_chart,
                                           write_table)

    keys = list(spec.space)
    rows, curves = [], {}
    for result in grid:
        trial_id = trial_id_of(result)
        values = {k: (result.config or {}).get(k) for k in keys}
        error = error_line(result.error) if result.error is not None else None
        row, curve = trial_row(spec.sweep_dir, trial_id, values, spec.metric, spec.mode, spec.base.train.steps, error)
        rows.append(row)
        curves[trial_id] = curve
    rows.sort(key=lambda r: r["trial_id"])
    table = trials_table(rows, keys, spec.metric)
    trials_uri, chart_uri = f"{spec.sweep_dir}/{TRIALS_FILE}", f"{spec.sweep_dir}/{CHART_FILE}"
    write_table(table, trials_uri)
    write_chart(curves, {r["trial_id"]: r["status"] for r in rows}, spec.metric, chart_uri,
                f"sweep {spec.name}: {spec.metric} by step ({spec.scheduler.describe()})")
    return SweepResult(trials=table, best=best_trial(table, spec.metric, spec.mode, keys), metric=spec.metric,
                       mode=spec.mode, keys=keys, sweep_dir=spec.sweep_dir, trials_uri=trials_uri,
                       chart_uri=chart_uri)


def trial_id_of(result) -> str:
    """A Tune result's trial id: in every row it reported, else in its directory's name (the id, with
    a suffix where a restored sweep found the directory already made)."""
    reported = (result.metrics or {}).get("trial_id")
    if reported:
        return str(reported)
    name = os.path.basename(str(result.path).rstrip("/"))
    match = TRIAL_ID.match(name)
    return match.group(0) if match else name


def error_line(error: BaseException) -> str:
    """A failed trial's error in one line: the innermost cause's type and first line."""
    seen = set()
    while id(error) not in seen:
        seen.add(id(error))
        inner = getattr(error, "cause", None) or error.__cause__
        if not isinstance(inner, BaseException):
            break
        error = inner
    text = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {text}"
