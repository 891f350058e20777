"""elixir_ray: chunked heterogeneous training of models larger than GPU memory, as a Ray job.

Three layers, usable separately:
- the engine: `wrap(module, optimizer, sample_inputs=(batch,), device_memory="24GiB")` trains any
  module chunk by chunk within a device-memory budget (no Ray involved);
- the planner: `profile_hardware()` and `plan(module, sample_inputs, ...)` find the fastest
  placement that fits, and `Plan.explain()` says why;
- the cluster: `train(config)` runs a `RunConfig` as a fault-tolerant Ray job, `start(config)`
  the same in the background (`run.stop()` ends it with a checkpoint), and `sweep(base, space)`
  many runs of it as Ray Tune trials.
Each public name is imported when first used (`_PUBLIC`), so that `import elixir_ray.engine` does
not import Ray, pyarrow, the data or the checkpoint packages.
"""

from __future__ import annotations

import importlib

_PUBLIC = {  # public name -> the module that defines it
    "ClusterError": "elixir_ray.errors",
    "ConfigError": "elixir_ray.errors",
    "HardwareProfile": "elixir_ray.planner.hardware",
    "Plan": "elixir_ray.chunk_plan.plan",
    "PlanError": "elixir_ray.chunk_plan.errors",
    "Result": "elixir_ray.run.outputs",
    "RunConfig": "elixir_ray.config",
    "RunHandle": "elixir_ray.run.handle",
    "RunPlan": "elixir_ray.run_plan",
    "SampleInputs": "elixir_ray.engine.sample",
    "SweepResult": "elixir_ray.sweeps.results",
    "config_from_dict": "elixir_ray.config",
    "load_config": "elixir_ray.config",
    "plan": "elixir_ray.planner.api",
    "profile_hardware": "elixir_ray.planner.hardware",
    "start": "elixir_ray.run.handle",
    "sweep": "elixir_ray.sweeps.api",
    "train": "elixir_ray.run.train",
    "wrap": "elixir_ray.wrapping",
}

__all__ = sorted(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'elixir_ray' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
