"""ChunkPool: at most n_blocks chunks have a compute copy at once; the rest are evicted by Belady.

Memory for the copies comes in equal-size blocks (one chunk each), which the device allocator
recycles, so the engine's device footprint is fixed by n_blocks. Eviction picks the resident
chunk whose next use, in the traced access order of a step, is farthest away. Chunks in use by
the access being served and those recomputed for the checkpointed region whose backward is running
are never evicted; the most recently used ones are passed over while another can go. A step that
needs more chunks at once than the trace did goes over n_blocks (warned once, counted).

Prefetch: after serving an access, the pool loads the next `prefetch_depth` chunks the trace needs
that this access does not (never past the end of the step: the next step's weights are not updated
yet; the plan says how many, as many as its blocks allow), evicting only a chunk whose next use
comes later than the prefetched chunk's, and beyond the next access's chunks only one no other
resident chunk outlasts after that use (`_kept_by_plain_pool`). It does not evict
the two chunks used last either (an autograd node may unpack parameters of both), so where Belady
would have evicted one of them instead (a tied embedding, used at both ends of the forward) a
prefetch can cost a load the plain pool would not make. Chunks, not accesses: a chunk holds
several modules, and the next chunk's load is issued at the first access of the chunk before it,
so on CUDA the copy (on a side stream, which first waits for the compute queued so far) overlaps
that whole chunk's compute; one access ahead, it overlapped one module's and mostly waited. On a
CPU it is done at once (same result, no overlap), which is how the bookkeeping is tested without a
GPU. A chunk whose CPU update is still running is not prefetched until it has finished (the
training thread would wait for it before queueing the compute the load is to overlap); the access
that needs it waits if it must. `counts["prefetch_lead"]` sums the accesses between each prefetch
and the use it is for.

Chunks that stay resident (`Chunk.stays_resident`, host chunks the plan keeps on the device) take
no block and are never evicted: the pool loads one at its first access of a step (or prefetches
it, as any other), and after the optimizer step `reset` marks it stale. So the prefetch window
looks past their later accesses (`chunks_ahead` is given them only at their first).
"""

from __future__ import annotations

import bisect
import warnings
from collections import OrderedDict
from typing import Optional

from torch._C import _len_torch_dispatch_stack
from torch.utils._python_dispatch import _disable_current_modes

from elixir_ray.engine.chunks import Chunk, ChunkStore
from elixir_ray.units import format_bytes


def first_uses_only(events: list[tuple[int, ...]], kept: set[int]) -> list[tuple[int, ...]]:
    """The events with each of the `kept` chunks left only in the first that uses it: after that
    access it is resident until the step ends, so nothing is to be loaded for its later ones."""
    if not kept:
        return events
    seen: set[int] = set()
    out = []
    for ev in events:
        out.append(tuple(c for c in ev if c not in kept or c not in seen))
        seen.update(c for c in ev if c in kept)
    return out


def chunks_ahead(events: list[tuple[int, ...]], depth: int) -> list[tuple[tuple[int, int], ...]]:
    """For each traced access, the next `depth` chunks the step needs that it does not (with any
    others first needed by the same access as the last of them), each as (the access that first
    needs it, chunk). Worked out once, from the end of the step backwards."""
    ahead: list[tuple[tuple[int, int], ...]] = [()] * len(events)
    if depth <= 0:
        return ahead
    width = max((len(ev) for ev in events), default=1)
    upcoming: list[tuple[int, int]] = []  # distinct chunks after the access at hand, by first use
    for i in range(len(events) - 1, -1, -1):
        ev = events[i]
        taken: list[tuple[int, int]] = []
        for j, cid in upcoming:
            if cid in ev:
                continue
            if len(taken) >= depth and j != taken[-1][0]:
                break
            taken.append((j, cid))
        ahead[i] = tuple(taken)
        upcoming = [(i, cid) for cid in dict.fromkeys(ev)] + [x for x in upcoming if x[1] not in ev]
        del upcoming[2 * (depth + width):]
    return ahead


