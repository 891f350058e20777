"""Filling the chunks' fp32 masters from the module's weights, a module at a time.

A module built on the meta device never has its whole fp32 copy anywhere: each module's weights are
created on the host, initialised, copied into their chunks and dropped, in the order `module.apply`
visits modules, so a seeded run draws the random numbers plain torch's `module.apply(init_fn)` draws.

An `init_fn` may write weights of a module's descendants, not only the module's own: Hugging Face's
GPT-2 `_init_weights(attention)` rescales `attention.c_proj.weight` after `c_proj` was initialised
as a plain linear layer. Before anything is created, `init_fn` therefore runs once over the whole
module on meta stand-ins (no memory; torch's, Python's and numpy's global random generators are put
back afterwards) to see which weights each call touches. A weight is then kept on the host until
the last module whose `init_fn` touches it has run, and only then written to its chunk. Weights no
other module's call touches (every one in the built-in GPT) are written as soon as their own module
is done. `init_fn` is then called on every module, as apply calls it, so that the random draws line
up: twice per module in all, so it must depend only on the module and the global generators. Real
(not meta) weights and buffers are copied as given: a call sees copies, and what it does to them is
dropped.
"""

from __future__ import annotations

import contextlib
import random
import warnings
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from elixir_ray.engine.chunks import Chunk, ChunkStore, ParamSlot, write_slot
from elixir_ray.engine.device import random_state_kept
from elixir_ray.engine.param_guard import outside_torch_and_us


def post_order(module: nn.Module):
    """Children before their parent, as `nn.Module.apply` visits them."""
    for child in module.children():
        yield from post_order(child)
    yield module


def write_master(c: Chunk, slot: ParamSlot, flat: torch.Tensor) -> None:
    write_slot(c, c.master, slot, flat)


class _Touches(TorchFunctionMode):
    """Records which of the given tensors a piece of code passes to torch (reads or writes)."""

    def __init__(self, watched: set[int]):
        super().__init__()
        self.watched, self.seen = watched, set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and id(t) in self.watched:
                self.seen.add(id(t))
        return func(*args, **kwargs)


@contextlib.contextmanager
def _generators_kept(device: torch.device):
    """torch's (CPU and `device`), Python's and numpy's global random generators as they were."""
    py, npy = random.getstate(), np.random.get_state()
    try:
        with random_state_kept(device):
            yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)


def touched_by_init(order: list, init_fn: Callable[[nn.Module], None],
                    device: torch.device = torch.device("cpu")) -> list[set[int]]:
    """Per module of `order`, the ids of the parameters that `init_fn(module)` reads or writes, found
    by running it with every parameter and buffer swapped for a meta stand-in (the random generators
    left as they were). A call that fails on meta tensors (it needs values) counts as touching every
    weight below its module, with a warning where that is more than its own: they are then all kept
    on the host until it has run."""
    standin: dict[int, nn.Parameter] = {}  # original id -> stand-in (one per tied weight)
    original_of: dict[int, int] = {}
    swapped = []  # (table, name, original)
    for mod in order:
        for name, p in mod._parameters.items():
            if p is None:
                continue
            s = standin.get(id(p))
            if s is None:
                s = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
                standin[id(p)] = s
                original_of[id(s)] = id(p)
            swapped.append((mod._parameters, name, p))
            mod._parameters[name] = s
        for name, b in mod._buffers.items():
            if b is not None:
                swapped.append((mod._buffers, name, b))
                mod._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    watched = set(original_of)
    touches = []
    try:
        with _generators_kept(device):
            for mod in order:
                recorder = _Touches(watched)
                try:
                    with recorder:
                        init_fn(mod)
                    seen = recorder.seen
                except Exception as exc:  # noqa: BLE001 - an init that needs values: it may touch anything below
                    seen = {id(s) for s in mod.parameters()}
                    own = {id(s) for s in mod.parameters(recurse=False)}
                    below = [s for s in mod.parameters() if id(s) not in own]
                    if below:
                        size = sum(s.numel() * s.element_size() for s in below)
                        warnings.warn(f"init_fn({type(mod).__name__}) could not run on meta tensors ({type(exc).__name__}: "
                                      f"{exc}), so which weights below it it changes is unknown: they are kept on the host "
                                      f"until it has run ({size / 2**20:,.1f} MiB)", stacklevel=outside_torch_and_us())
                touches.append({original_of[i] for i in seen})
    finally:
        for table, name, value in reversed(swapped):
            table[name] = value
    return touches


