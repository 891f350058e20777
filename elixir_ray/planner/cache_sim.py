"""Belady (farthest-next-use) simulation of the chunk pool, the way the engine evicts.

Given the sequence of chunk sets touched by each op and a number of pool blocks, count the chunk
loads. Each load is a copy in (and, for sharded chunks, a gather); the planner turns loads into
time. Pure Python with a lazy heap: fast enough for the access sequences of 10B-parameter models.
"""

from __future__ import annotations

import heapq
from typing import Collection


def count_loads(accesses: list[tuple[int, ...]], n_blocks: int, resident: Collection[int] = ()) -> int:
    """Loads needed to serve `accesses` (one tuple of chunk ids per op) with n_blocks blocks.

    Raises ValueError if one op needs more chunks than there are blocks.
    """
    return sum(loads_per_chunk(accesses, n_blocks, resident).values())


def loads_per_chunk(accesses: list[tuple[int, ...]], n_blocks: int, resident: Collection[int] = ()) -> dict[int, int]:
    """Like `count_loads`, by chunk: a host chunk's load costs a copy, a device chunk's far less.

    `resident`: chunks whose compute copy stays on the device outside the blocks (Plan.resident):
    always present, they take no block and are never loaded here (the caller costs each one's
    single load per step)."""
    if resident:
        kept = set(resident)
        accesses = [tuple(c for c in a if c not in kept) for a in accesses]
    if not accesses:
        return {}
    widest = max(len(set(a)) for a in accesses)
    if widest > n_blocks:
        raise ValueError(f"an op touches {widest} chunks but the pool has only {n_blocks} blocks")
    never = len(accesses)
    next_use: list[dict[int, int]] = [{} for _ in accesses]
    upcoming: dict[int, int] = {}
    for i in range(len(accesses) - 1, -1, -1):
        needed = set(accesses[i])
        next_use[i] = {c: upcoming.get(c, never) for c in needed}
        for c in needed:
            upcoming[c] = i
    resident: dict[int, int] = {}  # chunk -> the position it is next used at
    heap: list[tuple[int, int]] = []  # (-next use, chunk); entries that no longer match are stale
    loads: dict[int, int] = {}
    for i, op in enumerate(accesses):
        needed = next_use[i].keys()
        for c in needed:  # chunks used now rank lowest, so they are never the farthest
            if c in resident:
                resident[c] = i
                heapq.heappush(heap, (-i, c))
        for c in needed:
            if c in resident:
                continue
            loads[c] = loads.get(c, 0) + 1
            if len(resident) >= n_blocks:
                while True:
                    neg, victim = heapq.heappop(heap)
                    if resident.get(victim) == -neg:
                        break
                del resident[victim]
            resident[c] = i
            heapq.heappush(heap, (-i, c))
        for c, nu in next_use[i].items():
            resident[c] = nu
            heapq.heappush(heap, (-nu, c))
    return loads
