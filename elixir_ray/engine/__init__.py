"""The chunk engine (no Ray here): train a module larger than the device within a memory budget.

`wrap(module, optimizer, sample_inputs=(batch,), device_memory="24GiB")` returns a module and an
optimizer used like the originals. See docs/engine.md for how chunks, the pool and the optimizer work.
"""

from elixir_ray.chunk_plan.errors import PlanError
from elixir_ray.chunk_plan.plan import Plan
from elixir_ray.engine.pool import ChunkPool
from elixir_ray.engine.sample import SampleInputs
from elixir_ray.engine.state import EngineShard, JoinedState, assemble, engine_shard, engine_state, layout_of, load_engine_state
from elixir_ray.engine.wrap import ChunkedModule, manual_plan, wrap

__all__ = ["ChunkPool", "ChunkedModule", "EngineShard", "JoinedState", "Plan", "PlanError", "SampleInputs", "assemble",
           "engine_shard", "engine_state", "layout_of", "load_engine_state", "manual_plan", "wrap"]
