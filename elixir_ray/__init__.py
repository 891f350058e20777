"""elixir_ray: chunked heterogeneous training of models larger than GPU memory, as a Ray job.

Three layers, usable separately:
- the engine: `wrap(module, optimizer, sample_inputs=(batch,), device_memory="24GiB")` trains any
  module chunk by chunk within a device-memory budget (no Ray involved);
- the planner: `profile_hardware()` and `plan(module, ...)` find the fastest placement that fits,
  and `Plan.explain()` says why;
- the cluster: `train(config)` runs a `RunConfig` as a fault-tolerant Ray job.
Ray is imported only when a run starts.
"""

from elixir_ray.api import Result, train
from elixir_ray.chunk_plan.plan import Plan
from elixir_ray.config import RunConfig, config_from_dict, load_config
from elixir_ray.engine import PlanError, SampleInputs, wrap
from elixir_ray.errors import ClusterError, ConfigError
from elixir_ray.planner.api import plan
from elixir_ray.planner.hardware import HardwareProfile, profile_hardware
from elixir_ray.run_plan import RunPlan

__all__ = ["ClusterError", "ConfigError", "HardwareProfile", "Plan", "PlanError", "Result", "RunConfig", "RunPlan",
           "SampleInputs", "config_from_dict", "load_config", "plan", "profile_hardware", "train", "wrap"]
__version__ = "0.1.0"
