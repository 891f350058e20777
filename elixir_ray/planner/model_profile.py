"""What the planner knows of a model: traced on the meta device, so no weights are ever allocated.

A profile records, for one setting of activation checkpointing, the parameters (names, sizes) and
the order a step uses them in (recomputation included), the activation bytes autograd saves, the
step's matmul FLOPs, and, when the device is at hand, its kernels' measured time (`op_timing`). A module that can switch checkpointing per block (it has
`checkpointing()` and `set_checkpointing(mask)`, as our GPT does) is profiled once per setting the
search considers; the module's own setting is restored afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn

from elixir_ray.engine.sample import as_sample_inputs
from elixir_ray.engine.trace import AccessTrace, trace_step, unique_parameters
from elixir_ray.planner.op_timing import ComputeTimes


@dataclass
class ModelProfile:
    names: list[str]
    numels: list[int]
    trace: AccessTrace
    buffer_bytes: int  # module buffers, always resident on the device
    checkpointing: Optional[list]  # the per-block setting traced (None: the module has no switch)
    batch_size: int  # rows in the sample inputs (the micro-batch the activations were measured at)
    compute: Optional[ComputeTimes] = None  # the step's kernels timed on the device, when it was at hand
    # how to turn on activation checkpointing that the planner cannot switch itself (a Hugging Face
    # model's own), for the message when activations do not fit; None when there is nothing to say
    checkpointing_hint: Optional[str] = None

    @property
    def total_params(self) -> int:
        return sum(self.numels)


def supports_checkpointing(module: nn.Module) -> bool:
    return callable(getattr(module, "checkpointing", None)) and callable(getattr(module, "set_checkpointing", None))


def profile_model(module: nn.Module, sample_inputs, loss_fn: Optional[Callable] = None,
                  checkpointing: Optional[list] = None, dtype: Optional[torch.dtype] = None) -> ModelProfile:
    """Trace one step of `module` (real or on the meta device) with the given checkpointing setting."""
    sample_inputs = as_sample_inputs(sample_inputs)
    previous = module.checkpointing() if supports_checkpointing(module) else None
    if checkpointing is not None:
        if previous is None:
            raise ValueError(f"{type(module).__name__} has no per-block activation checkpointing switch "
                             f"(methods checkpointing() and set_checkpointing(mask))")
        module.set_checkpointing(list(checkpointing))
    try:
        named = unique_parameters(module)
        trace = trace_step(module, sample_inputs, loss_fn, dtype)
        traced_setting = module.checkpointing() if previous is not None else None
    finally:
        if previous is not None:
            module.set_checkpointing(previous)
    buffers = sum(b.numel() * b.element_size() for b in module.buffers())
    batch = sample_inputs.batch_size()
    return ModelProfile(names=[n for n, _ in named], numels=[p.numel() for _, p in named], trace=trace,
                        buffer_bytes=buffers, checkpointing=traced_setting, batch_size=batch,
                        checkpointing_hint=_own_checkpointing_hint(module) if previous is None else None)


def _own_checkpointing_hint(module: nn.Module) -> Optional[str]:
    """A Hugging Face model recomputes its layers after gradient_checkpointing_enable() (named
    activation_checkpointing_enable() from transformers 5.x), a switch the planner does not try (it
    is not per block)."""
    for switch, state in (("activation_checkpointing_enable", "is_activation_checkpointing"),
                          ("gradient_checkpointing_enable", "is_gradient_checkpointing")):
        if callable(getattr(type(module), switch, None)) and hasattr(type(module), state):
            if getattr(module, state):
                return None
            return f"call {type(module).__name__}.{switch}() before planning or wrap"
    return None


# eighths and thirds: with quarters, thirds and halves only, a budget between two settings left up
# to 4.6% of predicted step time unclaimed in a brute-force audit (GPT 1.5B and 4.2B against 50
# settings; the best often recomputed 3/4 to 11/12 of the blocks); eighths brought that under 2%,
# and thirds stay because eighths alone lost up to 1.4% where 1/3 or 2/3 was best (GPT 1.5B at
# 38 GiB). Each is one trace, about 2 s for a 10B GPT on the 2-core VM.
CHECKPOINT_FRACTIONS = tuple(sorted({i / 8 for i in range(9)} | {1 / 3, 2 / 3}))


def checkpointing_variants(module: nn.Module) -> list[Optional[list]]:
    """The checkpointing settings the search tries: these fractions of the blocks recomputed whole,
    spread evenly, the other blocks kept (or, where the module offers it, checkpointed selectively),
    besides no checkpointing at all and the module's own setting.

    Recomputation trades compute for activation memory, and the memory freed holds optimizer state
    on the device instead of the host. Which trade wins depends on the model and the budget (GPT 1.5B
    at 24 GiB: every block recomputed whole costs a third more compute, none does not fit), so the
    search gets the steps in between; each setting is one more trace, about 2 s for a 10B GPT.

    A module whose `checkpointing_modes` include "selective" takes mode names per block; there the
    blocks not recomputed whole are checkpointed selectively, never kept whole: selective
    checkpointing frees a third of a GPT block's activations for a few percent of its forward,
    which beats recomputing whole blocks for the same bytes, so keeping them is only tried for all
    blocks at once (when memory is plentiful). Other modules take True (recompute) or False.
    """
    if not supports_checkpointing(module):
        return [None]
    own = list(module.checkpointing())
    n = len(own)
    selective = "selective" in getattr(module, "checkpointing_modes", ())
    whole, keep = ("full", "none") if selective else (True, False)
    rest = "selective" if selective else keep
    variants: list[list] = [[keep] * n] if selective else []
    for fraction in CHECKPOINT_FRACTIONS:
        k = round(fraction * n)
        # k blocks, evenly spaced from block 0: the last block is recomputed first in backward, while
        # every earlier activation is alive, so checkpointing it frees almost nothing at the peak
        mask = [whole if (i * k) % n < k else rest for i in range(n)]
        if mask not in variants:
            variants.append(mask)
    if own not in variants:
        variants.append(own)
    return variants
