"""Real values beside the meta trace, for the decisions a model takes on its inputs' values.

A meta tensor has a shape and no values, so `.item()`, `bool(mask.all())` or `nonzero()` on one
fails. Models do read their inputs like that: Hugging Face's attention decides from the padding
mask whether it may use causal attention, and position ids come from a cumulative sum of it. The
trace keeps each sample input's real value as a shadow of its meta stand-in and carries shadows
through every kernel whose tensor arguments all have one (masks, ids, positions: small integer
work, never the weights, which stay meta). A kernel that needs values then gets them from the
shadows (a CPU tensor the step makes from Python values, such as the index tensor of
`ids[:, [-1, 0]]`, is its own). A kernel that mixes in a weight has no shadow, so nothing the weights compute is ever
real; and a tensor such a kernel writes into (in place, `out=`) loses its shadow, with every
other view of its memory, so that no value read later is stale. Uninitialised allocations and
random kernels get no shadow (the latter would advance the caller's random state).

When a step reads values computed from the weights (a learned router), the trace runs again with
the weights' real values as shadows too (`max_elements=None`), so every kernel runs on them;
random kernels (and the allocations they fill) then get shadows, drawn from a fork of the CPU
generator (`follow_all`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

from elixir_ray.engine.live_memory import storage_key
from elixir_ray.engine.op_args import leaves, map_leaves

MAX_SHADOW_ELEMENTS = 1 << 24  # values this large are not input bookkeeping; they are not followed
_UNINITIALISED = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty",
                  "aten::new_empty_strided"}


def _written_arguments(func) -> tuple[tuple[int, str, bool], ...]:
    """Where `func`'s schema says it writes (in place, or `out=`): (position, name, keyword-only)."""
    return tuple((i, a.name, a.kwarg_only) for i, a in enumerate(func._schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


def _written(spots: tuple, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments at `spots` (from `_written_arguments`)."""
    out = []
    for i, name, kwarg_only in spots:
        value = kwargs.get(name) if kwarg_only or i >= len(args) else args[i]
        out.extend(t for t in leaves(value) if isinstance(t, torch.Tensor))
    return out


class ShadowValues(TorchDispatchMode):
    """Follows real values of meta tensors computed only from the sample inputs."""

    def __init__(self, max_elements: Optional[int] = MAX_SHADOW_ELEMENTS, follow_all: bool = False):
        """`max_elements`: larger values are not followed (None: all are, as when the weights have shadows).
        `follow_all`: random kernels and the allocations they fill (dropout's mask) get shadows too,
        drawn from a fork of the CPU generator so the caller's random state is left alone: with the
        weights' values followed, a router after a dropout needs them."""
        super().__init__()
        self.max_elements = max_elements
        self.follow_all = follow_all
        self.shadows = WeakIdKeyDictionary()
        # meta storages written by a kernel without real values (held, so that no new storage
        # takes the same key; meta storages cost no memory)
        self._poisoned: dict[int, object] = {}
        self._writes: dict = {}  # operator -> its _written_arguments (reading a schema is slow)

    def add(self, meta: torch.Tensor, real: torch.Tensor) -> None:
        if self._small(real) and storage_key(meta) not in self._poisoned:
            self.shadows[meta] = real

    def _small(self, t: torch.Tensor) -> bool:
        return self.max_elements is None or t.numel() <= self.max_elements

    def _has(self, t: torch.Tensor) -> bool:
        if t.device.type == "cpu":  # made during the step from Python values (an index list): real already
            return t.layout == torch.strided and self._small(t)
        return t in self.shadows and t.layout == torch.strided and storage_key(t) not in self._poisoned

    def _real(self, func, args, kwargs):
        """`func` on the shadows, or None when a tensor argument has none."""
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        if not self.follow_all and (seeded or func.name().split(".")[0] in _UNINITIALISED):
            return None
        tensors = [t for t in leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if tensors and not all(self._has(t) for t in tensors):
            return None
        if not tensors:  # a factory (arange, ones, full) is made again where the values live
            device = kwargs.get("device")
            if device is None or torch.device(device).type != "meta":
                return None

        def swap(x):
            if isinstance(x, torch.Tensor):
                return x if x.device.type == "cpu" else self.shadows[x]
            if isinstance(x, torch.device) and x.type == "meta":
                return torch.device("cpu")
            return x

        try:
            with _disable_current_modes(), torch.random.fork_rng(devices=[], enabled=seeded):
                return func(*map_leaves(swap, args), **map_leaves(swap, kwargs))  # not part of the traced step
        except Exception:  # a kernel the CPU cannot run on these values: this chain of values ends here
            return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        spots = self._writes.get(func)
        if spots is None:
            spots = self._writes[func] = _written_arguments(func)
        written = _written(spots, args, kwargs)
        if any(t.device.type == "cpu" for t in written):  # a real tensor written: not a kernel of the trace's
            return func(*args, **kwargs)
        try:
            out = func(*args, **kwargs)
        except (RuntimeError, NotImplementedError):  # a kernel the meta device cannot run without values
            real = None if written else self._real(func, args, kwargs)  # a write there would change shapes
            if real is None:
                raise
            return map_leaves(lambda r: self._stand_in(r) if isinstance(r, torch.Tensor) else r, real)
        # a kernel on real CPU tensors alone (made in the step from Python values) has real outputs already
        metas = [t for t in leaves(out) if isinstance(t, torch.Tensor) and t.device.type == "meta"]
        real = None
        if metas and all(self._small(t) for t in metas):
            real = self._real(func, args, kwargs)
        if real is None:
            for t in written:  # its memory now holds what no shadow knows: every view of it forgets
                if t.layout == torch.strided:
                    self._poisoned[storage_key(t)] = t.untyped_storage()
            return out
        for meta, value in zip(leaves(out), leaves(real)):
            if isinstance(meta, torch.Tensor) and meta.device.type == "meta" and isinstance(value, torch.Tensor):
                self.add(meta, value)
        return out

    def _stand_in(self, real: torch.Tensor) -> torch.Tensor:
        meta = torch.empty_strided(real.shape, real.stride(), dtype=real.dtype, device="meta")
        self.add(meta, real)
        return meta
