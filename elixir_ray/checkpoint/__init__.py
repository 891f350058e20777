"""Checkpoints: whole tensors in safetensors files plus a JSON manifest with checksums, committed atomically."""

from elixir_ray.checkpoint.store import (
    CheckpointError,
    check_compatible,
    delete_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_first_valid,
    load_newest_valid,
    read_manifest,
    save_checkpoint,
)

__all__ = ["CheckpointError", "check_compatible", "delete_checkpoint", "list_checkpoints", "load_checkpoint",
           "load_first_valid", "load_newest_valid", "read_manifest", "save_checkpoint"]
