"""The chunk engine (no Ray, no planner here): train a module larger than the device by a plan.

`check_wrappable`, `resolve_target` and `build` turn a module, its optimizer and a `chunk_plan.Plan`
into a module and an optimizer used like the originals; `elixir_ray.wrap` calls them, searching the
plan when it is not given. See docs/engine.md for how chunks, the pool and the optimizer work.
"""

from elixir_ray.engine.chunks import device_scope
from elixir_ray.engine.pool import ChunkPool
from elixir_ray.engine.sample import SampleInputs
from elixir_ray.engine.state import EngineShard, JoinedState, assemble, engine_shard, engine_state, layout_of, load_engine_state
from elixir_ray.engine.wrap import (ChunkedModule, Target, WrapOptions, build, check_wrappable, manual_plan,
                                    one_plan_for_all_ranks, resolve_target)

__all__ = ["ChunkPool", "ChunkedModule", "EngineShard", "JoinedState", "SampleInputs", "Target", "WrapOptions",
           "assemble", "build", "check_wrappable", "device_scope", "engine_shard", "engine_state", "layout_of",
           "load_engine_state", "manual_plan", "one_plan_for_all_ranks", "resolve_target"]
