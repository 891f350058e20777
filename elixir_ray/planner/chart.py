"""The plan as a picture: predicted device memory over one step, beside where each chunk lives."""

from __future__ import annotations

import numpy as np

from elixir_ray.chunk_plan.plan import Plan
from elixir_ray.planner.cost import STATE_BYTES, dos_mask
from elixir_ray.planner.model_profile import ModelProfile
from elixir_ray.planner.search import plan_buffers_by_sample, plan_layout
from elixir_ray.units import format_bytes


def memory_timeline(plan: Plan, profile: ModelProfile, elem_bytes: int) -> dict[str, np.ndarray]:
    """Per moment of one step: bytes of device optimizer state, resident compute copies and buffers, pool blocks,
    gradient and copy buffers, and activations.

    The moments are the trace's memory samples (each parameter access and each gradient's arrival),
    then the optimizer step. The pool fills as chunks are first used and then stays full (eviction
    only swaps); activations are the most alive since the moment before, as traced (saved ones,
    backward's gradients, recomputed blocks), so the curve reaches the activation peak even where
    it falls between two moments (a GPT's logits and their gradient, after the last parameter is
    read); the buffers are those the planner counts at each moment (`plan_buffers_by_sample`), and
    at the step every device chunk's gradient (none where they are released once applied in
    backward) with the Deep Optimizer States buffer. A trace
    without samples (a profile from an older version) is drawn per access, its buffers flat.
    """
    lay = plan_layout(profile, plan)
    trace = profile.trace
    block = int(lay.sizes.max()) * elem_bytes
    device = np.array([p == "device" for p in plan.placements])
    state = plan.memory.get("optimizer state on device", float((STATE_BYTES * lay.shards)[device].sum()))
    # resident compute copies (Plan.resident) are held from wrap on, as the state is
    fixed = float(state) + profile.buffer_bytes + float(plan.memory.get("resident compute copies", 0))
    seen: set[int] = set()
    pool = []
    backward = [i for i, ph in enumerate(trace.phases) if ph != "forward"]
    first_backward = backward[0] if backward else len(trace.phases)
    for chunks in lay.events:
        seen.update(chunks)
        pool.append(min(plan.n_blocks, len(seen)) * block)
    buffers = plan_buffers_by_sample(plan, lay, elem_bytes)
    if buffers is None or not pool:
        acts = list(trace.live_high or trace.live_before) or [0] * len(lay.events)
        n = len(lay.events)
        others = float(sum(plan.memory.get(k, 0) for k in _BUFFER_PARTS))  # drawn flat
        return {"state": np.full(n, fixed), "pool": np.array(pool, dtype=float),
                "activations": np.array(acts, dtype=float), "buffers": np.full(n, others),
                "first_backward": np.array([first_backward])}
    # samples at even moments are accesses (all but the last, which covers the end); odd ones gradients
    ends = np.array([end for _, end in trace.memory_samples])
    access = np.cumsum((ends % 2 == 0) & (np.arange(len(ends)) < len(ends) - 1)) - 1
    access = np.clip(access, 0, len(pool) - 1)
    n = len(ends) + 1
    first = int(np.searchsorted(access, first_backward)) if first_backward < len(pool) else len(ends)
    return {"state": np.full(n, fixed), "pool": np.append(np.array(pool, dtype=float)[access], pool[-1]),
            "activations": np.append(lay.event_activations.astype(float), 0.0),
            "buffers": buffers, "first_backward": np.array([first])}


_BUFFER_PARTS = ("gradient staging", "gradients of device chunks", "fetch conversion", "Deep Optimizer States buffer")


def write_plan_chart(plan: Plan, profile: ModelProfile, elem_bytes: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = memory_timeline(plan, profile, elem_bytes)
    # a budget far above the peak (a CPU's free RAM, say) would flatten every curve: it is named, not drawn
    budget_drawn = 0 < plan.budget_bytes <= 3 * plan.predicted_peak_bytes
    top = plan.budget_bytes if budget_drawn else plan.predicted_peak_bytes
    gib, unit = (2**30, "GiB") if top >= 2**30 else (2**20, "MiB")
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2.2, 1]})
    x = np.arange(len(t["pool"]))
    ax.stackplot(x, t["state"] / gib, t["pool"] / gib, t["buffers"] / gib, t["activations"] / gib,
                 labels=["optimizer state on device + module buffers"
                         + (" + resident compute copies" if plan.memory.get("resident compute copies") else ""),
                         "pool blocks",
                         "gradient and copy buffers, device chunks' gradients", "activations"],
                 colors=["#4c72b0", "#55a868", "#8172b2", "#dd8452"], alpha=0.85)
    if budget_drawn:
        ax.axhline(plan.budget_bytes / gib, color="black", linestyle="--", linewidth=1, label="budget")
        margin = plan.memory_margin
        ax.axhline(plan.budget_bytes * (1 - margin) / gib, color="black", linestyle=":", linewidth=1,
                   label=f"usable: budget less {margin:.0%} margin")
    ax.axhline(plan.predicted_peak_bytes / gib, color="#c44e52", linestyle=":", linewidth=1, label="predicted peak")
    total = t["state"] + t["pool"] + t["buffers"] + t["activations"]
    worst = int(np.argmax(total))  # often one moment wide (backward's first gradients): marked, or it is not seen
    ax.plot([worst], [total[worst] / gib], marker="v", color="#c44e52", markersize=7, linestyle="none",
            label="its moment")
    ax.axvline(int(t["first_backward"][0]), color="grey", linestyle=":", linewidth=1, label="backward starts")
    ax.set_xlabel("moment of one training step (parameter accesses and gradient arrivals, then the step)")
    ax.set_ylabel(unit)
    off_chart = (f", budget {format_bytes(plan.budget_bytes)} above the chart"
                 if plan.budget_bytes and not budget_drawn else "")
    ax.set_title(f"predicted device memory (peak {format_bytes(plan.predicted_peak_bytes)}{off_chart})")
    ax.set_ylim(0, top / gib * 1.1)
    # below the axes: inside, it covered the budget's lines (drawn at the top of the curves' range)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize=8, ncol=3)
    host = np.array([p != "device" for p in plan.placements])
    dos = dos_mask(host, plan.dos_gap)
    sizes = np.array(plan.chunk_numels, dtype=float) / 1e6
    colors = ["#4c72b0" if not h else ("#c44e52" if d else "#8c8c8c") for h, d in zip(host, dos)]
    bx.barh(np.arange(len(sizes)), sizes, color=colors)
    bx.set_xlim(0, float(sizes.max(initial=0)) * 1.05 or 1.0)
    bx.invert_yaxis()
    bx.set_xlabel("parameters (millions)")
    bx.set_ylabel("chunk (first-use order)")
    bx.set_title(f"{len(sizes)} chunks, pool of {plan.n_blocks}")
    from matplotlib.patches import Patch

    bx.legend(handles=[Patch(color="#4c72b0", label="state on device"), Patch(color="#8c8c8c", label="state on host"),
                       Patch(color="#c44e52", label="host, updated on device (DOS)")], fontsize=8,
              loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)  # below the bars: never over one
    fig.suptitle(f"{plan.predicted_step_seconds * 1e3:,.1f} ms predicted per step")
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110, bbox_inches="tight")  # the legends below the axes included
    plt.close(fig)
    import os

    os.replace(tmp, path)
