"""Checkpoints: safetensors shards plus a JSON manifest with checksums, committed atomically."""

from elixir_ray.checkpoint.store import CheckpointError, list_checkpoints, load_checkpoint, save_checkpoint

__all__ = ["CheckpointError", "list_checkpoints", "load_checkpoint", "save_checkpoint"]