@torch.no_grad()
def materialise(module: nn.Module, slots: list[ParamSlot], originals: list[torch.Tensor], store: ChunkStore,
                init_fn: Optional[Callable[[nn.Module], None]]) -> None:
    """Fill the chunks' masters from the module's weights, one module at a time.

    Real weights are copied. Meta weights are created on the host for one module (as stand-in
    parameters in its table), initialised by `init_fn(module)` (called on every module, as
    `module.apply` calls it, in its order) or the module's `reset_parameters`, copied into the
    chunks and dropped; weights shared by several modules, or touched by another module's
    `init_fn`, are kept until the last of them. A call sees copies of real weights and buffers,
    whatever it does to them is dropped.
    """
    slot_of = {id(s.param): (s, data) for s, data in zip(slots, originals)}
    order = list(post_order(module))
    owners: dict[int, list] = {}  # id -> [(module, name)]: a tied weight has several
    params: dict[int, nn.Parameter] = {}
    last: dict[int, int] = {}  # id -> index in `order` of the last module whose call may change it
    for i, mod in enumerate(order):
        for name, p in mod._parameters.items():
            if p is not None and id(p) in slot_of:
                owners.setdefault(id(p), []).append((mod, name))
                params[id(p)] = p
                last[id(p)] = i
    meta_ids = {pid for pid, (_, data) in slot_of.items() if data.device.type == "meta"}
    touches = [set() for _ in order]
    if init_fn is not None and meta_ids:
        touches = [seen & params.keys() for seen in touched_by_init(order, init_fn, store.device)]
        for i, seen in enumerate(touches):
            for pid in seen & meta_ids:
                last[pid] = max(last[pid], i)
    calls_all = init_fn is not None and bool(meta_ids)  # as module.apply does: the random draws line up
    live: dict[int, torch.Tensor] = {}  # made and not yet written: a later module's call may change it
    for i, mod in enumerate(order):
        own = {id(p) for p in mod._parameters.values() if p is not None and id(p) in slot_of}
        meta_buffers = {n: b for n, b in mod._buffers.items() if b is not None and b.device.type == "meta"}
        if not (calls_all or meta_buffers or own & meta_ids):
            for pid in own:
                slot, data = slot_of[pid]
                write_master(store.chunks[slot.chunk], slot, data.detach().float().reshape(-1).cpu())
            continue
        swapped = {pid: owners[pid] for pid in own | touches[i]}  # every name a tied weight goes by
        for pid, places in swapped.items():
            slot, data = slot_of[pid]
            if pid in meta_ids:
                value = live.get(pid)
                if value is None:
                    value = torch.empty(slot.shape, dtype=data.dtype)
            else:  # a copy: the call can change neither the caller's tensor nor the weight
                value = data.detach().cpu().clone()
            for owner, name in places:
                owner._parameters[name] = nn.Parameter(value, requires_grad=params[pid].requires_grad)
        real_buffers = {n: b for n, b in mod._buffers.items() if b is not None and n not in meta_buffers}
        for name, b in meta_buffers.items():
            mod._buffers[name] = torch.empty_like(b, device="cpu")
        for name, b in real_buffers.items():
            mod._buffers[name] = b.clone()
        if init_fn is not None:
            init_fn(mod)
        elif hasattr(mod, "reset_parameters"):
            mod.reset_parameters()
        mod._buffers.update(real_buffers)
        for pid, places in swapped.items():
            owner, name = places[0]
            value = owner._parameters[name].data if pid in meta_ids else slot_of[pid][1].detach().cpu()
            if last[pid] > i:
                if pid in meta_ids:
                    live[pid] = value
            else:
                live.pop(pid, None)
                slot, _ = slot_of[pid]
                write_master(store.chunks[slot.chunk], slot, value.float().reshape(-1))
            for owner, name in places:
                owner._parameters[name] = params[pid]  # the original object, now a view of its chunk
    for mod in module.modules():  # buffers live on the compute device, always resident
        for name, b in mod._buffers.items():
            if b is not None:
                mod._buffers[name] = b.to(store.device)
