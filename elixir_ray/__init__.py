"""elixir_ray: chunked heterogeneous training of models larger than GPU memory, as a Ray job.

The driver API is `train`; `RunConfig` and `load_config` build configs. Ray is imported only
when a run starts, so the engine and planner stay usable without it.
"""

from elixir_ray.api import Result, train
from elixir_ray.config import RunConfig, config_from_dict, load_config
from elixir_ray.errors import ClusterError, ConfigError
from elixir_ray.plan import Plan

__all__ = ["ClusterError", "ConfigError", "Plan", "Result", "RunConfig", "config_from_dict", "load_config", "train"]
__version__ = "0.1.0"
