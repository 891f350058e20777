"""Which node bounds a plan's step: the largest part of the predicted step, and the node whose
rate for it the plan was costed at (a plan for ranks of different nodes takes each rate from the
slowest of them, `hardware.slowest_nodes`)."""

from __future__ import annotations

from typing import Optional

from elixir_ray.planner.network import Network

# a predicted step's time parts (planner.search.evaluate) -> the rate each one is costed at
RATE_OF_PART = {
    "compute": "compute",
    "copies host->device": "h2d_gbps",
    "copies device->host": "d2h_gbps",
    "CPU AdamW": "cpu_adam_params_per_s",
    "device AdamW": "device_adam_params_per_s",
    "Deep Optimizer States": "device_adam_params_per_s",
    "engine kernels": "device_adam_params_per_s",
    "all-gather": "network",
    "gradient reduce": "network",
}


def bounding_note(time: dict, slowest_nodes: Optional[dict], network: Optional[Network]) -> Optional[str]:
    """One line naming the node that bounds the step, or None for ranks of one node (`slowest_nodes`
    None: nothing to name)."""
    if slowest_nodes is None:
        return None
    part, seconds = max(((p, v) for p, v in time.items() if p in RATE_OF_PART), key=lambda kv: kv[1],
                        default=(None, 0.0))
    if part is None or seconds <= 0:
        return None
    rate = RATE_OF_PART[part]
    if rate == "network":
        measured = [r for r in (network.world, network.peers, network.node) if r is not None] if network else []
        slowest = max(measured, key=lambda r: r.seconds_per_gb, default=None)
        where = f"the collectives' rates measured on {'-'.join(slowest.nodes)}" if slowest is not None else None
    else:
        node = slowest_nodes.get(rate)
        where = f"node {node}'s rate, the slowest of the ranks' for it" if node else "a rate every node measured alike"
    if where is None:
        return None
    return f"the step is bound by {part} ({seconds * 1e3:,.1f} ms, its largest part), at {where}"
