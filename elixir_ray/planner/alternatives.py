"""The hand-made plans users of other systems write, costed by the same model as the searched plan.

They answer "is the search worth it?": every one of them is a member of the family the search
enumerates, so the searched plan is never predicted slower; `jobs/bench_plans.py` measures them.
- all optimizer state on the host (ZeRO-Offload style), the largest pool that fits;
- as much optimizer state on the device as fits, in chunk order, with the smallest pool;
- Gemini-style offload fractions: that fraction of the chunks (the last ones) keeps its state on
  the host, the rest on the device, the largest pool that fits.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from elixir_ray.chunk_plan.plan import Plan
from elixir_ray.planner.cost import host_grads_low_applies
from elixir_ray.planner.search import Choice, Layout, SearchSettings, choice_to_plan, evaluate, pool_candidates
from elixir_ray.units import format_bytes

OFFLOAD_FRACTIONS = (0.25, 0.5, 0.75)


def _fits(choice: Choice, settings: SearchSettings) -> bool:
    memory, _, host_bytes, _ = evaluate(choice, settings.hw, settings.world_size, settings.elem_bytes,
                                        settings.grad_accum)
    return sum(memory.values()) <= settings.limit and (settings.host_budget is None
                                                       or host_bytes <= settings.host_budget)


def _misfit(choice: Choice, settings: SearchSettings) -> str:
    """Why a placement at its smallest pool does not fit: device memory, host memory, or both."""
    memory, _, host_bytes, _ = evaluate(choice, settings.hw, settings.world_size, settings.elem_bytes,
                                        settings.grad_accum)
    host_budget = settings.host_budget
    reasons = []
    if sum(memory.values()) > settings.limit:
        reasons.append(f"device needs {format_bytes(int(sum(memory.values()) / (1 - settings.margin)))}")
    if host_budget is not None and host_bytes > host_budget:
        reasons.append(f"host needs {format_bytes(host_bytes)} per rank of {format_bytes(host_budget)}")
    return ", ".join(reasons) or "does not fit"


def _largest_pool(lay: Layout, device: np.ndarray, grads_low: bool, settings: SearchSettings) -> Optional[Choice]:
    for n in reversed(pool_candidates(lay)):
        choice = Choice(lay, n, device, 0, grads_low=grads_low)
        if _fits(choice, settings):
            return choice
    return None


def hand_made_plans(lay: Layout, settings: SearchSettings, why_not: Optional[dict] = None) -> dict[str, Optional[Plan]]:
    """name -> Plan, or None where that recipe does not fit the budget less the settings' margin
    (`why_not`, when given, gets name -> what does not fit for those). Host gradients follow the
    same rule as in the search (`host_grads_low_applies`), so only the placement differs."""
    low = host_grads_low_applies(settings.dtype_name, settings.grad_accum, settings.low_host_grads)
    n_chunks = len(lay.sizes)

    def smallest_pool(on_device: int) -> Choice:  # the first `on_device` chunks' state on the device
        return Choice(lay, lay.min_blocks, np.arange(n_chunks) < on_device, 0, grads_low=low)

    # the recipes with a fixed placement, by how many chunks keep their state on the device
    fixed = {"all optimizer state on the host": 0,
             **{f"offload fraction {f}": n_chunks - int(round(f * n_chunks)) for f in OFFLOAD_FRACTIONS}}
    choices: dict[str, Optional[Choice]] = {}
    for name in dict.fromkeys(("all optimizer state on the host", "as much as fits on the device", *fixed)):
        if name in fixed:
            choices[name] = _largest_pool(lay, smallest_pool(fixed[name]).device, low, settings)
        else:  # the most chunks' state on the device that fits, with the smallest pool
            choices[name] = next((c for c in map(smallest_pool, range(n_chunks, -1, -1)) if _fits(c, settings)), None)
    if why_not is not None:
        for name, c in choices.items():
            if c is not None:
                continue
            if name in fixed:
                why_not[name] = _misfit(smallest_pool(fixed[name]), settings)
            else:  # every split was tried: say what the two ends exceed
                why_not[name] = (f"no split fits: all on the host, {_misfit(smallest_pool(0), settings)}; all on the "
                                 f"device, {_misfit(smallest_pool(n_chunks), settings)}")
    return {name: None if c is None else choice_to_plan(c, settings, note=f"hand-made: {name}")
            for name, c in choices.items()}
