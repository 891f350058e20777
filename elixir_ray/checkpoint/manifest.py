"""What a checkpoint's manifest may say, checked before anything it names is opened or allocated.

A checkpoint directory may come from someone else (a shared bucket, a downloaded run), so its
manifest is input, not our own record. Every file it names must be a plain name inside the
directory: no separator, no `..`, no absolute path, and on a local filesystem no symlink leading
out of it (`confined_path`). Every number (the step, file sizes, shapes, the world size, chunk
sizes, offsets) must be a Python integer in range, so that a forged value is refused in one line
naming it, never a read from elsewhere, an allocation that runs out of memory or a traceback.

The functions here raise ValueError with that line; the store prefixes the checkpoint's path and
raises CheckpointError, so that a reader falls back to the previous checkpoint.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 64 * 2**20  # far above any manifest written (a 10B model's is well under 1 MiB)
_SHA256 = re.compile(r"[0-9a-f]{64}")


def is_count(value: Any) -> bool:
    """A whole number >= 0 as JSON gives it (an int, never a bool or a float)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def file_name_problem(name: Any) -> str | None:
    """Why `name` cannot be a file of a checkpoint directory, or None: only a plain name in the
    directory itself (what the writers write), never a path that could lead out of it on any
    filesystem (`..`, an absolute path, a separator of any platform)."""
    if not isinstance(name, str) or not name:
        return f"names a file {name!r}, which is not a file name"
    if name in (".", "..") or "/" in name or "\\" in name or "\0" in name or os.path.isabs(name):
        return f"names file {name!r}, which is not a plain name inside its directory"
    return None


def confined_path(fs, root: str, name: str) -> str:
    """`root/name`, refused (ValueError naming the file) when `name` is not a plain name or, on a local
    filesystem, when the path resolves outside `root` (a symlink out of the checkpoint directory)."""
    problem = file_name_problem(name)
    if problem is not None:
        raise ValueError(f"the manifest {problem}")
    path = f"{root}/{name}"
    if fs.type_name == "local":
        base, real = os.path.realpath(root), os.path.realpath(path)
        if os.path.commonpath([base, real]) != base:
            raise ValueError(f"{name} is a link to {real}, outside its checkpoint directory")
    return path


def _count(where: str, value: Any) -> int:
    if not is_count(value):
        raise ValueError(f"its manifest's {where} is {value!r}, not a whole number >= 0")
    return value


def _shape(where: str, value: Any) -> list[int]:
    if not isinstance(value, list) or not all(is_count(d) for d in value):
        raise ValueError(f"its manifest's {where} is {value!r}, not a list of whole numbers >= 0")
    return value


def check_manifest(manifest: dict, *, shards: bool) -> None:
    """Every field a reader uses, checked with Python integers (the format, step, files and tensors
    are known to be there, `store._read_manifest`); `shards`: a worker-written checkpoint, whose
    files carry their rank and whose layout joins them. Raises ValueError with one line."""
    _count("step", manifest["step"])
    for name, info in manifest["files"].items():
        problem = file_name_problem(name)
        if problem is not None:
            raise ValueError(f"its manifest {problem}")
        if not isinstance(info, dict):
            raise ValueError(f"its manifest's entry for {name} is {info!r}, not a mapping")
        if not isinstance(info.get("sha256"), str) or not _SHA256.fullmatch(info["sha256"]):
            raise ValueError(f"its manifest's checksum of {name} is {info.get('sha256')!r}, not a sha256 in hex")
        _count(f"size of {name}", info.get("bytes"))
    for name, entry in manifest["tensors"].items():
        if not isinstance(entry, dict):
            raise ValueError(f"its manifest's entry for tensor {name!r} is {entry!r}, not a mapping")
        _shape(f"shape of {name!r}", entry.get("shape"))
        if not isinstance(entry.get("dtype"), str):
            raise ValueError(f"its manifest's dtype of {name!r} is {entry.get('dtype')!r}, not a name")
        if not shards and entry.get("file") not in manifest["files"]:
            raise ValueError(f"its manifest puts tensor {name!r} in {entry.get('file')!r}, which it does not list")
    if shards:
        check_shards(manifest)


