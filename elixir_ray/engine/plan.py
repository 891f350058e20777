"""The engine's plan: how parameters are packed into chunks and where each chunk's state lives.

A small versioned dataclass, JSON-serialisable, so the planner (or a user) can produce one on the
driver and every rank can run it. `default_plan` is the built-in plan used when none is given:
all optimizer state on the host, the pool as large as the budget allows.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

ENGINE_PLAN_VERSION = 1


@dataclass
class EnginePlan:
    chunk_size: int  # elements per chunk (a parameter larger than this gets a chunk of its own size)
    n_blocks: int  # compute blocks in the device pool
    param_order: list  # parameter names in first-use order; the packing order
    placements: list  # per chunk: "host" or "device" (fp32 master, gradient shard and AdamW states)
    sharded: list  # per chunk: True to shard across ranks (all-gathered on fetch), False to replicate
    dos_gap: int = 0  # Deep Optimizer States: update every dos_gap-th host chunk on the device (0: off)
    version: int = ENGINE_PLAN_VERSION
    notes: list = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "EnginePlan":
        data = json.loads(text)
        if data.get("version") != ENGINE_PLAN_VERSION:
            raise ValueError(f"engine plan version {data.get('version')} is not supported "
                             f"(this build reads {ENGINE_PLAN_VERSION})")
        return cls(**data)
