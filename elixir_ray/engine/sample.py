"""One step's inputs to a module's forward, as the trace and the planner take them, and the loss
a step's output holds.

Plain modules take a batch positionally (`sample_inputs=(batch,)`); Hugging Face models take
theirs by keyword and return a `ModelOutput` whose `.loss` is the loss (`sample_inputs={"input_ids":
ids, "labels": ids}`). Both forms call the module as the training loop will, so its own parameter
names stay its state_dict's keys (no wrapper module in between).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch.utils._pytree import tree_flatten


@dataclass(frozen=True)
class SampleInputs:
    """A step's inputs given both ways, as forward is called: `SampleInputs(args=(ids,),
    kwargs={"attention_mask": mask})` for `model(ids, attention_mask=mask)` (a tuple gives only
    positional inputs and a dict only keyword ones)."""

    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def call(self, fn: Callable):
        return fn(*self.args, **self.kwargs)

    def tensors(self) -> list[torch.Tensor]:
        return [x for x in tree_flatten((self.args, self.kwargs))[0] if isinstance(x, torch.Tensor)]

    def batch_size(self) -> int:
        """The first dimension of `input_ids` when given, else of the first tensor input (1 when it
        has none): what the planner scales activations by when it tries other micro-batch sizes."""
        ids = self.kwargs.get("input_ids")
        first = ids if isinstance(ids, torch.Tensor) else next(iter(self.tensors()), None)
        return int(first.shape[0]) if first is not None and first.dim() else 1

    def describe(self) -> str:
        parts = [f"{len(self.args)} positional input(s)"] if self.args or not self.kwargs else []
        if self.kwargs:
            parts.append(f"keyword inputs {', '.join(sorted(self.kwargs))}")
        return " and ".join(parts)


def as_sample_inputs(sample_inputs) -> SampleInputs:
    """`sample_inputs` as given to wrap or plan: a tuple (or list) of forward's positional inputs, a
    dict of its keyword inputs, or a SampleInputs. A bare tensor is refused: tuple() would split it
    along its first dimension into as many inputs."""
    if isinstance(sample_inputs, SampleInputs):
        if not isinstance(sample_inputs.args, (tuple, list)) or not isinstance(sample_inputs.kwargs, Mapping):
            raise TypeError("SampleInputs takes args as a tuple of forward's positional inputs and kwargs as a dict of "
                            "its keyword inputs")
        return SampleInputs(tuple(sample_inputs.args), dict(sample_inputs.kwargs))
    if isinstance(sample_inputs, torch.Tensor):
        raise TypeError(f"sample_inputs must be a tuple of forward's positional inputs (or a dict of its keyword "
                        f"inputs), got a tensor of shape {tuple(sample_inputs.shape)}: pass sample_inputs=(batch,)")
    if isinstance(sample_inputs, Mapping):  # a dict, or a tokenizer's BatchEncoding
        bad = [k for k in sample_inputs if not isinstance(k, str)]
        if bad:
            raise TypeError(f"sample_inputs as a dict holds forward's keyword inputs, so its keys must be "
                            f"argument names, got {bad[0]!r}")
        return SampleInputs(kwargs=dict(sample_inputs))
    if isinstance(sample_inputs, (tuple, list)):
        return SampleInputs(args=tuple(sample_inputs))
    raise TypeError(f"sample_inputs must be a tuple of forward's positional inputs, a dict of its keyword inputs, "
                    f"or elixir_ray.SampleInputs(args=..., kwargs=...) for both, got {type(sample_inputs).__name__}")


def loss_in(out) -> Optional[torch.Tensor]:
    """The loss a forward returned: the output itself when it is a tensor, else its `loss` (a Hugging
    Face ModelOutput's attribute, or a dict's key) when that is a tensor; None otherwise."""
    if isinstance(out, torch.Tensor):
        return out
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None
