"""The collectives' rates between the ranks, measured where they run, and the node layout they were measured on.

Each rank of a run times an all-gather and a reduce-scatter of a chunk-sized buffer (and a
tiny all-gather, for the latency of one call) in three kinds of group (cluster/collective_rates.py):
- "node": the ranks of its node, where a chunk sharded within each node is gathered and its
  gradient reduce-scattered (NVLink or shared memory);
- "world": all ranks, where a chunk sharded across all of them is (over the network when the
  ranks span nodes);
- "peers": the ranks of its local rank on every node, among which a chunk sharded within each
  node all-reduces its gradient shard (one rank per node; every node's peers at once, as a step
  runs them).
A rate is bus bandwidth: a collective over n ranks of a buffer of B bytes (the gathered or the
reduced one) moves B (n - 1) / n bytes through each rank, and takes the latency plus that over
the rate. A plan is costed at the slowest group of each kind, and says which nodes that group
spanned (`Plan.explain`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from elixir_ray.chunk_plan.nodes import NodeLayout

SCOPES = ("node", "world", "peers")


@dataclass(frozen=True)
class GroupRates:
    """One kind of group's collectives: GB/s of bus bandwidth each, the seconds one call takes
    beyond its bytes, and the nodes of the group measured (the slowest, when several were)."""

    all_gather_gbps: float
    reduce_scatter_gbps: float
    latency_s: float = 0.0
    nodes: tuple[str, ...] = ()

    def __post_init__(self):
        for name in ("all_gather_gbps", "reduce_scatter_gbps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number of GB/s, got {value!r}")
        if isinstance(self.latency_s, bool) or not isinstance(self.latency_s, (int, float)) or not self.latency_s >= 0:
            raise ValueError(f"latency_s must be a number of seconds >= 0, got {self.latency_s!r}")
        object.__setattr__(self, "nodes", tuple(self.nodes))

    @property
    def seconds_per_gb(self) -> float:
        """A gather and a reduce of one GB: what tells a slower group from a faster one."""
        return 1 / self.all_gather_gbps + 1 / self.reduce_scatter_gbps


@dataclass(frozen=True)
class Network:
    """Where the ranks are (`node_of_rank`, with a name per node) and the rates of each kind of
    group (None where not measured: the planner then charges `HardwareProfile.collective_gbps`,
    or the host-to-device rate)."""

    node_of_rank: tuple[int, ...] = ()
    node_names: tuple[str, ...] = ()
    node: Optional[GroupRates] = None
    world: Optional[GroupRates] = None
    peers: Optional[GroupRates] = None

    def __post_init__(self):
        object.__setattr__(self, "node_of_rank", tuple(self.node_of_rank))
        object.__setattr__(self, "node_names", tuple(self.node_names))

    def layout(self, world: int) -> NodeLayout:
        return NodeLayout.of(self.node_of_rank, world)

    def rates(self, scope: str) -> Optional[GroupRates]:
        return getattr(self, scope)

    @classmethod
    def from_ranks(cls, node_of_rank: list[int], node_names: list[str], measured: list[dict]) -> "Network":
        """The rates each rank measured (`measured[rank]`: {scope: {"all_gather_gbps", "reduce_scatter_gbps",
        "latency_s"}}, as `cluster.collective_rates` returns them) combined: per kind of group, the
        slowest rank's, with the nodes of its group."""
        layout = NodeLayout.of(node_of_rank, len(measured))
        groups = {"node": layout.node_group, "world": lambda r: list(range(layout.world)), "peers": layout.peer_group}
        found = {}
        for scope in SCOPES:
            entries = [(rank, GroupRates(m[scope]["all_gather_gbps"], m[scope]["reduce_scatter_gbps"],
                                         m[scope].get("latency_s", 0.0)))
                       for rank, m in enumerate(measured) if m and m.get(scope)]
            if not entries:
                continue
            rank, slowest = max(entries, key=lambda e: e[1].seconds_per_gb)
            nodes = tuple(dict.fromkeys(_name(node_names, layout.node_of_rank[r]) for r in groups[scope](rank)))
            found[scope] = GroupRates(slowest.all_gather_gbps, slowest.reduce_scatter_gbps,
                                      max(rates.latency_s for _, rates in entries), nodes)
        return cls(node_of_rank=tuple(node_of_rank), node_names=tuple(node_names), **found)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Network":
        return cls(node_of_rank=tuple(data.get("node_of_rank", ())), node_names=tuple(data.get("node_names", ())),
                   **{s: GroupRates(**data[s]) for s in SCOPES if data.get(s)})


def _name(node_names, node: int) -> str:
    return node_names[node] if node < len(node_names) else f"node {node}"
