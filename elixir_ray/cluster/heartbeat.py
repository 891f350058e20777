"""Each rank's liveness, seen apart from the collectives: one ping in flight per rank.

A collective's timeout names only the rank that waited: when worker 1 stops (SIGSTOP, a process
hung in a driver call), its healthy peer is the one whose gloo receive times out. So the driver
keeps a ping (`RankWorker.alive`) in flight to every rank, answered on another of the actor's
threads while a long call runs: a busy rank answers within milliseconds, a stopped or hung process
not at all, and a dead one's ping fails. How long a rank's ping has gone unanswered is what names
the rank that stopped answering.
"""

from __future__ import annotations

import time
from typing import Optional

import ray


class Heartbeats:
    """Pings to the ranks of one worker group, sent and collected by `beat()`, which the driver
    calls each time it polls (never blocking): a rank whose ping was answered gets the next one at
    once, so its silence is measured from a ping sent within one poll of its last answer."""

    def __init__(self, actors: list):
        self.actors = actors
        self.in_flight: list[Optional[tuple]] = [None] * len(actors)  # (ref, sent at) per rank
        # per rank, when the last ping it answered was sent (time.monotonic()): it was alive after that
        self.alive_after: list[Optional[float]] = [None] * len(actors)
        self.dead: dict[int, str] = {}  # rank -> the first line of the error its ping ended with

    def beat(self) -> None:
        """Collect the answers that came, note the ranks whose ping failed, send the next pings."""
        now = time.monotonic()
        flying = [entry[0] for entry in self.in_flight if entry is not None]
        ready = set(ray.wait(flying, num_returns=len(flying), timeout=0, fetch_local=True)[0]) if flying else set()
        for rank, entry in enumerate(self.in_flight):
            if entry is None or entry[0] not in ready:
                continue
            self.in_flight[rank] = None
            try:
                ray.get(entry[0])
                self.alive_after[rank] = entry[1]
            except ray.exceptions.RayError as exc:  # the actor died (or was killed): it answers no more
                self.dead[rank] = (str(exc).splitlines() or [type(exc).__name__])[0]
        for rank, actor in enumerate(self.actors):
            if self.in_flight[rank] is None and rank not in self.dead:
                self.in_flight[rank] = (actor.alive.remote(), now)

    def silent_for(self, rank: int) -> float:
        """Seconds the rank's ping in flight has gone unanswered (0 with none in flight)."""
        entry = self.in_flight[rank]
        return 0.0 if entry is None else time.monotonic() - entry[1]

    def silent(self, longer_than_s: float) -> list[int]:
        """The ranks whose ping has gone unanswered for more than `longer_than_s`."""
        return [rank for rank in range(len(self.actors)) if self.silent_for(rank) > longer_than_s]

    def answered_since(self, rank: int, since: float) -> bool:
        """Whether the rank answered a ping sent at or after `since` (a time.monotonic()): alive then."""
        after = self.alive_after[rank]
        return after is not None and after >= since