class ChunkPool:
    def __init__(self, store: ChunkStore, n_blocks: int, events: list[tuple[int, ...]], keep_recent: int,
                 prefetch_depth: int = 1):
        self.store, self.n_blocks = store, n_blocks
        self.prefetch_depth = prefetch_depth
        self.events = events
        self.occurrences: dict[int, list[int]] = {}
        for i, ev in enumerate(events):
            for c in set(ev):
                self.occurrences.setdefault(c, []).append(i)
        self.cursor = -1
        self.recent: OrderedDict[int, None] = OrderedDict()  # most recently used last
        self.keep_recent = keep_recent
        self.pinned: set[int] = set()  # recomputed chunks whose saved views are still needed
        self.warned_overflow = False
        kept = {c.index for c in store.chunks if c.stays_resident}
        self.ahead = chunks_ahead(first_uses_only(events, kept), prefetch_depth)

    @property
    def resident(self) -> list[Chunk]:
        """The chunks holding a pool block: those with a compute copy, less those that stay resident
        outside the blocks."""
        return [c for c in self.store.chunks if c.resident and not c.stays_resident]

    def _advance(self, chunk_ids: tuple[int, ...]) -> bool:
        """Move the cursor to the next traced access of these chunks (wrapping into the next step).
        False for chunks the traced step never used (a data-dependent path): the cursor stays, and
        `engine_stats()["untraced_accesses"]` counts them."""
        occ = self.occurrences.get(chunk_ids[0])
        if not occ:
            self.store.counts["untraced_accesses"] += 1
            return False
        j = bisect.bisect_right(occ, self.cursor)
        self.cursor = occ[j] if j < len(occ) else occ[0]
        return True

    def next_use(self, chunk: int, after: Optional[int] = None) -> int:
        """The chunk's next traced access after `after` (default: the access being served), in the
        next step's numbering past the end of this one."""
        occ = self.occurrences.get(chunk)
        if not occ:
            return 1 << 60  # never used in the trace: evict first
        j = bisect.bisect_right(occ, self.cursor if after is None else after)
        return occ[j] if j < len(occ) else occ[0] + len(self.events)

    def access(self, chunk_ids, pin: bool = False) -> None:
        """Make these chunks resident, evicting others if the pool is full.

        The copies this makes are the engine's, not the model's: a dispatch mode that is on (selective
        activation checkpointing records a block's ops in forward and replays them in recompute, and
        its fetches differ between the two) must not see them, so they run with the modes set aside.
        """
        if _len_torch_dispatch_stack():
            with _disable_current_modes():
                return self._access(chunk_ids, pin)
        return self._access(chunk_ids, pin)

    def _access(self, chunk_ids, pin: bool) -> None:
        if len(chunk_ids) != 1:  # one chunk (most accesses: a module's, an unpacked view's) needs no dedupe
            chunk_ids = tuple(dict.fromkeys(chunk_ids))
            if not chunk_ids:
                return
        traced = self._advance(chunk_ids)
        # worked out on the first eviction (most accesses find their chunks resident), from the
        # recent chunks as they were before this access: `recent` is updated after the loop
        protected = None
        for cid in chunk_ids:
            chunk = self.store.chunks[cid]
            if not chunk.resident:
                resident = self.resident
                # more than one after an overflow (below); a chunk that stays resident takes no block
                while len(resident) >= self.n_blocks and not chunk.stays_resident:
                    protected = protected if protected is not None else self._protected(chunk_ids)
                    # a recent chunk may go if it must (its saved views are fetched again when
                    # unpacked); a pinned one may not: recomputed views of it are still to be read
                    candidates = [c for c in resident if c.index not in protected] or \
                                 [c for c in resident if c.index not in chunk_ids and c.index not in self.pinned]
                    if not candidates:
                        self._overflow(chunk_ids, len(resident) + 1)
                        break
                    victim = max(candidates, key=lambda c: self.next_use(c.index))
                    self._evict(victim)
                    resident.remove(victim)
                self.store.fetch(chunk)
            self.store.make_usable(chunk)
        recent = self.recent
        for cid in chunk_ids:
            if cid in recent:  # move_to_end: what pop and re-insert did, in one dict operation
                recent.move_to_end(cid)
            else:
                recent[cid] = None
            if pin:
                self.pinned.add(cid)
        if traced:  # off the trace the cursor is stale: what it would load is evicted by the next untraced
            self._prefetch(chunk_ids)  # access, and loaded again after it (every access of such a path)

    def _overflow(self, chunk_ids, blocks: int) -> None:
        """More chunks must be resident at once than the pool has blocks: a recomputed region uses
        chunks the traced step did not (a data-dependent path, such as a mixture of experts routing
        by its input). Go over the budget rather than fail; say so once, and count the most blocks."""
        counts = self.store.counts
        counts["blocks_over_plan"] = max(counts["blocks_over_plan"], blocks - self.n_blocks)
        if not self.warned_overflow:
            self.warned_overflow = True
            size = self.store.chunks[chunk_ids[0]].compute
            warnings.warn(
                f"the pool has {self.n_blocks} blocks but this step needs at least {blocks} chunks resident at once "
                f"(a recomputed region used chunks the traced step did not: a data-dependent path?), so the device "
                f"holds more than the plan budgeted, about {format_bytes(size.numel() * size.element_size())} per "
                f"extra block. Trace with sample_inputs that take the widest path, or use a plan with more blocks "
                f"(engine_stats()['blocks_over_plan'] says how many more)", stacklevel=4)

    def _protected(self, chunk_ids) -> set[int]:
        return set(chunk_ids) | set(list(self.recent)[-self.keep_recent:]) | self.pinned

    def _evict(self, victim: Chunk) -> None:
        self.store.free(victim)
        self.recent.pop(victim.index, None)

    def _prefetch(self, serving: tuple[int, ...]) -> None:
        """Load the next chunks this step's trace needs, where it costs no extra load."""
        if self.prefetch_depth <= 0 or self.cursor < 0:
            return
        window = self.ahead[self.cursor]
        chunks = self.store.chunks
        if all(chunks[cid].resident for _, cid in window):
            return  # the common case, checked first: this runs on every access
        # the last two accessed chunks too: one autograd node may have unpacked parameters from both
        protected = self._protected(serving) | set(list(self.recent)[-2:])
        resident = self.resident
        nearest = window[0][0]
        for j, cid in window:
            chunk = chunks[cid]
            if chunk.resident:
                protected.add(cid)
                continue
            if chunk.update is not None and not chunk.update.done():
                # its CPU update is still running: waiting for it here would stall the training
                # thread before it has queued the rest of this chunk's compute; a later access tries again
                return
            if len(resident) >= self.n_blocks and not chunk.stays_resident:
                later = [c for c in resident if c.index not in protected and self.next_use(c.index) > j]
                if not later:
                    return  # nothing may go without costing a load: give up, as a plain pool would wait
                victim = max(later, key=lambda c: self.next_use(c.index))
                if j != nearest and self._kept_by_plain_pool(victim, j, resident):
                    return
                self._evict(victim)
                resident.remove(victim)
            self.store.prefetch(chunk)
            self.store.counts["prefetch_lead"] += j - self.cursor
            if not chunk.stays_resident:
                resident.append(chunk)
            protected.add(cid)

    def _kept_by_plain_pool(self, victim: Chunk, j: int, resident: list) -> bool:
        """Whether a plain pool might still hold `victim` when access `j` needs a block: another
        resident chunk (those loaded for use by then too) is next needed after `j` later than the
        victim is, so that one would go instead. A prefetch further ahead than the next access's
        chunks then waits instead of costing a load the plain pool does not make: a tied embedding,
        used again at the forward's end, while the chunks just used are next needed in backward
        (without this, a GPT's forward evicted it and loaded it again). The next access's own
        chunks are loaded as before: waiting would stall on them."""
        farthest = self.next_use(victim.index)
        return any(self.next_use(c.index, after=j) > farthest for c in resident if c is not victim)

    def release_pins(self) -> None:
        self.pinned.clear()

    def reset(self) -> None:
        """After an optimizer step every compute copy is stale: drop them all (those that stay resident
        keep their storage, marked stale, for their first access of the next step to fill)."""
        self.store.free_all()
        self.recent.clear()
        self.pinned.clear()
        self.cursor = -1
