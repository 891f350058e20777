"""The refusal when no plan fits: a `PlanError` of at most three short lines (the budget and the
smallest need; what dominates it; what to change), each part also an attribute of the error.

Every clause is true to the arguments the search was given: the micro-batch named is smaller
than the one traced, the host limit's source is the one that set it, and each dominant part
comes with something to change.
"""

from __future__ import annotations

import math
from typing import Optional

from elixir_ray.chunk_plan.errors import PlanError
from elixir_ray.planner.model_profile import ModelProfile
from elixir_ray.planner.search import HOST_FRACTION, Choice, SearchSettings, evaluate
from elixir_ray.units import format_bytes


def recomputes_every_block(checkpointing: Optional[list]) -> bool:
    return checkpointing is not None and all(m in (True, "full") for m in checkpointing)


def smaller_batch_hint(budget: int, need: float, activations: int, batch: int, margin: float) -> str:
    """The micro-batch that would fit, taking activations as proportional to it (an estimate: the
    caller's config or loop sets the micro-batch, and only a plan at that size is exact). At
    micro-batch 1 there is none smaller to name."""
    if batch <= 1:
        return f"use shorter sequences or a smaller model, or give the device at least {format_bytes(math.ceil(need))}"
    rest = need * (1 - margin) - activations  # what does not shrink with the micro-batch
    per_row = activations / batch
    fits = int((budget * (1 - margin) - rest) // per_row) if per_row > 0 else 0
    if fits >= 1:
        return (f"use micro-batch {min(fits, batch - 1)} or less, an estimate that takes activations as "
                f"proportional to the micro-batch")
    return (f"even micro-batch 1 needs about {format_bytes(int((rest + per_row) / (1 - margin)))}: use shorter "
            f"sequences or a smaller model, or give the device more memory")


def host_limit(settings: SearchSettings) -> str:
    """The host limit on optimizer state and what set it."""
    source = settings.host_budget_from or f"{HOST_FRACTION:.0%} of the free host RAM"
    return f"only {format_bytes(settings.host_budget or 0)} per rank may hold optimizer state ({source})"


def more_host(settings: SearchSettings) -> str:
    """How to let the host hold more: raise the limit that was given, or give one."""
    if settings.host_budget_from:
        return f"raise {settings.host_budget_from}"
    return "free host RAM or set host_memory (--host-memory)"


def _dominant_and_remedy(part: str, value: int, choice: Choice, settings: SearchSettings, need: float,
                         fully_searched: bool) -> tuple[str, str]:
    """What dominates the smallest plan's need, and what to change for it."""
    more = f"give the device at least {format_bytes(math.ceil(need))}"
    if part == "activations":
        prof = choice.layout.profile
        ckpt = prof.checkpointing
        if ckpt is not None and any(m == "selective" for m in ckpt) and not fully_searched:
            remedy = "recompute whole blocks: full activation checkpointing, or let the planner choose per block"
        elif ckpt is not None and not recomputes_every_block(ckpt) and not fully_searched:
            remedy = "enable activation checkpointing"
        else:
            remedy = smaller_batch_hint(settings.budget, need, value, prof.batch_size, settings.margin)
            if prof.checkpointing_hint:
                remedy = f"{prof.checkpointing_hint} (activation checkpointing), or {remedy}"
        return f"activations at micro-batch {prof.batch_size} need {format_bytes(value)}", remedy
    largest = _largest_parameter(choice.layout.profile)
    if part == "pool blocks":
        n = choice.n_blocks
        return (f"the pool's {n} blocks of {format_bytes(value // n)} need {format_bytes(value)}",
                f"{more}: the largest layer or parameter ({largest}) sets the block size")
    if part == "gradient staging":
        chunk = format_bytes(4 * int(choice.layout.sizes.max()))
        return (f"gradient staging needs {format_bytes(value)}",
                f"{more}, or shrink the largest parameter, {largest}: each gradient buffer is a whole fp32 chunk "
                f"({chunk}), at least its size")
    return f"{part} needs {format_bytes(value)}", more


def _largest_parameter(profile: ModelProfile) -> str:
    """Its name: a chunk holds at least it, so it sets the pool's blocks and the gradient buffers."""
    i = max(range(len(profile.numels)), key=profile.numels.__getitem__)
    return profile.names[i]


def too_small(settings: SearchSettings, smallest: dict, profiles: list[ModelProfile]) -> PlanError:
    """The refusal when no candidate of `profiles` fits. `smallest`: the search's smallest needs
    ("need", with its "choice", within the host limit; "unbounded_need", as if the host held any
    state). When a profile that recomputes every block was searched, more checkpointing is no
    advice to give (that setting needed more than the smallest plan)."""
    budget = format_bytes(settings.budget)
    if "choice" not in smallest:
        remedy = f"give the device more memory, add ranks, or {more_host(settings)}"
        return PlanError(f"no placement fits the host memory: {host_limit(settings)}\n{remedy}",
                         dominant="optimizer state the host may not hold", remedy=remedy)
    choice: Choice = smallest["choice"]
    memory, _, _, _ = evaluate(choice, settings.hw, settings.world_size, settings.elem_bytes, settings.grad_accum,
                               settings.updates_in_backward)
    part, value = max(memory.items(), key=lambda kv: kv[1])
    fully = any(recomputes_every_block(p.checkpointing) for p in profiles)
    dominant, remedy = _dominant_and_remedy(part, value, choice, settings, smallest["need"], fully)
    min_bytes = math.ceil(smallest["need"])
    need = format_bytes(min_bytes)
    unbounded = smallest.get("unbounded_need", smallest["need"])
    if settings.host_budget is None or unbounded >= 0.99 * smallest["need"]:
        return PlanError(f"device_memory {budget} is too small: the smallest plan needs {need}\nof which {dominant}"
                         f"\n{remedy}", min_bytes=min_bytes, dominant=dominant, remedy=remedy)
    roomy = format_bytes(math.ceil(unbounded))
    if unbounded <= settings.budget:  # the device would do, were the host roomier
        dominant = "optimizer state the host may not hold, kept on the device"
        remedy = f"{more_host(settings)}, or give the device at least {need}"
        return PlanError(f"host memory is too small for device_memory {budget}: {host_limit(settings)}\n"
                         f"so the rest stays on the device, where the smallest plan needs {need}; with room on the "
                         f"host for all of it, {roomy} would do\n{remedy}",
                         min_bytes=min_bytes, dominant=dominant, remedy=remedy)
    remedy = f"{remedy}, or {more_host(settings)}"
    return PlanError(f"device_memory {budget} is too small: the smallest plan needs {need}, of which {dominant}\n"
                     f"host memory sets part of that: {host_limit(settings)}; without that limit, {roomy} "
                     f"would do\n{remedy}",
                     min_bytes=min_bytes, dominant=dominant, remedy=remedy)
