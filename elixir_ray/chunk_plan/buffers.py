"""The engine's transient device buffers that the planner budgets: both sides read these, so a
change to how the engine stages gradients or runs Deep Optimizer States is costed as it runs."""

from __future__ import annotations

MAX_REDUCTIONS_IN_FLIGHT = 2  # gradient chunks on their way to the host at once (CUDA)
# Deep Optimizer States buffers in use at once: two, so that one tile's state comes back while the
# next one's goes up (on CUDA a stream each way); the planner budgets this many
DOS_BUFFERS = 2
# elements of a host chunk's shard each Deep Optimizer States buffer holds: a chunk goes up, is
# updated and comes back a tile at a time, so the buffers are small enough to hold through the
# backward (where updates may start) at 16 bytes an element: 256 MiB for the two, where whole
# chunks of gpt-4b took 5 GiB; a tile's copies (96 MB each way) still take milliseconds
DOS_TILE = 1 << 23


def staged_low(grads_low: bool, world: int) -> bool:
    """Whether a host chunk collects its gradients in the compute dtype rather than fp32: where
    they go down in it (Plan.host_grads_low, one backward per step, a compute dtype narrower than
    fp32), with one rank. Each gradient was computed in that dtype, so the staging copy loses
    nothing (a parameter with several gradients in one backward has each sum rounded, as autograd
    rounds a tied weight's); with several ranks the reduction sums in fp32 first. The planner costs
    the same rule (`planner.cost.chunk_costs`, `planner.search.flying_bytes`)."""
    return grads_low and world == 1
