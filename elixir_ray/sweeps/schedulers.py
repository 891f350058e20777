"""The trial scheduler a sweep names, as the Ray Tune scheduler that runs it.

Every scheduler counts time in the runs' own `step` (not Tune's count of reports): a trial that
restarts from a checkpoint reports some steps again, and its decisions stay where they were.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from elixir_ray.errors import ConfigError

SCHEDULERS = ("asha", "median", "pbt", "none")
ALIASES = {"fifo": "none", "async_hyperband": "asha", "median_stopping_rule": "median",
           "population_based_training": "pbt"}
TIME_ATTR = "step"


@dataclass(frozen=True)
class SchedulerSpec:
    type: str  # one of SCHEDULERS
    settings: Mapping[str, Any] = field(default_factory=dict)  # the Tune scheduler's own arguments

    def describe(self) -> str:
        extra = ", ".join(f"{k}={v}" for k, v in self.settings.items())
        return self.type + (f" ({extra})" if extra else "")


def parse_scheduler(value: Union[str, Mapping, None]) -> SchedulerSpec:
    """`asha`, `{type: asha, grace_period: 10}`, `none`..., refused in one line when Tune has no
    such scheduler here."""
    if value is None:
        return SchedulerSpec("none")
    if isinstance(value, str):
        kind, settings = value, {}
    elif isinstance(value, Mapping):
        settings = dict(value)
        kind = settings.pop("type", None)
        if not isinstance(kind, str):
            raise ConfigError(f"scheduler: give its type, for example {{type: asha, grace_period: 10}}; got {value!r}")
    else:
        raise ConfigError(f"scheduler: expected a name ({', '.join(SCHEDULERS)}) or a mapping with a type, "
                          f"got {value!r}")
    kind = ALIASES.get(kind.lower(), kind.lower())
    if kind not in SCHEDULERS:
        raise ConfigError(f"scheduler type {value if isinstance(value, str) else value.get('type')!r} is not one this "
                          f"sweep runs on Ray Tune (one of {', '.join(SCHEDULERS)}: ASHA, the median stopping rule, "
                          f"Population Based Training, or none)")
    if "time_attr" in settings:
        raise ConfigError(f"scheduler: time_attr is always {TIME_ATTR!r} (the runs' own step count)")
    return SchedulerSpec(kind, settings)


def make_scheduler(spec: SchedulerSpec, *, steps: int, mutations: Mapping[str, Any], checkpoint_every: int):
    """The Tune scheduler (None for `none`); a setting Tune does not take, or a value it refuses, is
    one line. `steps`: train.steps (ASHA's max_t); `mutations`: what PBT may resample each key
    from; `checkpoint_every`: checkpoint.every_steps, PBT's default perturbation interval."""
    from ray.tune.schedulers import ASHAScheduler, MedianStoppingRule, PopulationBasedTraining

    if spec.type == "none":
        return None
    settings = dict(spec.settings)
    if spec.type == "asha":
        settings.setdefault("max_t", steps)
        settings.setdefault("grace_period", max(1, min(steps // 4, 10)))
        cls = ASHAScheduler
    elif spec.type == "median":
        settings.setdefault("grace_period", max(1, min(steps // 4, 10)))
        cls = MedianStoppingRule
    else:
        settings.setdefault("perturbation_interval", checkpoint_every or max(1, steps // 4))
        settings.setdefault("hyperparam_mutations", dict(mutations))
        cls = PopulationBasedTraining
    try:
        return cls(time_attr=TIME_ATTR, **settings)
    except TypeError as exc:
        raise ConfigError(f"scheduler {spec.type}: {_first_line(exc)} (its settings are {cls.__name__}'s arguments)") \
            from None
    except (ValueError, AssertionError) as exc:
        raise ConfigError(f"scheduler {spec.type}: {_first_line(exc) or 'a setting is out of range'} "
                          f"({spec.describe()})") from None


def pbt_interval(spec: SchedulerSpec, steps: int, checkpoint_every: int) -> Optional[int]:
    """PBT's perturbation interval (the trials must checkpoint at least that often), else None."""
    if spec.type != "pbt":
        return None
    return int(spec.settings.get("perturbation_interval") or checkpoint_every or max(1, steps // 4))


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]
