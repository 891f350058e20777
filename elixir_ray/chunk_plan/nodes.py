"""Where the ranks are: which node each rank runs on, as the engine, the planner and the cluster see it.

A chunk sharded within each node (`Plan.node_sharded`) is split among the ranks of a node and
replicated across the nodes: its shard i lives on the i-th rank of every node (the rank's local
rank), and the ranks holding the same shard on different nodes reduce its gradient together.
That needs as many ranks on every node; `NodeLayout.uniform` says whether they are.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NodeLayout:
    """`node_of_rank[r]`: the node rank r runs on, as a small integer (empty: every rank on one node)."""

    node_of_rank: tuple[int, ...]

    @classmethod
    def of(cls, node_of_rank, world: int) -> "NodeLayout":
        """The layout of `world` ranks: `node_of_rank` (a list, checked), or one node when it is empty."""
        nodes = tuple(node_of_rank or ())
        if not nodes:
            return cls((0,) * world)
        if len(nodes) != world or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in nodes):
            raise ValueError(f"node_of_rank must give each of the {world} rank(s) a node number >= 0, got "
                             f"{list(nodes)}")
        return cls(nodes)

    @property
    def world(self) -> int:
        return len(self.node_of_rank)

    @property
    def node_ranks(self) -> list[list[int]]:
        """Each node's ranks, in rank order; the nodes in the order of their first rank."""
        out: dict[int, list[int]] = {}
        for rank, node in enumerate(self.node_of_rank):
            out.setdefault(node, []).append(rank)
        return list(out.values())

    @property
    def n_nodes(self) -> int:
        return len(set(self.node_of_rank))

    @property
    def uniform(self) -> bool:
        """As many ranks on every node: what sharding within each node needs."""
        return len({len(ranks) for ranks in self.node_ranks}) == 1

    @property
    def ranks_per_node(self) -> int:
        """Ranks on each node (on uneven nodes, the fewest)."""
        return min(len(ranks) for ranks in self.node_ranks)

    def local_rank(self, rank: int) -> int:
        """The rank's position among its node's ranks."""
        return next(ranks.index(rank) for ranks in self.node_ranks if rank in ranks)

    def node_group(self, rank: int) -> list[int]:
        """The ranks on `rank`'s node."""
        return next(ranks for ranks in self.node_ranks if rank in ranks)

    @property
    def peer_groups(self) -> list[list[int]]:
        """Per local rank, the ranks that have it on their nodes, in node order: the ranks that hold the
        same shard of a chunk sharded within each node."""
        width = max(len(ranks) for ranks in self.node_ranks)
        return [[ranks[i] for ranks in self.node_ranks if i < len(ranks)] for i in range(width)]

    def peer_group(self, rank: int) -> list[int]:
        return self.peer_groups[self.local_rank(rank)]

    @property
    def first_node(self) -> list[int]:
        """The ranks on rank 0's node: they alone hand over a node-sharded chunk's state at a checkpoint."""
        return self.node_ranks[0]
