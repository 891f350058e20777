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


def _slots_used(slots: dict, args: tuple, kwargs: Optional[dict]) -> list[ParamSlot]:
    """Slots of the wrapped parameters among an op's arguments, also inside list or tuple arguments
    (torch.cat([w, v]), foreach ops), one level deep. This runs for every op in forward, so it looks
    arguments up by id (the slots hold every parameter, so an id names one) instead of isinstance."""
    found = []
    for group in (args, kwargs.values()) if kwargs else (args,):
        for a in group:
            slot = slots.get(id(a))
            if slot is not None:
                found.append(slot)
            elif isinstance(a, (list, tuple)):  # builtin types: cheap, unlike nn.Parameter's isinstance
                found.extend(slots[id(x)] for x in a if id(x) in slots)
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
        used = _slots_used(runtime.slot_by_param, args, kwargs)
        if used:
            store = runtime.store
            if runtime.ordered:
                runtime.used.update(id(s) for s in used)
            if not all(store.usable(store.chunks[s.chunk]) for s in used):
                runtime.pool.access(tuple(s.chunk for s in used))
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
        # Several ranks: every rank must issue the same reductions in the same order, though a step
        # may use different parameters on each (experts routed by the input). Chunks are reduced in
        # one fixed order (highest index first, which is roughly when backward completes them), each
        # once every parameter this rank used in forward (`used`, ids of slots) has its gradient.
        self.ordered = store.comm.world > 1
        self.reduce_order = list(range(len(store.chunks) - 1, -1, -1))
        self.used: set[int] = set()
        self._backward_used: set[int] = set()
        self._next_reduce = 0
        self._deferred = []  # reduced, but a parameter had no gradient here: its update waits for all ranks' flags
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
            c.pending = sum(1 for s in c.slots if s.param.requires_grad and (not self.ordered or id(s) in self.used))
            c.reduced = False
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if self.ordered:
            self._backward_used, self.used = self.used, set()  # the next forward's starts empty
            self._next_reduce, self._deferred = 0, []
            self._reduce_in_order()  # chunks this rank did not use lead the order: their (zero) turn now

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self._backward_open:
            self.start_backward()
        self._recompute_open = False  # gradients arriving: the recomputed region's backward is under way
        slot = self.slot_by_param[id(param)]
        chunk = self.store.chunks[slot.chunk]
        if chunk.reduced:
            raise RuntimeError(
                f"a gradient for {slot.name} arrived after its chunk was reduced across ranks: the parameter was "
                f"not seen in the wrapped module's forward on this rank (used only outside it?), so its gradient "
                f"was not waited for. Use every parameter inside the wrapped module's forward")
        self.store.add_grad(slot, param.grad)
        param.grad = None
        slot.has_grad = True
        chunk.pending -= 1
        if chunk.pending > 0:
            return
        if self.ordered:
            self._reduce_in_order()
        else:
            self._reduce(chunk)
            if self.optimizer is not None:
                self.optimizer.gradient_final(chunk)

    def _reduce(self, c) -> None:
        self.store.reduce(c)
        c.reduced = True

    def _reduce_in_order(self, final: bool = False) -> None:
        """Reduce chunks in `reduce_order` while the next one is complete here (every one, when
        `final`): each rank's collectives come in the same order, whichever parameters it used."""
        order, chunks = self.reduce_order, self.store.chunks
        while self._next_reduce < len(order):
            c = chunks[order[self._next_reduce]]
            if c.pending > 0 and not final:
                return
            self._next_reduce += 1
            if not any(s.param.requires_grad for s in c.slots):  # frozen on every rank: nothing to reduce
                c.reduced = True
                continue
            self._reduce(c)
            if all(s.has_grad for s in c.slots if s.param.requires_grad) and not final:
                # every parameter has a gradient here, so on every rank after the flags are combined:
                # its update may start now
                if self.optimizer is not None:
                    self.optimizer.gradient_final(c)
            else:
                self._deferred.append(c)

    def _check_sharded_use(self, on_some: list, not_on_all: list) -> None:
        """A sharded chunk's fetch is an all-gather every rank must make at the same point, so a
        parameter in one that some ranks used and others did not has paired collectives wrongly
        (their data is garbage, if nothing hung): stop, naming them, rather than train on it."""
        mixed = [s for s, some, missing in zip(self.slots, on_some, not_on_all)
                 if some > 0 and missing > 0 and self.store.chunks[s.chunk].sharded]
        if mixed:
            chunks = sorted({s.chunk for s in mixed})
            raise RuntimeError(
                f"{len(mixed)} parameter(s) ({', '.join(s.name for s in mixed[:4])}{', ...' if len(mixed) > 4 else ''}) "
                f"were used in this step's forward on some ranks but not on others, and their chunks {chunks} are "
                f"sharded: fetching a sharded chunk is a collective every rank must make, so this step's gathers "
                f"did not pair up. Give wrap a plan with those chunks replicated (plan.sharded[i] = False), or "
                f"use every parameter on every rank")

    def _end_backward(self) -> None:
        """Reduce every chunk not reduced yet, in the same order on every rank."""
        comm = self.store.comm
        late = []
        if self.ordered:
            self._reduce_in_order(final=True)
            late = self._deferred
            # a parameter used on any rank has a gradient, as in one-process training; and whether
            # any parameter was used on some ranks but not all
            n = len(self.slots)
            used = [float(id(s) in self._backward_used) for s in self.slots]
            flags = comm.all_reduce_max(torch.tensor([float(s.has_grad) for s in self.slots] + used +
                                                     [1.0 - u for u in used])).tolist()
            for s, f in zip(self.slots, flags[:n]):
                s.has_grad = f > 0
            self._check_sharded_use(flags[n:2 * n], flags[2 * n:])
        else:
            for c in self.store.chunks:
                if not c.reduced and c.staging is not None:
                    self._reduce(c)
                    late.append(c)
                c.reduced = True
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
