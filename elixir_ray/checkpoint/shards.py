"""Checkpoints the workers write themselves: each rank's shard of the engine state in files of its own.

A large model's state (12 bytes per parameter: 120 GB at 10B parameters) does not fit in the Ray
object store beside the state training keeps in host memory, and joining it into whole tensors on
one machine would need it all there. So each rank streams its shard (its slices of every chunk's
master weights and AdamW moments, as `engine_shard` gives them) straight from its live host state
into `rank-RRRRR-part-PPPPP.safetensors` files, and the driver commits them with a manifest that
also records the layout. A reader still sees whole tensors: `open_shards` maps each rank's files
and joins a tensor across them only when it is read (`engine.JoinedState`), reading just that
tensor's bytes, so a checkpoint restores onto any number of ranks and its weights export alike.

Nothing here imports Ray: the cluster layer calls it on the workers and on the driver.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections.abc import Mapping
from typing import Optional

import numpy as np

from elixir_ray import storage
from elixir_ray.checkpoint import safetensors_io
from elixir_ray.checkpoint.manifest import confined_path
from elixir_ray.engine import JoinedState
from elixir_ray.engine.state import shard_ranks

SHARDS_FORMAT = "elixir_ray.checkpoint/2"  # one checkpoint directory of rank shards plus the layout
PART_BYTES = 2**30


def rank_file(rank: int, part: int) -> str:
    return f"rank-{rank:05d}-part-{part:05d}.safetensors"


def split_parts(tensors: Mapping, part_bytes: int = PART_BYTES) -> list[list[str]]:
    """Tensor names, in files of at most `part_bytes` (or one tensor). A mapping that joins each
    tensor when it is read (`engine.JoinedState`) says its sizes through `nbytes_of`, so that only one
    part's tensors are ever in memory at once."""
    nbytes_of = getattr(tensors, "nbytes_of", None) or (lambda name: np.asarray(tensors[name]).nbytes)
    parts: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        nbytes = nbytes_of(name)
        if parts[-1] and size + nbytes > part_bytes:
            parts.append([])
            size = 0
        parts[-1].append(name)
        size += nbytes
    return parts


def write_rank_shard(work_uri: str, rank: int, shard: Mapping[str, np.ndarray],
                     part_bytes: int = PART_BYTES, on_bytes=None) -> dict[str, dict]:
    """Stream one rank's shard into its files under `work_uri` (a checkpoint directory that is not
    committed yet); returns each file's entry for the manifest. The arrays may be views of the live
    state: each is written as it is, without a copy, while training waits. `on_bytes` hears of each
    block written."""
    fs, root = storage.resolve(work_uri)
    spec = safetensors_io.spec_of_mapping(shard)
    files = {}
    for i, names in enumerate(split_parts(shard, part_bytes)):
        name = rank_file(rank, i)
        with fs.open_output_stream(f"{root}/{name}") as out:
            sha256, nbytes = safetensors_io.write(out, names, shard.__getitem__, spec, on_bytes=on_bytes)
        storage.sync_to_disk(fs, f"{root}/{name}")  # on the disk before the driver's commit
        files[name] = {"sha256": sha256, "bytes": nbytes, "rank": rank}
    return files


class _CheckpointFiles:
    """A checkpoint directory's files, each opened on its first read. Pickled (to reach the workers
    of a restore) it is only its URI: each process opens the files itself."""

    def __init__(self, uri: str, fs=None, root: Optional[str] = None):
        self.uri = uri
        self._fs, self._root = (fs, root) if fs is not None else (None, None)
        self._open: dict = {}
        self._lock = threading.Lock()  # a file's position is shared by seek and readinto

    def __getstate__(self):
        return {"uri": self.uri}

    def __setstate__(self, state):
        self.__init__(state["uri"])

    def _file(self, name: str):
        if self._fs is None:
            self._fs, self._root = storage.resolve(self.uri)
        f = self._open.get(name)
        if f is None:
            f = self._open[name] = self._fs.open_input_file(confined_path(self._fs, self._root, name))
        return f

    def read_at(self, name: str, nbytes: int, offset: int) -> bytes:
        with self._lock:
            data = self._file(name).read_at(nbytes, offset)
        if len(data) != nbytes:
            raise OSError(f"{self.uri}/{name}: read {len(data)} of {nbytes} bytes at {offset} (truncated?)")
        return data

    def read_into(self, name: str, offset: int, out: np.ndarray) -> np.ndarray:
        """Fill `out` (C-contiguous) from the file at `offset`: one copy, into a writable array."""
        with self._lock:
            f = self._file(name)
            f.seek(offset)
            got = f.readinto(memoryview(out.reshape(-1).view(np.uint8))) if out.nbytes else 0
        if got != out.nbytes:
            raise OSError(f"{self.uri}/{name}: read {got} of {out.nbytes} bytes at {offset} (truncated?)")
        return out


