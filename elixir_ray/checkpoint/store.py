"""Durable checkpoints through pyarrow.fs, independent of the world size.

Layout under the checkpoint URI:

    step-00000100/manifest.json          format, step, tensors (file, shape, dtype), per-file sha256, extra state
    step-00000100/part-00000.safetensors full tensors, split into files of at most ~1 GiB

Tensors are whole (not per-rank shards), so a checkpoint restores onto any number of workers.
A checkpoint is written into a hidden temporary directory, manifest last, then renamed into
place; readers only pick up `step-*` directories that hold a manifest, so a crash or a full disk
mid-write never yields a checkpoint that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
import warnings
from typing import Optional

import numpy as np
import pyarrow.fs as pafs

from elixir_ray import storage
from elixir_ray.checkpoint import safetensors_io

FORMAT = "elixir_ray.checkpoint/1"
PART_BYTES = 2**30


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or does not fit the model."""


def _step_dir(step: int) -> str:
    return f"step-{step:08d}"


def _split(tensors: dict[str, np.ndarray], part_bytes: int) -> list[dict[str, np.ndarray]]:
    parts: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        arr = tensors[name]
        if parts[-1] and size + arr.nbytes > part_bytes:
            parts.append({})
            size = 0
        parts[-1][name] = arr
        size += arr.nbytes
    return parts


def save_checkpoint(uri: str, step: int, tensors: dict[str, np.ndarray], extra: dict,
                    keep: Optional[int] = None, part_bytes: int = PART_BYTES) -> str:
    """Write the tensors and the manifest; returns the committed checkpoint's path."""
    fs, root = storage.resolve(uri)
    fs.create_dir(root, recursive=True)
    final = f"{root}/{_step_dir(step)}"
    tmp = f"{root}/.tmp-{_step_dir(step)}-{uuid.uuid4().hex[:8]}"
    fs.create_dir(tmp, recursive=True)
    try:
        files, entries = {}, {}
        for i, part in enumerate(_split(tensors, part_bytes)):
            name = f"part-{i:05d}.safetensors"
            payload = safetensors_io.encode(part)
            with fs.open_output_stream(f"{tmp}/{name}") as out:
                out.write(payload)
            files[name] = {"sha256": hashlib.sha256(payload).hexdigest(), "bytes": len(payload)}
            for key, arr in part.items():
                entries[key] = {"file": name, "shape": list(arr.shape), "dtype": str(arr.dtype)}
        manifest = {"format": FORMAT, "step": step, "files": files, "tensors": entries, **extra}
        with fs.open_output_stream(f"{tmp}/manifest.json") as out:
            out.write(json.dumps(manifest, indent=1, sort_keys=True).encode())
        if storage.exists(fs, final):
            fs.delete_dir(final)
        fs.move(tmp, final)
    except BaseException:
        try:
            if storage.exists(fs, tmp):
                fs.delete_dir(tmp)
        except OSError:
            pass  # the original error matters more; the temporary name is never picked up
        raise
    if keep:
        for old in list_checkpoints(uri)[:-keep]:
            fs.delete_dir(old)
    return final if "://" not in uri else f"{uri.rstrip('/')}/{_step_dir(step)}"


def list_checkpoints(uri: str) -> list[str]:
    """Committed checkpoints under uri, oldest first."""
    fs, root = storage.resolve(uri)
    if not storage.exists(fs, root):
        return []
    found = []
    for info in fs.get_file_info(pafs.FileSelector(root)):
        name = os.path.basename(info.path)
        if info.type == pafs.FileType.Directory and name.startswith("step-"):
            if storage.exists(fs, f"{info.path}/manifest.json"):
                found.append(info.path)
    return sorted(found)


def read_manifest(path: str) -> dict:
    fs, root = storage.resolve(path)
    try:
        with fs.open_input_stream(f"{root}/manifest.json") as f:
            manifest = json.loads(f.read())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {path!r} has no readable manifest: {exc}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path!r} has format {manifest.get('format')!r}, expected {FORMAT}")
    return manifest


def load_checkpoint(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    """Read and verify one checkpoint: every file's checksum must match its manifest entry."""
    manifest = read_manifest(path)
    fs, root = storage.resolve(path)
    tensors: dict[str, np.ndarray] = {}
    for name, info in manifest["files"].items():
        try:
            with fs.open_input_stream(f"{root}/{name}") as f:
                payload = f.read()
        except OSError as exc:
            raise CheckpointError(f"checkpoint {path!r}: cannot read {name}: {exc}") from None
        if hashlib.sha256(payload).hexdigest() != info["sha256"]:
            raise CheckpointError(f"checkpoint {path!r}: {name} does not match its checksum")
        try:
            part, _ = safetensors_io.decode(payload)
        except ValueError as exc:
            raise CheckpointError(f"checkpoint {path!r}: {name} is malformed: {exc}") from None
        tensors.update(part)
    return manifest, tensors


def load_newest_valid(uri: str) -> Optional[tuple[str, dict, dict[str, np.ndarray]]]:
    """The newest checkpoint that verifies; a corrupt one is skipped with a warning."""
    candidates = list_checkpoints(uri)
    if not candidates and storage.exists(*storage.resolve(uri)) and _is_checkpoint(uri):
        candidates = [uri]  # uri names one checkpoint rather than a directory of them
    return load_first_valid(reversed(candidates))


def load_first_valid(paths) -> Optional[tuple[str, dict, dict[str, np.ndarray]]]:
    """The first of `paths` (newest first) that verifies; a corrupt one is skipped with a warning."""
    for path in paths:
        try:
            manifest, tensors = load_checkpoint(path)
            return path, manifest, tensors
        except CheckpointError as exc:
            warnings.warn(f"skipping checkpoint: {exc}; trying the previous one", stacklevel=3)
    return None


def _is_checkpoint(uri: str) -> bool:
    fs, root = storage.resolve(uri)
    return storage.exists(fs, f"{root}/manifest.json")


def check_compatible(manifest: dict, expected: dict[str, tuple]) -> None:
    """Refuse a checkpoint of another model: name the first tensor whose shape differs or is missing."""
    found = manifest["tensors"]
    for name, shape in expected.items():
        if name not in found:
            raise CheckpointError(f"checkpoint does not fit this model: it has no tensor {name!r}")
        if tuple(found[name]["shape"]) != tuple(shape):
            raise CheckpointError(
                f"checkpoint does not fit this model: {name!r} has shape {tuple(found[name]['shape'])} "
                f"in the checkpoint but {tuple(shape)} in the model"
            )
