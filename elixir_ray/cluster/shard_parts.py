"""A snapshot's shards in parts, so that a restore moves only what each rank needs.

Each rank hands its part of the training state over as one object per chunk (its slices of that
chunk's weights and AdamW moments) beside one object for the rest (step counts, buffers, its random
streams, the layout), all returned by one actor call so that the driver owns them and they outlive
the rank. A restoring rank reads the state as whole tensors (`engine.JoinedState`) over shards
whose parts are fetched on first read: it reads only its own part of each parameter, so it fetches
only the chunk objects of the ranks that hold that part. On as many ranks as made the snapshot that
is its own shard, a quarter of the state each on four ranks; a chunk replicated on every rank
comes whole from rank 0, as every rank keeps it whole.

The restore also counts what each rank read (`RestoreReads`): the bytes of the parts it fetched,
or of a checkpoint's tensors read from durable storage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

import numpy as np
import ray

from elixir_ray.checkpoint.shards import join_rank_shards
from elixir_ray.engine import JoinedState

COPY_BATCH_BYTES = 256 * 2**20  # how much of a snapshot `copy_here` pulls to the driver's node at once


@dataclass(frozen=True)
class RankShardRefs:
    """One rank's snapshot shard as object refs: `rest` ({"tensors", "layout"}) and one per chunk
    ({name: array}, empty where the rank holds none of it); `chunk_dtypes`, the name and dtype of
    each array in the chunk objects (from the call's header), so that a reader knows what is there
    without fetching it; `part_bytes`, the bytes of `rest` and of each chunk object (from the header
    too; empty where not known), so that a copy can take several objects at a time."""

    rest: ray.ObjectRef
    chunks: tuple
    chunk_dtypes: Mapping[str, str]
    part_bytes: tuple = ()

    @property
    def chunk_keys(self) -> frozenset:
        return frozenset(self.chunk_dtypes)

    @property
    def refs(self) -> list:
        return [self.rest, *self.chunks]


def chunk_count(plan) -> int:
    """The chunks of a plan's engine (0 when the plan does not say: the shard then goes whole)."""
    engine = (plan.engine if plan is not None else None) or {}
    return len(engine.get("chunk_numels") or engine.get("placements") or [])


def split_shard(header: dict, shard: dict, chunks: int) -> tuple:
    """Run on a rank: (header, rest, chunk 0, ..., chunk `chunks` - 1) of its `state_shard` result,
    the header naming the keys the chunk objects hold and the bytes of each object."""
    parts: list[dict] = [{} for _ in range(chunks)]
    rest: dict = {}
    for key, value in shard["tensors"].items():
        index = _chunk_of(key)
        if index is not None and index < chunks:
            parts[index][key] = value
        else:
            rest[key] = value
    header = {**header, "chunk_dtypes": {k: np.asarray(v).dtype.str for part in parts for k, v in part.items()},
              "part_bytes": [_nbytes(part.values()) for part in (rest, *parts)]}
    return (header, {"tensors": rest, "layout": shard["layout"]}, *parts)


def _nbytes(arrays) -> int:
    return sum(np.asarray(a).nbytes for a in arrays)


def _chunk_of(key: str) -> Optional[int]:
    head, _, tail = key.partition("/")
    return int(tail.split("/", 1)[0]) if head == "chunk" else None


def call_snapshot(group, chunks: int) -> list[tuple]:
    """Every rank's (header ref, shard) of a snapshot: the shard is one ref, or with `chunks` a
    `RankShardRefs` whose `chunk_dtypes` `with_keys` fills in once the headers are read."""
    if not chunks:
        return [tuple(pair) for pair in group.call("state_shard")]
    pairs = []
    for actor in group.actors:
        refs = actor.snapshot_parts.options(num_returns=2 + chunks).remote(chunks)
        pairs.append((refs[0], RankShardRefs(rest=refs[1], chunks=tuple(refs[2:]), chunk_dtypes={})))
    return pairs


def with_keys(shards: list, headers: list[dict]) -> list:
    """The shards with the chunk arrays and the object sizes their headers name."""
    return [RankShardRefs(s.rest, s.chunks, dict(h.get("chunk_dtypes", {})), tuple(h.get("part_bytes", ())))
            if isinstance(s, RankShardRefs) else s for s, h in zip(shards, headers)]


def all_refs(shards: list) -> list:
    """Every object ref of the shards."""
    return [ref for s in shards for ref in (s.refs if isinstance(s, RankShardRefs) else [s])]


def fetch_whole(shards: list, timeout_s: float) -> list[dict]:
    """Every rank's shard as one {"tensors", "layout"} dict (the persister's join, a liveness check)."""
    values = iter(ray.get(all_refs(shards), timeout=timeout_s))
    out = []
    for s in shards:
        if not isinstance(s, RankShardRefs):
            out.append(next(values))
            continue
        rest = next(values)
        tensors = dict(rest["tensors"])
        for _ in s.chunks:
            tensors.update(next(values))
        out.append({"tensors": tensors, "layout": rest["layout"]})
    return out


def copy_here(shards: list, timeout_s: float, batch_bytes: int = COPY_BATCH_BYTES) -> list:
    """The shards copied into this process's node's object store (the driver's copy of a snapshot),
    their objects some at a time: as many consecutive ones as `batch_bytes` holds (at least one),
    pulled with one `ray.get`. Each pull from another node waits for a round of Ray's object
    manager: one object at a time, chunk objects of 160 KiB took 0.6 s each from a simulated node
    on the 2-core CPU machine, a four-rank snapshot 20 s (2026-11-29). The batches bound what the
    driver's node holds beyond the copies; an object of unknown size goes alone."""
    refs, sizes = [], []
    for shard in shards:
        if isinstance(shard, RankShardRefs):
            refs += shard.refs
            known = len(shard.part_bytes) == len(shard.refs)
            sizes += list(shard.part_bytes) if known else [batch_bytes] * len(shard.refs)
        else:
            refs.append(shard)
            sizes.append(batch_bytes)
    batches: list[list] = []
    held = 0
    for ref, size in zip(refs, sizes):
        if not batches or held + size > batch_bytes:
            batches.append([])
            held = 0
        batches[-1].append(ref)
        held += size
    made = (ray.put(value) for batch in batches for value in ray.get(batch, timeout=timeout_s))
    out = []
    for shard in shards:
        if isinstance(shard, RankShardRefs):
            rest, *chunks = (next(made) for _ in shard.refs)
            out.append(RankShardRefs(rest, tuple(chunks), shard.chunk_dtypes, shard.part_bytes))
        else:
            out.append(next(made))
    return out


class RestoreReads:
    """The bytes one rank read to restore."""

    def __init__(self):
        self.bytes = 0

    def add(self, arrays) -> None:
        self.bytes += _nbytes(arrays)


class FetchedShard(Mapping):
    """One rank's snapshot shard whose objects are fetched on first read, counted in `reads`."""

    def __init__(self, shard: RankShardRefs, reads: RestoreReads):
        self.shard, self.reads = shard, reads
        self._rest: Optional[dict] = None
        self._chunks: dict[int, dict] = {}

    @property
    def rest(self) -> dict:
        if self._rest is None:
            self._rest = ray.get(self.shard.rest)
            self.reads.add(self._rest["tensors"].values())
        return self._rest

    def __iter__(self):
        yield from self.rest["tensors"]
        yield from sorted(self.shard.chunk_keys)

    def __len__(self) -> int:
        return len(self.rest["tensors"]) + len(self.shard.chunk_keys)

    def __contains__(self, key) -> bool:
        return key in self.shard.chunk_keys or key in self.rest["tensors"]

    def dtype_of(self, key: str) -> np.dtype:
        """A chunk array's dtype without fetching it (`engine.JoinedState` asks rank 0's shard)."""
        return np.dtype(self.shard.chunk_dtypes[key]) if key in self.shard.chunk_dtypes else self[key].dtype

    def __getitem__(self, key: str) -> np.ndarray:
        if key not in self.shard.chunk_keys:
            return self.rest["tensors"][key]
        index = _chunk_of(key)
        if index not in self._chunks:
            self._chunks[index] = ray.get(self.shard.chunks[index])
            self.reads.add(self._chunks[index].values())
        return self._chunks[index][key]


def read_snapshot(shards: list, reads: RestoreReads) -> JoinedState:
    """Run on a restoring rank: the snapshot's whole tensors, each part fetched only when this rank
    reads from it (a snapshot of whole shards is fetched whole)."""
    if not all(isinstance(s, RankShardRefs) for s in shards):
        whole = fetch_whole(shards, timeout_s=None)
        for s in whole:
            reads.add(s["tensors"].values())
        return join_rank_shards([s["tensors"] for s in whole], whole[0]["layout"])
    fetched = [FetchedShard(s, reads) for s in shards]
    return join_rank_shards(fetched, fetched[0].rest["layout"])


class CountedReads(Mapping):
    """A restore's tensors (a checkpoint's, read lazily) counting the bytes a rank reads of them; a
    plain dict of arrays came whole with its object, and counts whole."""

    def __init__(self, tensors: Mapping, reads: RestoreReads):
        self.tensors, self.reads = tensors, reads
        self._whole = isinstance(tensors, dict)
        if self._whole:
            reads.add(tensors.values())

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __contains__(self, key) -> bool:
        return key in self.tensors

    def __getitem__(self, key: str) -> np.ndarray:
        value = np.asarray(self.tensors[key])
        if not self._whole:
            self.reads.add([value])
        return value

    def read_range(self, name: str, lo: int, hi: int) -> np.ndarray:
        ranged = getattr(self.tensors, "read_range", None)
        part = ranged(name, lo, hi) if ranged is not None else np.asarray(self.tensors[name]).reshape(-1)[lo:hi]
        if not self._whole:
            self.reads.add([part])
        return part

    def spec_of(self, name: str) -> tuple[tuple, np.dtype]:
        spec = getattr(self.tensors, "spec_of", None)
        if spec is not None:
            return spec(name)
        value = np.asarray(self.tensors[name])
        return value.shape, value.dtype
