"""Activation memory over a traced step: every tensor a kernel makes, from creation until it dies.

What autograd saves is most of it, but not the peak: backward's first gradients (a GPT's logits
gradient, in fp32 and again in the compute dtype) and a checkpointed block's recomputed
activations sit on top of the saved tensors. `LiveBytes` follows each storage a kernel returns
until the last tensor on it is gone, so the trace knows the real high-water mark. Parameters (and
views of them) are left out: their compute copies live in the pool, which the planner counts
apart; so are buffers, always resident and counted apart, and parameter gradients, which the
trace drops on arrival as the engine moves them into chunk buffers.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from elixir_ray.engine.op_args import leaves


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class LiveBytes(TorchDispatchMode):
    """Bytes of live non-parameter storages made while on (`live`), and their maximum (`peak`);
    `take_high(mark)` gives the maximum since its last call with that mark, so a trace sampled at
    parameter accesses (or at gradient arrivals, another mark) still sees a peak that falls
    between two samples."""

    def __init__(self, excluded_storages: set[int]):
        super().__init__()
        self.excluded = excluded_storages
        self.live = 0
        self.peak = 0
        # per mark ("event", "sample"): the most bytes alive since its last take_high; plain
        # attributes, not a dict, since every op of a trace updates them
        self._high_event = self._high_sample = 0
        self._refs: dict[int, list[int]] = {}  # storage -> [tensors alive on it, bytes]

    def _release(self, key: int) -> None:
        entry = self._refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self._refs[key]
            self.live -= entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in leaves(out):
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
                continue  # a sparse tensor has no storage of its own
            key = storage_key(t)
            if key in self.excluded:
                continue
            entry = self._refs.get(key)
            if entry is None:
                entry = self._refs[key] = [0, t.untyped_storage().nbytes()]
                self.live += entry[1]
            entry[0] += 1
            weakref.finalize(t, self._release, key)  # a tensor's Python object lives as long as it does
        live = self.live
        if live > self.peak:
            self.peak = live
        if live > self._high_event:
            self._high_event = live
        if live > self._high_sample:
            self._high_sample = live
        return out

    def take_high(self, mark: str = "event") -> int:
        """The most bytes alive since the last call with this mark, "event" or "sample" (or since
        the start)."""
        name = f"_high_{mark}"
        high = max(getattr(self, name), self.live)
        setattr(self, name, self.live)
        return high
