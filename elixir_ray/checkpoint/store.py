"""Durable checkpoints through pyarrow.fs.

Layout under the checkpoint URI:

    step-00000100/manifest.json        format, step, per-file sha256, tensor names/shapes, extra state
    step-00000100/rank-00000.safetensors

A checkpoint is written into a hidden temporary directory, manifest last, then renamed into
place; a reader only picks up directories named `step-*` that hold a manifest, so a crash
mid-write never yields a partial checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid

import numpy as np
import pyarrow.fs as pafs

from elixir_ray import storage
from elixir_ray.checkpoint import safetensors_io

FORMAT = "elixir_ray.checkpoint/1"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or does not fit the model."""


def _step_dir(step: int) -> str:
    return f"step-{step:08d}"


def save_checkpoint(uri: str, step: int, shards: dict[int, dict[str, np.ndarray]], extra: dict,
                    keep: int | None = None) -> str:
    """Write every rank's shard and the manifest; returns the committed checkpoint's path."""
    fs, root = storage.resolve(uri)
    fs.create_dir(root, recursive=True)
    final = f"{root}/{_step_dir(step)}"
    tmp = f"{root}/.tmp-{_step_dir(step)}-{uuid.uuid4().hex[:8]}"
    fs.create_dir(tmp, recursive=True)
    try:
        files = {}
        for rank, tensors in sorted(shards.items()):
            name = f"rank-{rank:05d}.safetensors"
            payload = safetensors_io.encode(tensors)
            with fs.open_output_stream(f"{tmp}/{name}") as out:
                out.write(payload)
            files[name] = {
                "sha256": hashlib.sha256(payload).hexdigest(), "bytes": len(payload),
                "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in sorted(tensors.items())},
            }
        manifest = {"format": FORMAT, "step": step, "files": files, **extra}
        with fs.open_output_stream(f"{tmp}/manifest.json") as out:
            out.write(json.dumps(manifest, indent=1, sort_keys=True).encode())
        if storage.exists(fs, final):
            fs.delete_dir(final)
        fs.move(tmp, final)
    except BaseException:
        if storage.exists(fs, tmp):
            fs.delete_dir(tmp)
        raise
    if keep:
        for old in list_checkpoints(uri)[:-keep]:
            fs.delete_dir(old)
    return final


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


def load_checkpoint(path: str) -> tuple[dict, dict[int, dict[str, np.ndarray]]]:
    """Read and verify one checkpoint: every file's checksum must match its manifest entry."""
    fs, root = storage.resolve(path)
    try:
        with fs.open_input_stream(f"{root}/manifest.json") as f:
            manifest = json.loads(f.read())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {path!r} has no readable manifest: {exc}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path!r} has format {manifest.get('format')!r}, expected {FORMAT}")
    shards = {}
    for name, info in manifest["files"].items():
        with fs.open_input_stream(f"{root}/{name}") as f:
            payload = f.read()
        if hashlib.sha256(payload).hexdigest() != info["sha256"]:
            raise CheckpointError(f"checkpoint {path!r}: {name} does not match its checksum")
        tensors, _ = safetensors_io.decode(payload)
        shards[int(name.split("-")[1].split(".")[0])] = tensors
    return manifest, shards
