"""The engine's training state: per-rank shards for checkpoints, whole tensors for restores.

`engine_shard` gives this rank's part (its slices of every chunk's master weights and AdamW
moments) plus the layout needed to put the parts together; `assemble` is a pure function that
joins the ranks' shards into whole tensors named as the trainer's checkpoints name them:
`model/<state_dict key>`, `optim/<param>/exp_avg`, `optim/<param>/exp_avg_sq`, `optim/<param>/step`.
`load_engine_state` takes whole tensors, so a checkpoint restores onto any number of ranks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Optional

import numpy as np
import torch

from elixir_ray.engine.chunks import own_part, write_part
from elixir_ray.engine.optimizer import ChunkedAdam
from elixir_ray.engine.wrap import ChunkedModule


def layout_of(model: ChunkedModule) -> dict:
    keys_of: dict[int, list[str]] = {}
    buffers = []
    for key, t in model.module.state_dict(keep_vars=True).items():
        if id(t) in model.slot_by_param:
            keys_of.setdefault(id(t), []).append(key)
        else:
            buffers.append(key)
    return {
        "world": model.store.comm.world,
        "chunks": [_chunk_entry(c, model.store.nodes) for c in model.store.chunks],
        "slots": [{"name": s.name, "keys": keys_of.get(id(s.param), [s.name]), "chunk": s.chunk,
                   "offset": s.offset, "numel": s.numel, "shape": list(s.shape)} for s in model.slots],
        "buffers": buffers,
    }


def _chunk_entry(c, nodes) -> dict:
    """A chunk's size and sharding; a chunk sharded within each node also names the ranks whose
    shards a checkpoint joins (`shard_ranks`, in shard order): those of rank 0's node."""
    entry = {"size": c.size, "sharded": c.sharded}
    if c.node_sharded:
        entry["shard_ranks"] = list(nodes.layout.first_node)
    return entry


def shard_ranks(chunk: dict, world: int) -> list[int]:
    """The ranks whose shards hold a chunk of a layout (`layout_of`), in the order of its elements:
    every rank for a sharded chunk, those its `shard_ranks` names for one sharded within each node,
    rank 0 for a replicated chunk."""
    if not (chunk["sharded"] and world > 1):
        return [0]
    return list(chunk.get("shard_ranks", range(world)))


def engine_shard(model: ChunkedModule, optimizer: ChunkedAdam, copy: bool = True) -> dict[str, np.ndarray]:
    """This rank's slices; no collective, so every rank can hand its own part over independently.

    `copy=False` returns views of the live host state where it is on the host (12 bytes per
    parameter not duplicated): only for a caller that is done with them before training goes on,
    such as an actor method whose return Ray serialises before the call completes."""
    shard = EngineShard(model, copy=copy)
    return {name: shard[name] for name in shard}


class EngineShard(Mapping):
    """This rank's slices as a mapping that makes each array when it is read: a device-resident
    chunk's state is copied to the host one chunk at a time as a writer reaches it, not all at once,
    and host-resident state is a view (or a copy with `copy=True`). For a caller that is done with
    it before training goes on. Entries set on it (random states) are kept as given.

    A replicated chunk is whole on every rank; only rank 0 hands it over (the join reads it from
    rank 0's shard), so several ranks write no copies of it; a chunk sharded within each node is
    whole on every node, and only the ranks of rank 0's node hand theirs over."""

    def __init__(self, model: ChunkedModule, copy: bool = False):
        self.model, self.copy = model, copy
        with model.store.on_device():
            model.store.settle_all()  # updates still running on the background thread finish first
        comm = model.store.comm
        self._tensors: dict[str, torch.Tensor] = {}
        layout = model.store.nodes.layout if model.store.nodes is not None else None
        for c in model.store.chunks:
            if c.node_sharded and comm.rank not in layout.first_node:
                continue
            if comm.rank != 0 and not (c.sharded and comm.world > 1):
                continue
            self._tensors[f"chunk/{c.index}/master"] = c.master
            if c.exp_avg is not None:
                self._tensors[f"chunk/{c.index}/exp_avg"] = c.exp_avg
                self._tensors[f"chunk/{c.index}/exp_avg_sq"] = c.exp_avg_sq
        self._arrays: dict[str, np.ndarray] = {
            "slots/step": np.asarray([s.step for s in model.slots], dtype=np.int64)}
        if comm.rank == 0:
            for key, t in model.module.state_dict(keep_vars=True).items():
                if id(t) not in model.slot_by_param:
                    self._arrays[f"model/{key}"] = t.detach().float().cpu().numpy().copy()

    def __iter__(self):
        yield from self._tensors
        yield from self._arrays

    def __len__(self) -> int:
        return len(self._tensors) + len(self._arrays)

    def __contains__(self, name) -> bool:
        return name in self._tensors or name in self._arrays

    def __setitem__(self, name: str, value: np.ndarray) -> None:
        self._arrays[name] = value

    @torch.no_grad()
    def __getitem__(self, name: str) -> np.ndarray:
        if name in self._arrays:
            return self._arrays[name]
        t = self._tensors[name]
        with self.model.store.on_device():
            array = t.detach().cpu().numpy()  # a device tensor's .cpu() is a copy already
        return array.copy() if self.copy and t.device.type == "cpu" else array

    def nbytes_of(self, name: str) -> int:
        if name in self._arrays:
            return self._arrays[name].nbytes
        return self._tensors[name].numel() * self._tensors[name].element_size()

    def spec_of(self, name: str) -> tuple[tuple, np.dtype]:
        if name in self._arrays:
            return self._arrays[name].shape, self._arrays[name].dtype
        t = self._tensors[name]
        return tuple(t.shape), torch.empty((), dtype=t.dtype).numpy().dtype


