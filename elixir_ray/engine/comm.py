"""Comm: the few collectives the engine needs, made safe for a process to exit after them.

Two things here exist only so that a rank can end without aborting.

The default group is looked up at each use, not held: held, it would outlive
`destroy_process_group` with the engine (which sits in reference cycles) and be torn down during
interpreter exit.

Over gloo, a collective returns only once gloo has let go of the tensors it was given. Gloo runs a
collective on one of its own threads, which drops its reference to the Work a moment after
`wait()` returns, and sometimes much later on a busy machine. If that Work is then the last owner
of a tensor whose Python object the caller has already dropped (a temporary, say), the gloo
thread must take the GIL to free that object, and a thread that takes the GIL while the
interpreter is exiting is ended in a way C++ cannot survive: "terminate called without an active
exception", SIGABRT, after the rank's work is done. This is not rare, because the group usually
lives to the end of the process: when `torch._dynamo` is first imported after
`init_process_group` (a traced forward, an optimizer step or `torch.compile` imports it), torch
captures the default group in function defaults, and `destroy_process_group` can no longer free
it or stop gloo's threads. A 4-rank script on 2 cores whose ranks exit right after a collective
aborted in 5 of 10 runs; keeping each Work for a few collectives more still aborted in 6 of 20,
since the gloo thread can be that late. Waiting for the tensors' use counts to come back is
exact. It is almost always immediate.

With NCCL nothing is waited for: its Works are let go by a watchdog thread on its own schedule.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from elixir_ray.chunk_plan.nodes import NodeLayout

RELEASE_TIMEOUT_S = 10.0  # a gloo thread is never this late; tensors still held then are kept for good


class Comm:
    """The few collectives the engine needs; a single rank needs none."""

    def __init__(self, group: Optional[dist.ProcessGroup], device: torch.device):
        self._default = group is not None and group is dist.group.WORLD
        self._group = None if self._default else group
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        nccl = group is not None and "nccl" in str(dist.get_backend(group))  # or "cpu:gloo,cuda:nccl"
        self.compute_device = device
        self.device = device if nccl else torch.device("cpu")  # where small collectives' tensors live
        self._wait_release = not nccl
        self._unreleased: list[torch.Tensor] = []  # what gloo had not let go of after RELEASE_TIMEOUT_S

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        return dist.group.WORLD if self._default else self._group

    def _run(self, collective, *args, **kwargs) -> None:
        """Run `collective` to completion; over gloo, also until gloo holds none of its tensors."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        counts = [t._use_count() for t in tensors] if self._wait_release else None
        work = collective(*args, group=self.group, async_op=True, **kwargs)
        work.wait()
        del work  # ours; the gloo thread's goes when it is done with the Work
        if counts is not None:
            self._await_release(tensors, counts)

    def _await_release(self, tensors: list[torch.Tensor], counts: list[int]) -> None:
        deadline = time.monotonic() + RELEASE_TIMEOUT_S
        pause = 0.0
        while any(t._use_count() > n for t, n in zip(tensors, counts)):
            if time.monotonic() > deadline:
                self._unreleased.extend(tensors)
                return
            time.sleep(pause)
            pause = min(2 * pause + 1e-5, 1e-3)

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        # torch 2.13 renamed these collectives (the old names warn); older releases have only the old names
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._run(gather, out, shard)

    def reduce_scatter_mean(self, out: torch.Tensor, full: torch.Tensor) -> None:
        full.div_(self.world)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        self._run(scatter, out, full)

    def all_reduce_mean(self, t: torch.Tensor) -> None:
        t.div_(self.world)
        self._run(dist.all_reduce, t)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return self._small(t, dist.ReduceOp.SUM)

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        return self._small(t, dist.ReduceOp.MAX)

    def broadcast_text(self, text: Optional[str]) -> str:
        """Group rank 0's `text` on every rank (a plan as JSON: sent as bytes, never pickled)."""
        if self.world == 1:
            return text
        src = dist.get_global_rank(self.group, 0)
        data = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8) if self.rank == 0 else None
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=self.device)
        self._run(dist.broadcast, size, src)
        buf = data.to(self.device) if data is not None else torch.empty(int(size), dtype=torch.uint8,
                                                                         device=self.device)
        self._run(dist.broadcast, buf, src)
        return buf.cpu().numpy().tobytes().decode()

    def _small(self, t: torch.Tensor, op) -> torch.Tensor:
        if self.world == 1:
            return t
        moved = t.to(self.device)
        self._run(dist.all_reduce, moved, op=op)
        return moved.to(t.device)


class NodeComms:
    """A rank's groups for chunks sharded within each node (`Plan.node_sharded`): `node`, the ranks
    of its node, where such a chunk is gathered and its gradient reduce-scattered; `peers`, the
    ranks of its local rank on every node, which hold the same shard and all-reduce its gradient.

    `torch.distributed.new_group` is a collective of the whole group: every rank makes every
    sub-group, in the same order, even those it is not in. Sub-groups are held, as they have no
    lookup like the default group's; their collectives wait for gloo to let go of the tensors too."""

    def __init__(self, comm: Comm, layout: NodeLayout):
        if not layout.uniform:
            sizes = sorted({len(ranks) for ranks in layout.node_ranks})
            raise ValueError(f"chunks sharded within each node need as many ranks on every node, found nodes of "
                             f"{sizes} ranks (node_of_rank {list(layout.node_of_rank)})")
        group = comm.group

        def global_ranks(ranks: list[int]) -> list[int]:
            return [dist.get_global_rank(group, r) for r in ranks]

        node = [dist.new_group(global_ranks(ranks)) for ranks in layout.node_ranks]
        peers = [dist.new_group(global_ranks(ranks)) for ranks in layout.peer_groups]
        self.layout = layout
        self.local_rank = layout.local_rank(comm.rank)
        self.node = Comm(node[layout.node_ranks.index(layout.node_group(comm.rank))], comm.compute_device)
        self.peers = Comm(peers[self.local_rank], comm.compute_device)
