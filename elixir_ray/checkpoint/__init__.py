"""Checkpoints: safetensors files plus a JSON manifest with checksums, committed atomically; whole tensors
(written by the driver) or each rank's shard with the layout (written by the workers, `shards.py`),
read back alike as whole tensors, each read from the files when it is used."""

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
