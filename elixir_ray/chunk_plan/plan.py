"""The plan: how parameters are packed into chunks, where each chunk's state lives, and what that costs.

A small versioned dataclass, JSON-serialisable, so the planner (or a user) can produce one on the
driver and every rank can run it. The engine reads only the layout fields; the predictions and
their breakdowns are there so that a user can see why the plan is what it is (`explain()`) and
check the prediction against what the run measures.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Optional, Union

from elixir_ray.chunk_plan.errors import PlanError

# 6: activation checkpointing per block by mode name, the hardware rates and the forward's compute
# the predictions rest on, the memory margin the plan was searched with, and how many chunks ahead
# the pool loads; and, empty in a plan for one node, the node of each rank, the chunks sharded
# within each node and the collectives' rates; and, empty in a plan that keeps none, the host chunks
# whose compute copy stays on the device (a plan of this version without the field keeps none). Only
# this version is read: a plan of another is made again.
PLAN_VERSION = 6
# the share of the budget a plan keeps back for the allocator unless asked otherwise (planner.search.SAFETY)
DEFAULT_MEMORY_MARGIN = 0.20


@dataclass(frozen=True)
class Plan:
    """Frozen: a plan is made once (by the planner, `manual_plan` or `from_json`) and read by every
    rank; a variant of it is `dataclasses.replace(plan, ...)`."""

    chunk_size: int  # elements per chunk (a parameter larger than this gets a chunk of its own size)
    n_blocks: int  # compute blocks in the device pool
    param_order: list[str]  # parameter names in first-use order; the packing order
    placements: list[str]  # per chunk: "host" or "device" (fp32 master, gradient shard and AdamW states)
    sharded: list[bool]  # per chunk: True to shard across ranks (all-gathered on fetch), False to replicate
    dos_gap: int = 0  # Deep Optimizer States: update every dos_gap-th host chunk on the device (0: off)
    # host chunks keep their master cast to the compute dtype too (pinned, 2 bytes per parameter with
    # bf16): uploads move half the bytes; off when host RAM is what limits the plan
    upload_copies: bool = False
    # host chunks' gradients cross to the host and wait there in bf16 (2 bytes per parameter less host
    # RAM and PCIe); the search sets it with bf16 compute and one micro-step per step, where each
    # gradient was computed in bf16 anyway and nothing accumulates on the host
    host_grads_low: bool = False
    # per checkpointable block, when the module has them: "none", "selective" or "full" (a module's
    # set_checkpointing also takes True and False, for "full" and "none")
    activation_checkpointing: Optional[list[Union[str, bool]]] = None
    world_size: int = 1
    dtype: str = ""  # compute dtype the plan was made for, e.g. "bfloat16"
    budget_bytes: int = 0  # device_memory the plan was made for (0: not planned against a budget)
    chunk_numels: list[int] = field(default_factory=list)  # per chunk: parameter elements it holds (no padding)
    predicted_peak_bytes: int = 0
    predicted_step_seconds: float = 0.0
    memory: dict[str, int] = field(default_factory=dict)  # predicted peak, by part, in bytes
    time: dict[str, float] = field(default_factory=dict)  # predicted step time, by part, in seconds
    # what the predictions rest on, so that a plan measured later can be re-costed by a newer model
    # (jobs/bench_repredict.py): the HardwareProfile's fields, the forward's share of
    # time["compute"] in seconds (one micro-step's), the micro-steps per step and whether the
    # updates were costed as starting in the last backward
    hardware: dict = field(default_factory=dict)
    forward_compute_seconds: float = 0.0
    grad_accum: int = 1
    updates_in_backward: bool = False
    # the fraction of budget_bytes kept back for the allocator (planner.search.SAFETY unless asked)
    memory_margin: float = DEFAULT_MEMORY_MARGIN
    # how many chunks ahead of the trace the pool loads (wrap's `prefetch` unless given there): the
    # planner takes as many as the pool's blocks allow (planner.search.prefetch_depth)
    prefetch_depth: int = 1
    # per chunk (empty: none): True where a sharded chunk is split among the ranks of each node
    # only and whole on every node (gathered within the node; its gradient reduce-scattered there,
    # then all-reduced among the ranks holding the same shard on the other nodes)
    node_sharded: list[bool] = field(default_factory=list)
    # per rank: the number of the node it runs on (empty: every rank on one node); node-sharded
    # chunks need as many ranks on every node
    node_of_rank: list[int] = field(default_factory=list)
    # the collectives' rates the predictions rest on and the nodes they were measured on
    # (planner.network.Network's fields; empty where none were measured)
    network: dict = field(default_factory=dict)
    # per chunk (empty: none): True where a host chunk's compute copy stays on the device, outside
    # the pool's blocks: never evicted, loaded once per step after its CPU update, instead of at
    # every use the pool cannot serve (forward, recompute, backward), for the chunk's size in the
    # compute dtype of device memory. Host chunks only: a device chunk's load is a cast on the device
    resident: list[bool] = field(default_factory=list)
    version: int = PLAN_VERSION
    notes: list[str] = field(default_factory=list)

    def __post_init__(self):
        if not self.resident:
            return
        if len(self.resident) != len(self.placements):
            raise PlanError(f"the plan's resident lists {len(self.resident)} chunks, its placements "
                            f"{len(self.placements)}")
        for i, (keep, place) in enumerate(zip(self.resident, self.placements)):
            if keep and place != "host":
                raise PlanError(f"chunk {i} is resident but its state is on the {place}: only a host chunk's "
                                f"compute copy can stay on the device")

    def is_resident(self, chunk: int) -> bool:
        """Whether the chunk's compute copy stays on the device (`resident`)."""
        return bool(self.resident) and bool(self.resident[chunk])

    @property
    def n_chunks(self) -> int:
        return len(self.placements)

    @property
    def sharding(self) -> list[str]:
        """Per chunk: "sharded" (across all ranks), "node_sharded" (within each node, replicated
        across nodes) or "replicated"."""
        node = self.node_sharded or [False] * self.n_chunks
        return ["replicated" if not s else "node_sharded" if n else "sharded" for s, n in zip(self.sharded, node)]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        if not isinstance(data, dict) or "version" not in data or "placements" not in data:
            keys = sorted(data)[:6] if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"not a plan (no version or placements; found {keys}): write one with "
                             f"`elixir-ray plan CONFIG --json FILE` or Plan.to_json()")
        if data["version"] != PLAN_VERSION:
            raise ValueError(f"plan version {data['version']} is not supported (this build reads version "
                             f"{PLAN_VERSION}); make the plan again with this version of elixir_ray")
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"plan has unknown fields {unknown}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))

    def explain(self) -> str:
        """A few lines a person can check: chunks and where they live, the pool, memory and time by part."""
        from elixir_ray.units import format_bytes

        lines = []
        n = self.n_chunks
        on_device = sum(p == "device" for p in self.placements)
        replicated = sum(not s for s in self.sharded)
        total = sum(self.chunk_numels)
        lines.append(f"plan: {n} chunks of {self.chunk_size:,} elements ({total:,} parameters), "
                     f"{self.world_size} rank(s), compute in {self.dtype or 'the default dtype'}")
        lines.append(f"  pool: {self.n_blocks} of {n} chunks resident at once"
                     + (" (the whole model)" if self.n_blocks >= n else "")
                     + (f", loading {self.prefetch_depth} chunk(s) ahead" if self.n_blocks < n else ""))
        lines.append(f"  optimizer state: {on_device} chunk(s) on the device, {n - on_device} on the host"
                     + (f"; Deep Optimizer States updates every {ordinal(self.dos_gap)} host chunk on the device"
                        if self.dos_gap else "")
                     + ("; host chunks upload from a copy in the compute dtype" if self.upload_copies else "")
                     + ("; host gradients in the compute dtype" if self.host_grads_low else ""))
        kept = [i for i in range(n) if self.is_resident(i)]
        if kept:
            size = sum(self.chunk_numels[i] for i in kept) if self.chunk_numels else 0
            lines.append(f"  resident: {len(kept)} host chunk(s) keep their compute copy on the device, outside the "
                         f"pool, loaded once per step: chunk(s) {index_ranges(kept)}"
                         + (f" ({size:,} parameters)" if size else ""))
        if self.world_size > 1:
            within = self.sharding.count("node_sharded")
            nodes = len(set(self.node_of_rank)) or 1
            lines.append(f"  across ranks: {n - replicated - within} chunk(s) sharded, "
                         + (f"{within} sharded within each node ({self.world_size // nodes} ranks) and replicated "
                            f"across the {nodes} nodes, " if within else "")
                         + f"{replicated} replicated")
        if self.activation_checkpointing is not None:
            modes = self.activation_checkpointing
            whole, selective = recomputation(modes)
            lines.append(f"  activation checkpointing: {whole} of {len(modes)} blocks recomputed whole"
                         + (f", {selective} selectively (layer norms and GELU)" if selective else ""))
        if n:
            lines.append("  chunks: " + _placement_strip(self.placements, self.sharded, self.world_size))
        if any(self.node_sharded):
            lines.append("  sharding: " + "".join({"sharded": "S", "node_sharded": "N", "replicated": "R"}[m]
                                                  for m in self.sharding)
                         + "   (S across all ranks, N within each node, R replicated)")
        lines.extend(f"  collectives {line}" for line in network_lines(self.network))
        if self.memory:
            budget = f" of {format_bytes(self.budget_bytes)} budget" if self.budget_bytes else ""
            lines.append(f"  predicted peak device memory: {format_bytes(self.predicted_peak_bytes)}{budget}")
            for part, value in sorted(self.memory.items(), key=lambda kv: -kv[1]):
                if value:
                    lines.append(f"    {part:<24} {format_bytes(value):>12}")
        if self.time:
            lines.append(f"  predicted step time: {self.predicted_step_seconds * 1e3:,.1f} ms")
            for part, value in sorted(self.time.items(), key=lambda kv: -kv[1]):
                if value:
                    lines.append(f"    {part:<24} {value * 1e3:>10,.1f} ms")
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)


