"""What one AdamW update of a chunk's shard reads and writes: the hyper-parameters of each fused
call over its slices (`AdamCall`) and the shard's tensors (`AdamTensors`). Torch's fused Adam and
the one-pass C kernel (host_kernel.py) take the same two."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class AdamCall:
    """One fused Adam call over some slices of a chunk's shard, with everything it reads fixed."""

    segments: tuple  # (lo, hi) in shard coordinates
    step: int  # updates applied so far to these parameters
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool


@dataclass(frozen=True)
class AdamTensors:
    """A chunk shard's AdamW state on one device, 1-D tensors of one length: the fp32 master and
    moments, its gradient (fp32, or the compute dtype), and the master's copy in the compute dtype
    that loads upload (None where there is none)."""

    master: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    upload: Optional[torch.Tensor] = None
