"""A sweep's search space: dotted config keys mapped to search domains.

A domain is written as a sweep file writes it (`{loguniform: [1e-4, 1e-2]}`, `{grid: [0.0, 0.1]}`,
a plain list for a grid, a single value for a fixed one) or as a Ray Tune domain object in Python
(`tune.loguniform(...)`, `tune.grid_search([...])`). Every key and every value a domain can take
(both bounds of a range, every choice) is checked against the base config before any trial starts,
so a typo or an out-of-range value is one line here instead of a failed trial later.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any, Mapping

from elixir_ray.config import config_from_dict
from elixir_ray.errors import ConfigError

# form -> what its arguments are: the sweep file's spelling of each Tune domain
FORMS = {"loguniform": "[low, high]", "uniform": "[low, high]", "randint": "[low, high)", "choice": "[a, b, ...]",
         "grid": "[a, b, ...]"}
# keys a trial's config gets from the sweep itself: its name, where it writes, how its workers are placed
SWEEP_OWNED = ("name", "output_dir", "checkpoint.uri", "cluster.")
# YAML 1.1 reads a number in exponent form without a dot (1e-4) as text: in a domain it is the number
EXPONENT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")


def _number(value: Any) -> Any:
    return float(value) if isinstance(value, str) and EXPONENT.match(value.strip()) else value


@dataclass(frozen=True)
class Domain:
    """One key's domain: `form` (a FORMS key, or "value" for a fixed one) and its arguments; or a
    Ray Tune domain object given in Python (`tune_object`)."""

    form: str
    args: tuple = ()
    tune_object: Any = None

    def values_to_check(self) -> list:
        """The values a trial may get that the config check must accept: both ends of a range,
        every choice."""
        if self.tune_object is not None:
            obj = self.tune_object
            if hasattr(obj, "categories"):
                return list(obj.categories)
            low, high = getattr(obj, "lower", None), getattr(obj, "upper", None)
            if type(obj).__name__ == "Integer" and high is not None:
                high = high - 1  # randint's upper bound is excluded
            return [v for v in (low, high) if v is not None]
        if self.form in ("loguniform", "uniform"):
            return list(self.args)
        if self.form == "randint":
            return [self.args[0], self.args[1] - 1]
        return list(self.args)

    def to_tune(self):
        """The Ray Tune search domain (or grid) for the Tuner's param_space."""
        from ray import tune

        if self.tune_object is not None:
            return self.tune_object
        make = {"loguniform": tune.loguniform, "uniform": tune.uniform, "randint": tune.randint}
        if self.form in make:
            return make[self.form](*self.args)
        if self.form == "choice":
            return tune.choice(list(self.args))
        if self.form == "grid":
            return tune.grid_search(list(self.args))
        return self.args[0]

    def mutation(self):
        """What Population Based Training may resample this key from: its domain, or its values."""
        if self.tune_object is not None:
            obj = self.tune_object
            return obj["grid_search"] if isinstance(obj, dict) else obj
        if self.form in ("grid", "choice", "value"):
            return list(self.args)
        return self.to_tune()

    def describe(self) -> str:
        if self.tune_object is not None:
            return repr(self.tune_object)
        return f"{self.form} {list(self.args)}" if self.form != "value" else repr(self.args[0])


def parse_domain(key: str, value: Any) -> Domain:
    """A sweep file's (or a Python caller's) domain for `key`, its form checked."""
    if isinstance(value, dict) and set(value) == {"grid_search"}:  # tune.grid_search([...])
        if not isinstance(value["grid_search"], (list, tuple)) or not value["grid_search"]:
            raise ConfigError(f"space: {key}: grid_search takes a non-empty list, got {value['grid_search']!r}")
        return Domain("grid", tuple(_number(v) for v in value["grid_search"]))
    if _is_tune_domain(value):
        return Domain("tune", tune_object=value)
    if isinstance(value, (list, tuple)):
        if not value:
            raise ConfigError(f"space: {key}: an empty list gives no trial; list the values to try")
        return Domain("grid", tuple(_number(v) for v in value))
    if isinstance(value, dict):
        if len(value) != 1:
            raise ConfigError(f"space: {key}: a domain is one of {_forms()} with its arguments, for example "
                              f"{{loguniform: [1.0e-4, 1.0e-2]}}; got {value!r}")
        (form, args), = value.items()
        if form not in FORMS:
            raise ConfigError(f"space: {key}: unknown domain {form!r} (one of {_forms()}, or a plain list: a grid)")
        if not isinstance(args, (list, tuple)) or not args:
            raise ConfigError(f"space: {key}: {form} takes {FORMS[form]}, got {args!r}")
        args = [_number(a) for a in args]
        if form in ("loguniform", "uniform", "randint"):
            _check_range(key, form, args)
        return Domain(form, tuple(args))
    return Domain("value", (_number(value),))


def _check_range(key: str, form: str, args) -> None:
    kind = int if form == "randint" else (int, float)
    if len(args) != 2 or not all(isinstance(a, kind) and not isinstance(a, bool) for a in args):
        raise ConfigError(f"space: {key}: {form} takes {FORMS[form]} ({'integers' if form == 'randint' else 'numbers'}"
                          f"), got {list(args)!r}")
    low, high = args
    if not low < high:
        raise ConfigError(f"space: {key}: {form} [{low}, {high}]: the low bound must be below the high one")
    if form == "loguniform" and low <= 0:
        raise ConfigError(f"space: {key}: loguniform [{low}, {high}] needs a low bound above 0")


def _forms() -> str:
    return ", ".join(FORMS)


def _is_tune_domain(value: Any) -> bool:
    """A `ray.tune.search.sample.Domain` (without importing Ray Tune when none can be one)."""
    return any(c.__module__ == "ray.tune.search.sample" and c.__name__ == "Domain" for c in type(value).__mro__)


def with_values(base: dict, values: Mapping[str, Any]) -> dict:
    """A copy of the config mapping `base` with each dotted key of `values` set."""
    out = copy.deepcopy(base)
    for key, value in values.items():
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[parts[-1]] = value
    return out


def parse_space(space: Mapping[str, Any], base: dict) -> dict[str, Domain]:
    """Each key of `space` with its domain, refused in one line when the key is not a config key
    (or one the sweep sets itself), or the domain is malformed or can take a value the config
    check refuses."""
    if not isinstance(space, Mapping):
        raise ConfigError(f"space: expected a mapping of dotted config keys to domains, got {space!r}")
    if not space:
        raise ConfigError("space: empty: give at least one config key to vary, for example optim.lr")
    out = {}
    for key, value in space.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"space: keys are dotted config keys such as optim.lr, got {key!r}")
        if any(key == owned or (owned.endswith(".") and key.startswith(owned)) for owned in SWEEP_OWNED):
            raise ConfigError(f"space: {key} is set by the sweep for each trial (its name, where it writes, how its "
                              f"workers are placed): vary another key, or set it in the base config")
        domain = parse_domain(key, value)
        for sample in domain.values_to_check():
            try:
                config_from_dict(with_values(base, {key: sample}))
            except ConfigError as exc:
                raise ConfigError(f"space: {key}={sample!r}: {exc}") from None
        out[key] = domain
    return out
