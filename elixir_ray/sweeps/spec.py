"""A sweep as the user states it (a SWEEP.yaml or `elixir_ray.sweep(...)`'s arguments), checked.

Everything that can be checked without a Ray cluster is checked here, each refusal one line: the
base config, the space's keys and domains, the metric, the mode, the scheduler, the numbers.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import yaml

from elixir_ray.config import RunConfig, config_from_dict, parse_overrides
from elixir_ray.errors import ConfigError
from elixir_ray.run.resolved import as_config
from elixir_ray.sweeps.schedulers import SchedulerSpec, parse_scheduler
from elixir_ray.sweeps.space import Domain, parse_space

# what every metrics row reports (eval_loss only with eval.path), in the order the docs list them
REPORTED = ("loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "step_seconds")
FILE_KEYS = ("name", "base", "space", "num_samples", "metric", "mode", "scheduler", "max_concurrent_trials",
             "trials_per_gpu", "storage")
DEFAULT_STORAGE = "runs/sweeps"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class SweepSpec:
    name: str
    base: RunConfig  # the config every trial starts from
    space: Mapping[str, Domain]
    metric: str
    mode: str
    num_samples: int
    scheduler: SchedulerSpec
    max_concurrent_trials: Optional[int]
    trials_per_gpu: int
    storage: str  # an absolute local path or a pyarrow filesystem URI

    @property
    def sweep_dir(self) -> str:
        """`<storage>/<name>`: Tune's experiment directory, and every trial's run directory in it."""
        return f"{self.storage.rstrip('/')}/{self.name}"


def build_spec(base: Union[RunConfig, dict, str], space: Mapping[str, Any], *, metric: str = "loss",
               mode: str = "min", num_samples: int = 1, scheduler: Union[str, Mapping, None] = "asha",
               max_concurrent_trials: Optional[int] = None, trials_per_gpu: int = 1, name: Optional[str] = None,
               storage: Optional[str] = None, base_overrides: Optional[list[str]] = None) -> SweepSpec:
    """The checked spec; a ConfigError names what is wrong, before Ray is touched."""
    base_cfg = _base_config(base, base_overrides)
    name = name if name is not None else f"{base_cfg.name}-sweep"
    if not isinstance(name, str) or not NAME.match(name):
        raise ConfigError(f"name {name!r}: a sweep's name is letters, digits, '-', '_' and '.' (it names a directory)")
    domains = parse_space(space, base_cfg.to_dict())
    if not isinstance(metric, str) or metric not in REPORTED:
        raise ConfigError(f"metric {metric!r} is not one the runs report (one of {', '.join(REPORTED)})")
    if metric == "eval_loss" and base_cfg.eval.path is None and "eval.path" not in domains:
        raise ConfigError("metric eval_loss: the base config has no eval.path, so the runs report no held-out loss "
                          "(set eval.path, or use metric: loss)")
    if mode not in ("min", "max"):
        raise ConfigError(f"mode {mode!r}: min or max")
    _whole("num_samples", num_samples, 1)
    if max_concurrent_trials is not None:
        _whole("max_concurrent_trials", max_concurrent_trials, 1)
    _whole("trials_per_gpu", trials_per_gpu, 1)
    storage = storage if storage is not None else DEFAULT_STORAGE
    if not isinstance(storage, str) or not storage:
        raise ConfigError(f"storage {storage!r}: a directory or a pyarrow filesystem URI (s3://bucket/sweeps)")
    if "://" not in storage or storage.startswith("file://"):
        storage = os.path.abspath(storage[len("file://"):] if storage.startswith("file://") else storage)
    return SweepSpec(name=name, base=base_cfg, space=domains, metric=metric, mode=mode, num_samples=num_samples,
                     scheduler=parse_scheduler(scheduler), max_concurrent_trials=max_concurrent_trials,
                     trials_per_gpu=trials_per_gpu, storage=storage)


def _whole(key: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{key} must be a whole number of at least {low}, got {value!r}")


def _base_config(base: Union[RunConfig, dict, str], overrides: Optional[list[str]]) -> RunConfig:
    if base is None:
        raise ConfigError("base: give the config every trial starts from (a shipped name such as tiny, a path, or "
                          "a mapping)")
    cfg = as_config(base, overrides or None)
    # a trial runs in a working directory of Ray Tune's: relative local paths are made absolute here
    data, ev = cfg.data, cfg.eval
    return dataclasses.replace(
        cfg, data=dataclasses.replace(data, path=_absolute(data.path) if data.path != "builtin" else data.path,
                                      cache_dir=_absolute(data.cache_dir)),
        eval=dataclasses.replace(ev, path=_absolute(ev.path)))


def _absolute(path: Optional[str]) -> Optional[str]:
    return path if path is None or "://" in path else os.path.abspath(path)


def load_sweep_file(path: str, overrides: Optional[list[str]] = None) -> dict:
    """The keyword arguments of `build_spec` from a sweep file, with `--set` overrides applied: a
    sweep key (`num_samples=8`, `scheduler.grace_period=5`, `space.optim.lr=[...]`) sets the file's
    value; any other key is a base config key (`train.steps=40`)."""
    if not os.path.isfile(path):
        raise ConfigError(f"sweep file {path!r} does not exist")
    with open(path) as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as exc:
            raise ConfigError(f"sweep file {path!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"sweep file {path!r}: expected a mapping ({', '.join(FILE_KEYS)}), got {data!r}")
    unknown = [k for k in data if k not in FILE_KEYS]
    if unknown:
        raise ConfigError(f"sweep file {path!r}: unknown key {unknown[0]!r} (allowed: {', '.join(FILE_KEYS)})")
    base_overrides = []
    for item in overrides or []:
        key, _, raw = item.partition("=")
        key = key.strip()
        top = key.split(".", 1)[0]
        if top not in FILE_KEYS:
            base_overrides.append(item)
            continue
        value = parse_overrides([f"x={raw}"])["x"] if raw.strip() else None
        if key == top:
            data[key] = value
        elif top == "space":
            data.setdefault("space", {})[key[len("space."):]] = value
        elif top == "scheduler":
            scheduler = data.get("scheduler")
            scheduler = {"type": scheduler} if isinstance(scheduler, str) else dict(scheduler or {"type": "asha"})
            scheduler[key[len("scheduler."):]] = value
            data["scheduler"] = scheduler
        else:
            raise ConfigError(f"--set {item}: {top} is one value, set it as --set {top}=...")
    base = data.get("base")
    if isinstance(base, str) and not os.path.isabs(base):
        beside = os.path.join(os.path.dirname(os.path.abspath(path)), base)
        base = beside if os.path.isfile(beside) else base  # else the working directory's, or a shipped name
    storage = data.get("storage")
    if isinstance(storage, str) and "://" not in storage and not os.path.isabs(storage):
        storage = os.path.abspath(storage)  # the working directory's, as every relative path of a run
    kwargs = {k: v for k, v in data.items() if k not in ("base", "storage")}
    kwargs.setdefault("space", {})
    return {"base": base, "storage": storage, "base_overrides": base_overrides, **kwargs}


def trial_config(spec: SweepSpec, values: Mapping[str, Any], trial_id: str, *, num_workers: int,
                 device_memory: Optional[int], checkpoint_every: int) -> RunConfig:
    """The run config of one trial: the base with its sampled `values`, named after the trial and
    writing into the sweep's directory (its checkpoints in `<sweep>/<trial>/checkpoints`)."""
    from elixir_ray.sweeps.space import with_values

    data = with_values(spec.base.to_dict(), dict(values))
    data["name"], data["output_dir"] = trial_id, spec.sweep_dir
    data["checkpoint"] = {**data.get("checkpoint", {}), "uri": None, "every_steps": checkpoint_every}
    data["cluster"] = {**data.get("cluster", {}), "num_workers": num_workers}
    if device_memory is not None:
        data["engine"] = {**data.get("engine", {}), "device_memory": str(device_memory)}
    return config_from_dict(data)
