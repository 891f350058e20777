"""elixir_ray: chunked heterogeneous training of models larger than GPU memory, as a Ray job.

Three layers, usable separately:
- the engine: `wrap(module, optimizer, sample_inputs=(batch,), device_memory="24GiB")` trains any
  module chunk by chunk within a device-memory budget (no Ray involved);
- the planner: `profile_hardware()` and `plan(module, ...)` find the fastest placement that fits,
  and `Plan.explain()` says why;
- the cluster: `train(config)` runs a `RunConfig` as a fault-tolerant Ray job, `start(config)`
  the same in the background (`run.stop()` ends it with a checkpoint), and `sweep(base, space)`
  many runs of it as Ray Tune trials.
Ray is imported only when a run starts.
"""

from elixir_ray.config import RunConfig, config_from_dict, load_config
from elixir_ray.engine import PlanError, SampleInputs, wrap
from elixir_ray.engine.plan import Plan
from elixir_ray.errors import ClusterError, ConfigError
from elixir_ray.planner.api import plan
from elixir_ray.planner.hardware import HardwareProfile, profile_hardware
from elixir_ray.run.handle import RunHandle, start
from elixir_ray.run.outputs import Result
from elixir_ray.run.train import train
from elixir_ray.run_plan import RunPlan
from elixir_ray.sweeps.api import sweep
from elixir_ray.sweeps.results import SweepResult

__all__ = ["ClusterError", "ConfigError", "HardwareProfile", "Plan", "PlanError", "Result", "RunConfig", "RunHandle",
           "RunPlan", "SampleInputs", "SweepResult", "config_from_dict", "load_config", "plan", "profile_hardware",
           "start", "sweep", "train", "wrap"]
__version__ = "0.1.0"