def check_shards(manifest: dict) -> None:
    """The shards section of a worker-written checkpoint: a world size no larger than its files
    can hold (each rank writes at least one), every file's rank below it, every rank with a file,
    and a layout whose chunks, slots and buffers fit together."""
    files, shards = manifest["files"], manifest["shards"]
    world = _count("world size", shards["world"])
    if not 1 <= world <= len(files):
        raise ValueError(f"its manifest's world size is {world}, but it lists {len(files)} file(s) and every "
                         f"rank writes at least one")
    ranks = set()
    for name, info in files.items():
        rank = info.get("rank")
        if not is_count(rank) or rank >= world:
            raise ValueError(f"its manifest gives {name} the rank {rank!r}, not one below the world size {world}")
        ranks.add(rank)
    if len(ranks) != world:
        raise ValueError(f"its manifest lists no file of rank {min(set(range(world)) - ranks)} of {world}")
    check_layout(shards["layout"], world)


def check_layout(layout: dict, world: int) -> None:
    """The layout `engine.JoinedState` joins the shards with: chunk sizes (a sharded one a positive
    multiple of the world size, as the engine pads it), each slot inside its chunk with as many
    elements as its shape, buffers named."""
    if layout.get("world") != world:
        raise ValueError(f"its layout's world size is {layout.get('world')!r}, its manifest's {world}")
    chunks, slots, buffers = layout.get("chunks"), layout.get("slots"), layout.get("buffers")
    if not isinstance(chunks, list) or not isinstance(slots, list) or not isinstance(buffers, list):
        raise ValueError("its layout does not list its chunks, slots and buffers")
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, dict) or not isinstance(chunk.get("sharded"), bool):
            raise ValueError(f"its layout's chunk {i} is {chunk!r}, not a size and whether it is sharded")
        size = _count(f"size of chunk {i}", chunk.get("size"))
        if chunk["sharded"] and world > 1 and (size == 0 or size % world):
            raise ValueError(f"its layout's chunk {i} is sharded over {world} ranks with {size} elements, not a "
                             f"positive multiple of {world}")
        holders = chunk.get("shard_ranks")
        if holders is not None and (not chunk["sharded"] or not isinstance(holders, list) or not holders
                                    or not all(is_count(r) and r < world for r in holders)
                                    or len(set(holders)) != len(holders) or size % len(holders)):
            raise ValueError(f"its layout's chunk {i} names the ranks {holders!r} as holding its shards, not "
                             f"distinct ranks below {world} of a sharded chunk that splits evenly among them")
    for j, slot in enumerate(slots):
        if not isinstance(slot, dict) or not isinstance(slot.get("name"), str):
            raise ValueError(f"its layout's slot {j} has no name")
        what = f"slot {slot['name']!r}"
        keys = slot.get("keys")
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise ValueError(f"its layout's {what} does not list its keys")
        chunk = slot.get("chunk")
        if not is_count(chunk) or chunk >= len(chunks):
            raise ValueError(f"its layout's {what} is in chunk {chunk!r}, not one of its {len(chunks)}")
        offset, numel = _count(f"offset of {what}", slot.get("offset")), _count(f"size of {what}", slot.get("numel"))
        if offset + numel > chunks[chunk]["size"]:
            raise ValueError(f"its layout's {what} ends at element {offset + numel}, past its chunk's "
                             f"{chunks[chunk]['size']}")
        shape = _shape(f"shape of {what}", slot.get("shape"))
        if math.prod(shape) != numel:
            raise ValueError(f"its layout's {what} has shape {shape}, not {numel} elements")
    if not all(isinstance(b, str) for b in buffers):
        raise ValueError("its layout's buffers are not all names")
