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
from elixir_ray.planner.hardware import HardwareProfile
from elixir_ray.planner.search import SAFETY, Choice, Layout, choice_to_plan, evaluate, pool_candidates
from elixir_ray.units import format_bytes

OFFLOAD_FRACTIONS = (0.25, 0.5, 0.75)


def _fits(choice: Choice, hw: HardwareProfile, world: int, elem_bytes: int, grad_accum: int, budget: int,
          host_budget: Optional[int], margin: float = SAFETY) -> bool:
    memory, _, host_bytes, _ = evaluate(choice, hw, world, elem_bytes, grad_accum)
    return sum(memory.values()) <= budget * (1 - margin) and (host_budget is None or host_bytes <= host_budget)


def _misfit(choice: Choice, hw: HardwareProfile, world: int, elem_bytes: int, grad_accum: int, budget: int,
            host_budget: Optional[int], margin: float = SAFETY) -> str:
    """Why a placement at its smallest pool does not fit: device memory, host memory, or both."""
    memory, _, host_bytes, _ = evaluate(choice, hw, world, elem_bytes, grad_accum)
    reasons = []
    if sum(memory.values()) > budget * (1 - margin):
        reasons.append(f"device needs {format_bytes(int(sum(memory.values()) / (1 - margin)))}")
    if host_budget is not None and host_bytes > host_budget:
        reasons.append(f"host needs {format_bytes(host_bytes)} per rank of {format_bytes(host_budget)}")
    return ", ".join(reasons) or "does not fit"


def _largest_pool(lay: Layout, device: np.ndarray, grads_low: bool, *args) -> Optional[Choice]:
    for n in reversed(pool_candidates(lay)):
        choice = Choice(lay, n, device, 0, grads_low=grads_low)
        if _fits(choice, *args):
            return choice
    return None


def hand_made_plans(lay: Layout, hw: HardwareProfile, budget: int, world: int, dtype_name: str, elem_bytes: int,
                    grad_accum: int = 1, host_budget: Optional[int] = None,
                    updates_in_backward: bool = False, why_not: Optional[dict] = None,
                    margin: float = SAFETY) -> dict[str, Optional[Plan]]:
    """name -> Plan, or None where that recipe does not fit the budget less `margin` (`why_not`, when
    given, gets name -> what does not fit for those). Host gradients follow the same rule as in the
    search (`host_grads_low_applies`), so only the placement differs."""
    args = (hw, world, elem_bytes, grad_accum, budget, host_budget, margin)
    low = host_grads_low_applies(dtype_name, grad_accum)
    n_chunks = len(lay.sizes)

    def smallest_pool(on_device: int) -> Choice:  # the first `on_device` chunks' state on the device
        return Choice(lay, lay.min_blocks, np.arange(n_chunks) < on_device, 0, grads_low=low)

    # the recipes with a fixed placement, by how many chunks keep their state on the device
    fixed = {"all optimizer state on the host": 0,
             **{f"offload fraction {f}": n_chunks - int(round(f * n_chunks)) for f in OFFLOAD_FRACTIONS}}
    choices: dict[str, Optional[Choice]] = {}
    for name in dict.fromkeys(("all optimizer state on the host", "as much as fits on the device", *fixed)):
        if name in fixed:
            choices[name] = _largest_pool(lay, smallest_pool(fixed[name]).device, low, *args)
        else:  # the most chunks' state on the device that fits, with the smallest pool
            choices[name] = next((c for c in map(smallest_pool, range(n_chunks, -1, -1)) if _fits(c, *args)), None)
    if why_not is not None:
        for name, c in choices.items():
            if c is not None:
                continue
            if name in fixed:
                why_not[name] = _misfit(smallest_pool(fixed[name]), *args)
            else:  # every split was tried: say what the two ends exceed
                why_not[name] = (f"no split fits: all on the host, {_misfit(smallest_pool(0), *args)}; all on the "
                                 f"device, {_misfit(smallest_pool(n_chunks), *args)}")
    return {name: None if c is None else choice_to_plan(c, hw, world, dtype_name, elem_bytes, grad_accum, budget,
                                                         note=f"hand-made: {name}",
                                                         updates_in_backward=updates_in_backward,
                                                         host_budget=host_budget, margin=margin)
            for name, c in choices.items()}
