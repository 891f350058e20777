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


def scalar_elements(out) -> list[str]:
    """How to take each element of a tuple or list output that could be the loss (a tensor of one
    element that needs a gradient): `out[1]`, say, for a nanoGPT-style `(logits, loss)`."""
    if not isinstance(out, (tuple, list)):
        return []
    return [f"out[{i}]" for i, x in enumerate(out)
            if isinstance(x, torch.Tensor) and x.numel() == 1 and x.requires_grad]


def tuple_hint(out) -> str:
    """What to pass as loss_fn for a tuple or list output: its scalar element where it has one,
    else that it has none (the loss is then computed from it)."""
    found = scalar_elements(out)
    kind = type(out).__name__
    if len(found) == 1:
        return f"loss_fn=lambda out: {found[0]} ({found[0]} is the {kind}'s one scalar tensor)"
    if found:
        return f"loss_fn=lambda out: {found[0]}, or whichever of {', '.join(found)} is the loss"
    return (f"loss_fn=, a function that computes the loss from it (none of the {kind}'s {len(out)} elements is a "
            f"scalar tensor)")


def check_scalar_loss(loss: torch.Tensor, out, loss_fn, module_name: str) -> None:
    """Refuse a loss of more than one element where one was asked for (`loss_fn`'s, or a
    ModelOutput's `loss`): the trace's backward from it would run, as if from its sum, and plan a
    step the loop's `loss.backward()` then refuses, or one that trains on the wrong thing (the
    logits, taken for the loss). A forward that returns a tensor is traced as its sum: a loop
    reduces it itself (`model(x).sum().backward()`)."""
    if loss.numel() == 1 or (loss_fn is None and isinstance(out, torch.Tensor)):
        return
    shape = list(loss.shape)
    if loss_fn is None:
        raise TypeError(f"{module_name}'s forward returned a loss of shape {shape}, not a scalar: the trace runs one "
                        f"backward from the step's loss; reduce it in forward (.mean()), or pass loss_fn=")
    other = scalar_elements(out)
    hint = (f"; {other[0]} is a scalar tensor: loss_fn=lambda out: {other[0]}" if len(other) == 1 else
            f"; {', '.join(other)} are scalar tensors" if other else
            ": reduce it to the loss (its cross-entropy against the targets, or .mean())")
    raise TypeError(f"loss_fn returned a tensor of shape {shape}, not a scalar loss{hint}")
