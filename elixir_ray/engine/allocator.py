"""The CUDA caching allocator's setting the engine trains with: expandable segments.

Without them the caching allocator keeps whole segments of past sizes and, under a cap, reserves
far more than it has allocated: on an H100 (2026-11-27, `jobs/bench_matrix.sh gpt-4b-caps`) it
reserved 0.96 to 0.99 of the cap where the engine's peak allocation was 0.74 to 0.79 of it. With
them a segment grows and shrinks in place, and the same runs reserved 1.04 to 1.07 times their
allocated peak (`gpt-4b-margin`). So the engine turns them on for its device unless the process's
`PYTORCH_CUDA_ALLOC_CONF` says otherwise, and its plans keep a smaller share of the budget back
with them (`default_memory_margin`).
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

import torch

SETTING = "expandable_segments"
# the share of the device budget a plan keeps back for the allocator: with expandable segments the
# allocator reserved at most 1.07x its peak allocation at 24 and 40 GiB caps (H100, above); without
# them plans at 20% kept back were the largest that stayed within the caps measured
MARGIN_EXPANDABLE = 0.10
MARGIN_CACHING = 0.20


def _conf(environ: Mapping[str, str]) -> dict:
    """PYTORCH_CUDA_ALLOC_CONF (or torch's newer PYTORCH_ALLOC_CONF) as {key: value}."""
    text = environ.get("PYTORCH_CUDA_ALLOC_CONF") or environ.get("PYTORCH_ALLOC_CONF") or ""
    pairs = (item.split(":", 1) for item in text.split(",") if ":" in item)
    return {key.strip(): value.strip() for key, value in pairs}


def expandable_segments_wanted(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether a CUDA process of ours runs on expandable segments: yes unless its allocator
    configuration turns them off by name (`expandable_segments:False`)."""
    value = _conf(os.environ if environ is None else environ).get(SETTING)
    return value is None or value == "True"


def default_memory_margin(device: str, environ: Optional[Mapping[str, str]] = None) -> float:
    """The share of the device budget a plan for `device` ("cuda:0", "cpu") keeps back when none is
    asked for. A CPU budget has no caching allocator behind it, and keeps the larger share, as a
    CUDA device whose allocator runs without expandable segments does."""
    if device.startswith("cuda") and expandable_segments_wanted(environ):
        return MARGIN_EXPANDABLE
    return MARGIN_CACHING


def use_expandable_segments(device: torch.device) -> bool:
    """Turn expandable segments on for the allocations made from here on (segments already made
    stay as they are), unless the allocator configuration says otherwise; returns whether they are
    on. Off CUDA, False."""
    if device.type != "cuda" or not expandable_segments_wanted():
        return False
    if _conf(os.environ).get(SETTING) == "True":
        return True  # torch read it from the environment
    # torch's runtime form of PYTORCH_CUDA_ALLOC_CONF; torch.cuda.memory._set_allocator_settings
    # forwards to it (and warns that it is deprecated in its favour)
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setter(f"{SETTING}:True")
    return True