NETWORK_SCOPES = {"node": "within a node", "world": "across all ranks", "peers": "between nodes"}


def network_lines(network: dict) -> list[str]:
    """Each kind of group's measured rates in a plan's `network`, and the nodes it was measured on."""
    out = []
    for scope, words in NETWORK_SCOPES.items():
        rates = network.get(scope) if network else None
        if rates:
            out.append(f"{words}: all-gather {rates['all_gather_gbps']:.3g} GB/s, reduce-scatter "
                       f"{rates['reduce_scatter_gbps']:.3g} GB/s, {rates.get('latency_s', 0) * 1e6:,.0f} us a call "
                       f"(measured on {'-'.join(rates.get('nodes') or ['?'])})")
    return out


def index_ranges(indices: list[int]) -> str:
    """Sorted indices as runs: [0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, ..., 11th, 12th, 13th, ..., 21st, 22nd."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def recomputation(modes: Optional[list]) -> tuple[int, int]:
    """(blocks recomputed whole, blocks checkpointed selectively) in a checkpointing setting (None:
    the module's own, counted as none): more of either usually means less activation memory."""
    if modes is None:
        return (0, 0)
    return (sum(m in (True, "full") for m in modes), sum(m == "selective" for m in modes))


def _placement_strip(placements: list, sharded: list, world: int) -> str:
    """One character per chunk: D device, H host; lower case when replicated across ranks."""
    out = []
    for p, s in zip(placements, sharded):
        ch = "D" if p == "device" else "H"
        out.append(ch if (s or world == 1) else ch.lower())
    legend = "D device, H host" + (", lower case replicated" if world > 1 else "")
    return "".join(out) + f"   ({legend})"
