"""The compute device, named with its index.

torch's per-device CUDA calls (`set_device`, `set_per_process_memory_fraction`,
`get_per_process_memory_fraction`, `get_device_properties`) refuse a bare `cuda` device, and a
bare one in a profile or plan does not say which GPU it measured. Everything that takes a device
from a user, a flag or a default resolves it here first.
"""

from __future__ import annotations

from typing import Union

import torch


def resolve_device(device: Union[torch.device, str, None] = None) -> torch.device:
    """`device`, or CUDA when there is one and else the CPU; a CUDA device without an index gets the
    current one's."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def random_state_kept(device: torch.device):
    """A scope after which the CPU's random generator (and `device`'s, on CUDA) is as it was.

    Planning measures rates and times the model's kernels, dropout included, on the global
    generators; a loop that seeds, wraps and trains must draw the numbers plain torch would."""
    device = resolve_device(device)
    # a profile may name another machine's GPU
    here = device.type == "cuda" and torch.cuda.is_available() and device.index < torch.cuda.device_count()
    return torch.random.fork_rng(devices=[device.index] if here else [])
