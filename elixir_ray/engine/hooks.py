"""Where the engine meets autograd: fetch before use, collect gradients into chunks, reduce.

- Forward: a pre-hook on every module with parameters fetches its chunks; a torch-function mode
  catches a parameter used outside its own module (for example a tied weight used by the parent).
- Backward: autograd's saved-tensor unpack hook fetches the chunk of any saved parameter view whose
  copy was evicted; a module forward during backward is recomputation (activation checkpointing),
  and its chunks stay pinned until the next recomputed region starts.
- Gradients: each parameter's gradient is added into its chunk's fp32 staging buffer and dropped;
  a chunk whose gradients are all in is reduced across ranks at once, the rest at the end of backward.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from elixir_ray.engine.chunks import ChunkStore, ParamSlot
from elixir_ray.engine.pool import ChunkPool


def _chunks_used(slots: dict, args: tuple, kwargs: Optional[dict]) -> list[int]:
    """Chunks of the wrapped parameters among an op's arguments, also inside list or tuple arguments
    (torch.cat([w, v]), foreach ops), one level deep. This runs for every op in forward, so it looks
    arguments up by id (the slots hold every parameter, so an id names one) instead of isinstance."""
    found = []
    for group in (args, kwargs.values()) if kwargs else (args,):
        for a in group:
            slot = slots.get(id(a))
            if slot is not None:
                found.append(slot.chunk)
            elif isinstance(a, (list, tuple)):  # builtin types: cheap, unlike nn.Parameter's isinstance
                found.extend(slots[id(x)].chunk for x in a if id(x) in slots)
    return found


def _tensors_in(out) -> list[torch.Tensor]:
    """The tensors of a forward's result: a tensor, or inside tuples, lists and dicts (a Hugging Face
    ModelOutput is a dict)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for item in out for t in _tensors_in(item)]
    return []


class _FetchParamsMode(TorchFunctionMode):
    """Safety net in forward: any op that receives an evicted parameter gets it fetched first."""

    def __init__(self, runtime: "EngineHooks"):
        super().__init__()
        self.runtime = runtime

    def __torch_function__(self, func, types, args=(), kwargs=None):
        runtime = self.runtime
        needed = _chunks_used(runtime.slot_by_param, args, kwargs)
        if needed:
            store = runtime.store
            if not all(store.usable(store.chunks[c]) for c in needed):
                runtime.pool.access(tuple(needed))
        return func(*args, **(kwargs or {}))


class EngineHooks:
    def __init__(self, module: nn.Module, store: ChunkStore, pool: ChunkPool, slots: list[ParamSlot]):
        self.module, self.store, self.pool = module, store, pool
        self.slot_by_param = {id(s.param): s for s in slots}
        self.slots = slots
        self.phase = "idle"  # "forward" | "backward" | "idle"
        self._recompute_open = False
        self._backward_open = False
        self.optimizer = None  # the ChunkedAdam, told when a backward starts and when a gradient is final
        self.handles = []
        for mod in module.modules():
            chunks = tuple(dict.fromkeys(self.slot_by_param[id(p)].chunk for p in mod.parameters(recurse=False)))
            if chunks:
                self.handles.append(mod.register_forward_pre_hook(self._pre_forward(chunks)))
        for s in slots:
            if s.param.requires_grad:
                self.handles.append(s.param.register_post_accumulate_grad_hook(self._on_grad))

    # -- forward and recomputation ----------------------------------------------------------------

    def _pre_forward(self, chunks):
        def hook(mod, args):
            if self.phase == "backward":  # recomputation of a checkpointed region
                if not self._recompute_open:
                    self.pool.release_pins()
                    self._recompute_open = True
                self.pool.access(chunks, pin=True)
            else:
                self.pool.access(chunks)
        return hook

    def pack(self, t: torch.Tensor):
        return t

    def unpack(self, t: torch.Tensor):
        chunk = self.store.chunk_of(t)
        if chunk is not None:
            self._recompute_open = False
            self.pool.access((chunk.index,))  # also when resident: keeps the pool's place in the trace for prefetch
        return t

    def forward(self, *args, **kwargs):
        self.phase = "forward"
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack), _FetchParamsMode(self):
                out = self.module(*args, **kwargs)
        finally:
            self.phase = "backward"
            self._recompute_open = False
        for t in _tensors_in(out):
            if t.requires_grad:
                t.register_hook(self._on_output_grad)
        return out

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        """The backward through this forward's output begins: open it here, in the outermost backward.

        A parameter's gradient may first arrive inside a nested backward (reentrant activation
        checkpointing runs one per region), and the end-of-backward callback queued there would
        fire when that region ends, splitting one backward into several."""
        if not self._backward_open:
            self.start_backward()

    # -- gradients --------------------------------------------------------------------------------

    def start_backward(self) -> None:
        """Expected gradients per chunk for this backward, and the callback that closes it."""
        if self.optimizer is not None:
            self.optimizer.backward_started()  # may refuse a backward the step did not expect
        self._backward_open = True
        for c in self.store.chunks:
            c.pending = sum(1 for s in c.slots if s.param.requires_grad)
            c.reduced = False
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self._backward_open:
            self.start_backward()
        self._recompute_open = False  # gradients arriving: the recomputed region's backward is under way
        slot = self.slot_by_param[id(param)]
        chunk = self.store.add_grad(slot, param.grad)
        param.grad = None
        slot.has_grad = True
        chunk.pending -= 1
        if chunk.pending == 0 and (chunk.eager_reduce or self.store.comm.world == 1):
            self.store.reduce(chunk)
            chunk.reduced = True
            if self.optimizer is not None:
                self.optimizer.gradient_final(chunk)

    def _end_backward(self) -> None:
        """Reduce every chunk not reduced yet, in chunk order, so all ranks issue the same collectives."""
        comm = self.store.comm
        late = []
        for c in self.store.chunks:
            if c.reduced:
                continue
            if c.staging is not None or (comm.world > 1 and any(s.param.requires_grad for s in c.slots)):
                self.store.reduce(c)
                late.append(c)
            c.reduced = True
        if comm.world > 1:  # a parameter used on any rank has a gradient, as in one-process training
            flags = comm.all_reduce_max(torch.tensor([float(s.has_grad) for s in self.slots]))
            for s, f in zip(self.slots, flags.tolist()):
                s.has_grad = f > 0
        if self.optimizer is not None:  # only now are these chunks' "has a gradient" flags final
            for c in late:
                self.optimizer.gradient_final(c)
        self._backward_open = False
        self.phase = "idle"
        self.pool.release_pins()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