class FileArray:
    """One tensor of a safetensors file, read when sliced: a rank's chunk slice joined into whole
    tensors reads only each tensor's bytes, never the file."""

    def __init__(self, files: _CheckpointFiles, name: str, offset: int, dtype: np.dtype, shape: tuple):
        self.files, self.name, self.offset = files, name, offset
        self.dtype, self.shape = np.dtype(dtype), tuple(shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index) -> np.ndarray:
        if self.ndim == 1 and isinstance(index, slice):
            lo, hi, step = index.indices(self.shape[0])
            if step == 1:
                return self.flat(lo, hi)
        return self.read()[index]

    def flat(self, lo: int, hi: int) -> np.ndarray:
        """Elements [lo, hi) in flat order, reading only their bytes."""
        lo, hi = max(0, lo), min(max(lo, hi), self.size)
        out = np.empty(max(0, hi - lo), dtype=self.dtype)
        return self.files.read_into(self.name, self.offset + lo * self.itemsize, out)

    def read(self) -> np.ndarray:
        return self.files.read_into(self.name, self.offset, np.empty(self.shape, dtype=self.dtype))

    def __array__(self, dtype=None, copy=None):
        out = self.read()
        return out.astype(dtype) if dtype is not None else out


def _file_arrays(files: _CheckpointFiles, name: str, info: dict) -> list[tuple[str, FileArray]]:
    """Each tensor of one file (its manifest entry says its size), read from the header only."""
    header, data_start = safetensors_io.read_header(functools.partial(files.read_at, name), info["bytes"])
    return [(key, FileArray(files, name, data_start + entry["data_offsets"][0],
                            safetensors_io.dtype_of(entry["dtype"]), tuple(entry["shape"])))
            for key, entry in header.items()]


def join_rank_shards(shards: list[Mapping], layout: dict) -> JoinedState:
    """Whole tensors from every rank's shard (rank order), each joined when read; each rank's random
    streams stay its own (`rng/rank<R>/...`), restored per rank."""
    rng = {}
    for rank, shard in enumerate(shards):
        for key in ("rng/torch_cpu", "rng/torch_cuda"):
            if key in shard:
                rng[f"rng/rank{rank}/{key.split('/')[1]}"] = np.asarray(shard[key])
    return JoinedState(list(shards), layout, extra=rng)


def open_shards(uri: str, manifest: dict, fs=None, root: Optional[str] = None) -> JoinedState:
    """A shards checkpoint (`uri` names its directory; `fs` and `root` as for `open_tensors`) as whole
    tensors, read lazily. Only the chunk slices are left in the files; the small tensors (step counts,
    buffers, random states) are read now. Raises ValueError for files that do not match the manifest."""
    files = _CheckpointFiles(uri, fs, root)
    world = manifest["shards"]["world"]
    shards: list[dict] = [{} for _ in range(world)]
    for name, info in sorted(manifest["files"].items()):
        rank = info.get("rank")
        if not isinstance(rank, int) or not 0 <= rank < world:
            raise ValueError(f"{name} has no rank below the world size {world} in the manifest")
        for key, value in _file_arrays(files, name, info):
            shards[rank][key] = value if key.startswith("chunk/") else value.read()
    for rank, shard in enumerate(shards):
        if "slots/step" not in shard:
            raise ValueError(f"rank {rank}'s files hold no step counts (a file is missing from the manifest?)")
    _check_fits_layout(shards, manifest["shards"]["layout"])
    return join_rank_shards(shards, manifest["shards"]["layout"])


def _check_fits_layout(shards: list[dict], layout: dict) -> None:
    """The ranks' arrays are what the layout (checked itself, `manifest.check_layout`) says: each
    chunk's tensors one-dimensional, of the chunk's size or one rank's share of it, on every rank
    that holds a share; a step count per slot and every buffer on rank 0. A join then never reads
    past an array or misses one."""
    world = len(shards)
    for i, chunk in enumerate(layout["chunks"]):
        holders = shard_ranks(chunk, world)
        length = chunk["size"] // len(holders)
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            key = f"chunk/{i}/{kind}"
            if key not in shards[0] and kind != "master":
                continue  # moments not made yet (no step taken)
            for rank in holders:
                value = shards[rank].get(key)
                if value is None or tuple(value.shape) != (length,):
                    found = "none" if value is None else f"shape {list(value.shape)}"
                    raise ValueError(f"rank {rank}'s {key} has {found}, its layout says [{length}]")
    steps = shards[0]["slots/step"]
    if steps.shape != (len(layout["slots"]),) or steps.dtype.kind not in "iu":
        raise ValueError(f"rank 0's step counts are {steps.dtype}{list(steps.shape)}, its layout has "
                         f"{len(layout['slots'])} slots")
    missing = [key for key in layout["buffers"] if f"model/{key}" not in shards[0]]
    if missing:
        raise ValueError(f"rank 0's files hold no buffer {missing[0]!r} of its layout")