class JoinedState(Mapping):
    """Whole tensors from every rank's shard (rank order), each joined only when it is read.

    A checkpoint of a large model is several times the memory at hand if every tensor is joined at
    once (12 bytes per parameter, beside the state training keeps): the writer reads one file's
    worth at a time instead, and `nbytes_of` gives its sizes without joining. Every value read is a
    fresh array, never a view of a shard (shards may be read-only object-store memory). `extra`
    entries (per-rank random states) are served as they are.
    """

    def __init__(self, shards: list[dict[str, np.ndarray]], layout: dict, extra: Optional[dict] = None):
        self.shards, self.layout, self.extra = shards, layout, dict(extra or {})
        self._where: dict[str, tuple] = {}  # name -> ("slot", slot, kind) | ("step", value) | ("buffer", key)
        steps = shards[0]["slots/step"]
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            for slot, step in zip(layout["slots"], steps):
                if f"chunk/{slot['chunk']}/{kind}" not in shards[0]:
                    continue
                if kind == "master":
                    for key in slot["keys"]:
                        self._where[f"model/{key}"] = ("slot", slot, kind)
                elif step > 0:
                    self._where[f"optim/{slot['name']}/{kind}"] = ("slot", slot, kind)
        for slot, step in zip(layout["slots"], steps):
            if step > 0:
                self._where[f"optim/{slot['name']}/step"] = ("step", float(step))
        for key in layout["buffers"]:
            self._where[f"model/{key}"] = ("buffer", key)

    def __iter__(self):
        yield from self._where
        yield from self.extra

    def __len__(self) -> int:
        return len(self._where) + len(self.extra)

    def __contains__(self, name) -> bool:
        return name in self._where or name in self.extra

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self.extra:
            return self.extra[name]
        where = self._where[name]
        if where[0] == "step":
            return np.asarray([where[1]], dtype=np.float32)
        if where[0] == "buffer":
            return np.array(self.shards[0][f"model/{where[1]}"])
        return self._slot(where[1], where[2])

    def nbytes_of(self, name: str) -> int:
        if name in self.extra:
            return self.extra[name].nbytes
        where = self._where[name]
        if where[0] == "step":
            return 4
        if where[0] == "buffer":
            return self.shards[0][f"model/{where[1]}"].nbytes
        return where[1]["numel"] * self.shards[0][f"chunk/{where[1]['chunk']}/{where[2]}"].itemsize

    def spec_of(self, name: str) -> tuple[tuple, np.dtype]:
        """(shape, dtype) of a tensor, without joining it (for a file header written before its data)."""
        if name in self.extra:
            return np.shape(self.extra[name]), np.asarray(self.extra[name]).dtype
        where = self._where[name]
        if where[0] == "step":
            return (1,), np.dtype(np.float32)
        if where[0] == "buffer":
            value = self.shards[0][f"model/{where[1]}"]
            return tuple(value.shape), np.dtype(value.dtype)
        return tuple(where[1]["shape"]), np.dtype(self.shards[0][f"chunk/{where[1]['chunk']}/{where[2]}"].dtype)

    def read_range(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Elements [lo, hi) of a tensor in its flat order, reading only those (a restoring rank
        takes just its own part of each sharded parameter)."""
        where = self._where.get(name)
        if where is None or where[0] != "slot":
            return np.asarray(self[name]).reshape(-1)[max(0, lo):max(0, hi)]
        slot = where[1]
        hi = min(hi, slot["numel"])
        lo = min(max(0, lo), hi)
        return self._chunk_range(slot["chunk"], where[2], slot["offset"] + lo, slot["offset"] + hi)

    def _slot(self, slot: dict, kind: str) -> np.ndarray:
        return self._chunk_range(slot["chunk"], kind, slot["offset"], slot["offset"] + slot["numel"]).reshape(
            slot["shape"])

    def _chunk_range(self, chunk: int, kind: str, lo: int, hi: int) -> np.ndarray:
        """Elements [lo, hi) of a whole chunk's tensor, from the ranks whose shards hold them."""
        key = f"chunk/{chunk}/{kind}"
        info = self.layout["chunks"][chunk]
        holders = shard_ranks(info, self.layout["world"])
        if len(holders) == 1 or hi == lo:
            return np.array(self.shards[holders[0]][key][lo:hi])
        n = info["size"] // len(holders)  # the i-th holder has elements [i * n, (i + 1) * n)
        pieces = [self.shards[holders[i]][key][max(lo, i * n) - i * n: min(hi, (i + 1) * n) - i * n]
                  for i in range(lo // n, (hi - 1) // n + 1)]
        return np.concatenate(pieces)


def assemble(shards: list[dict[str, np.ndarray]], layout: dict) -> dict[str, np.ndarray]:
    """Whole tensors from every rank's shard (rank order), for a world-size-independent checkpoint."""
    return dict(JoinedState(shards, layout))


@torch.no_grad()
def engine_state(model: ChunkedModule, optimizer: ChunkedAdam) -> dict[str, np.ndarray]:
    """Whole tensors on one process (single rank, or for tests); see `assemble` for several ranks."""
    if model.store.comm.world != 1:
        raise ValueError("engine_state is for one rank; with several, gather engine_shard from each and assemble")
    return assemble([engine_shard(model, optimizer)], layout_of(model))


@torch.no_grad()
def load_engine_state(model: ChunkedModule, optimizer: ChunkedAdam, tensors: Mapping) -> None:
    """Restore from whole tensors (any world size wrote them); each rank reads and keeps only its own
    part of each parameter (from a checkpoint joined lazily, `JoinedState.read_range`, only those bytes)."""
    def read(name: str, lo: int, hi: int) -> torch.Tensor:
        ranged = getattr(tensors, "read_range", None)
        part = ranged(name, lo, hi) if ranged is not None else np.asarray(tensors[name]).reshape(-1)[lo:hi]
        return torch.as_tensor(np.array(part, dtype=np.float32))

    def shape_of(name: str) -> tuple:
        spec = getattr(tensors, "spec_of", None)
        return tuple(spec(name)[0] if spec is not None else np.shape(tensors[name]))

    model.load_state_parts(_ModelTensors(tensors), lambda key, lo, hi: read(f"model/{key}", lo, hi),
                           lambda key: shape_of(f"model/{key}"))
    for c in model.store.chunks:
        for s in c.slots:
            key = f"optim/{s.name}"
            if f"{key}/exp_avg" not in tensors:
                s.step = 0
                continue
            if c.exp_avg is None:
                c.exp_avg, c.exp_avg_sq = torch.zeros_like(c.master), torch.zeros_like(c.master)
            for kind in ("exp_avg", "exp_avg_sq"):
                shape = shape_of(f"{key}/{kind}")
                if shape != tuple(s.shape) and not (math.prod(shape) == s.numel == 1):  # a 0-d one saved as [1]
                    raise RuntimeError(f"size mismatch for {key}/{kind}: the value has shape {list(shape)}, the "
                                       f"parameter {list(s.shape)}")
            lo, hi = own_part(c, s)
            if lo < hi:
                write_part(c, c.exp_avg, s, lo, hi, read(f"{key}/exp_avg", lo, hi))
                write_part(c, c.exp_avg_sq, s, lo, hi, read(f"{key}/exp_avg_sq", lo, hi))
            s.step = int(np.asarray(tensors[f"{key}/step"]).reshape(-1)[0])


class _ModelTensors(Mapping):
    """The `model/` tensors of a checkpoint under their state-dict keys, each read only if it is
    loaded whole (buffers; parameters are read by range)."""

    def __init__(self, tensors: Mapping):
        self.tensors = tensors
        self.keys_ = [k[len("model/"):] for k in tensors if k.startswith("model/")]

    def __iter__(self):
        return iter(self.keys_)

    def __len__(self) -> int:
        return len(self.keys_)

    def __contains__(self, key) -> bool:
        return f"model/{key}" in self.tensors

    def __getitem__(self, key: str) -> torch.Tensor:
        return torch.as_tensor(np.array(self.tensors[f"model/{key}"]))
