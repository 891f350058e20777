"""Export a checkpoint's model weights as one plain safetensors state dict.

The result loads with `module.load_state_dict(safetensors.torch.load_file(OUT))` and needs
nothing from elixir_ray; for Hugging Face models the keys are the module's own.
"""

from __future__ import annotations

from elixir_ray import storage
from elixir_ray.checkpoint import safetensors_io
from elixir_ray.checkpoint.store import CheckpointError, load_newest_valid


def export_safetensors(ckpt_uri: str, out_uri: str) -> tuple[str, int]:
    """Returns (the checkpoint exported, the number of tensors written)."""
    found = load_newest_valid(ckpt_uri)
    if found is None:
        raise CheckpointError(f"no valid checkpoint at {ckpt_uri!r}")
    path, manifest, tensors = found
    model = {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
    if not model:
        raise CheckpointError(f"checkpoint {path!r} holds no model tensors")
    metadata = {"format": "pt", "step": str(manifest["step"]), "source": path}
    fs, out_path = storage.resolve(out_uri)
    storage.write_bytes_atomic(fs, out_path, safetensors_io.encode(model, metadata))
    return path, len(model)
