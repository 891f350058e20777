"""Elastic runs: how many workers a run goes on with after losing some, and when it grows back.

`cluster.num_workers` is the most a run has: it starts with them. After a loss (a node gone, its
resources not back within `fault.wait_for_resources_s`) it goes on with as many as fit, at least
`cluster.min_workers` (1 with `fault.elastic: true`; without either, all of them), and at each
checkpoint after that, where the free resources hold the missing workers again, it grows back:
the snapshot just taken is restored onto the full group, re-planned for it. Every count keeps the
global batch (each worker takes more micro-steps, or fewer), so the losses are those of a run that
never shrank; a count that does not divide the global batch is lowered to one that does.
"""

from __future__ import annotations

from typing import Optional

from elixir_ray.cluster.placement import WorkerShape, workers_that_fit
from elixir_ray.config import RunConfig


def minimum_workers(cfg: RunConfig, full: int) -> int:
    """The fewest workers the run goes on with after a loss."""
    if cfg.cluster.min_workers is not None:
        return min(cfg.cluster.min_workers, full)
    return 1 if cfg.fault.elastic else full


def workers_after_loss(fit: int, full: int, minimum: int, global_batch: int) -> Optional[int]:
    """The most workers, of the `fit` that the free resources hold (and at most `full`), that split the
    global batch evenly and are at least `minimum`; None when there are none."""
    for count in range(min(fit, full), max(1, minimum) - 1, -1):
        if global_batch % count == 0:
            return count
    return None


def grows_back(shape: WorkerShape, full: int, available: dict) -> bool:
    """Whether a run on fewer than `full` workers can place the missing ones in the free resources
    (`ray.available_resources()`, the run's own bundles not counted there)."""
    missing = full - shape.num_workers
    return missing > 0 and workers_that_fit(shape, available) >= missing