def check_listed(joined: Mapping, manifest: dict) -> None:
    """A worker-written checkpoint's tensors are the ones its manifest lists, with the listed shapes:
    what a reader checks before building a model is what it then reads."""
    listed = manifest["tensors"]
    for name in joined:
        if name not in listed:
            raise ValueError(f"the files hold tensor {name!r}, which the manifest does not list")
        shape = list(joined.spec_of(name)[0])
        if shape != listed[name]["shape"]:
            raise ValueError(f"tensor {name!r} has shape {shape} in the files, {listed[name]['shape']} in the manifest")
    missing = sorted(set(listed) - set(joined))
    if missing:
        raise ValueError(f"the manifest lists tensors no file holds: {missing[:3]}")


class CheckpointTensors(Mapping):
    """A whole-tensor checkpoint's tensors (format 1), each read from its file only when used: a
    restore or an export never holds the whole state. Pickled, it is the files' URI and offsets,
    so a restore's workers read the tensors themselves."""

    def __init__(self, arrays: dict[str, FileArray]):
        self.arrays = arrays

    def __iter__(self):
        return iter(self.arrays)

    def __len__(self) -> int:
        return len(self.arrays)

    def __contains__(self, name) -> bool:
        return name in self.arrays

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name].read()

    def read_range(self, name: str, lo: int, hi: int) -> np.ndarray:
        return self.arrays[name].flat(lo, hi)

    def nbytes_of(self, name: str) -> int:
        return self.arrays[name].nbytes

    def spec_of(self, name: str) -> tuple[tuple, np.dtype]:
        return self.arrays[name].shape, self.arrays[name].dtype


def open_tensors(uri: str, manifest: dict, fs=None, root: Optional[str] = None) -> CheckpointTensors:
    """A whole-tensor checkpoint (`uri` names its directory; `fs` and `root`, when given, are how this
    process opens it) as tensors read lazily. Raises ValueError for files that do not match the manifest."""
    files = _CheckpointFiles(uri, fs, root)
    arrays: dict[str, FileArray] = {}
    listed = manifest["tensors"]
    for name, info in sorted(manifest["files"].items()):
        for key, array in _file_arrays(files, name, info):
            entry = listed.get(key)
            if entry is None or entry.get("file") != name:
                raise ValueError(f"{name} holds tensor {key!r}, which the manifest "
                                 + ("does not list" if entry is None else f"puts in {entry.get('file')!r}"))
            if list(array.shape) != entry["shape"] or str(array.dtype) != entry["dtype"]:
                raise ValueError(f"tensor {key!r} is {array.dtype}{list(array.shape)} in {name}, "
                                 f"{entry['dtype']}{entry['shape']} in the manifest")
            arrays[key] = array
    missing = sorted(set(listed) - set(arrays))
    if missing:
        raise ValueError(f"the manifest lists tensors no file holds: {missing[:3]}")
    return CheckpointTensors(arrays)


def tensor_entries(joined: JoinedState) -> dict[str, dict]:
    """The manifest's `tensors` (name -> shape and dtype of the whole tensor), as the whole-tensor
    format lists them, so that compatibility checks read both formats alike."""
    out = {}
    for name in joined:
        shape, dtype = joined.spec_of(name)
        out[name] = {"shape": list(shape), "dtype": str(np.dtype(dtype))}
    return out


def verify_files(fs, root: str, files: dict, block_bytes: int = 64 * 2**20) -> Optional[str]:
    """Stream every file under `root` on `fs` through sha256 (nothing kept); the first mismatch or
    unreadable file, or None."""
    for name, info in sorted(files.items()):
        digest, size = hashlib.sha256(), 0
        try:
            path = confined_path(fs, root, name)
        except ValueError as exc:
            return str(exc)
        try:
            with fs.open_input_stream(path) as f:
                while True:
                    block = f.read(block_bytes)
                    if not block:
                        break
                    digest.update(block)
                    size += len(block)
        except OSError as exc:
            return f"cannot read {name}: {exc}"
        if digest.hexdigest() != info.get("sha256"):
            return f"{name} does not match its checksum"
        if "bytes" in info and size != info["bytes"]:
            return f"{name} has {size} bytes, its manifest says {info['bytes']}"
    return None
