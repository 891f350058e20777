"""Export a checkpoint's model weights as one plain safetensors state dict.

The result loads with `module.load_state_dict(safetensors.torch.load_file(OUT))` and needs
nothing from elixir_ray; for Hugging Face models the keys are the module's own.
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

from elixir_ray import storage
from elixir_ray.checkpoint import safetensors_io
from elixir_ray.checkpoint.store import CheckpointError, require_newest_valid
from elixir_ray.progress import ByteProgress


PICKLE_EXTENSIONS = (".pt", ".pth", ".bin", ".ckpt", ".pkl")


def export_safetensors(ckpt_uri: str, out_uri: str, progress: Optional[ByteProgress] = None) -> tuple[str, int]:
    """Returns (the checkpoint exported, the number of tensors written). `progress` hears of the
    bytes as they are written."""
    if "://" not in out_uri and os.path.isdir(out_uri):
        raise CheckpointError(f"the output {out_uri!r} is a directory: name the file, for example "
                              f"{os.path.join(out_uri, 'weights.safetensors')}")
    stem, ext = os.path.splitext(out_uri)
    if ext.lower() in PICKLE_EXTENSIONS:  # torch.load could not read what is written there
        raise CheckpointError(f"the output {out_uri!r} names a torch pickle, but export writes safetensors: name it "
                              f"{stem}.safetensors (load it with safetensors.torch.load_file)")
    path, manifest, tensors = require_newest_valid(ckpt_uri)
    names = [k[len("model/"):] for k in tensors if k.startswith("model/")]
    if not names:
        raise CheckpointError(f"checkpoint {path!r} holds no model tensors")
    metadata = {"format": "pt", "step": str(manifest["step"]), "source": path}
    spec = safetensors_io.spec_of_mapping(tensors)
    fs, out_path = storage.resolve(out_uri)
    # streamed one tensor at a time (a large model's weights are never all in memory), under a
    # temporary name renamed into place when complete
    if progress is not None:
        shapes_and_dtypes = [spec(f"model/{k}") for k in names]
        progress.begin(sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in shapes_and_dtypes))
    with storage.atomic_output(fs, out_path) as out:
        safetensors_io.write(out, names, lambda k: tensors[f"model/{k}"], lambda k: spec(f"model/{k}"), metadata,
                             on_bytes=progress.add if progress is not None else None)
    if progress is not None:
        progress.finish()
    return path, len(names)
