"""Meta kernels answered from memory: a traced model repeats the same calls block after block.

On the meta device a kernel computes only its outputs' shapes, strides and dtypes, and many of
torch's meta kernels do that in Python (elementwise type promotion, broadcasting, stride order),
at about half a millisecond a call: most of a trace's time. Those outputs depend on nothing but
the operator, its arguments' metadata and its non-tensor arguments, and a GPT's 48 blocks make the
same calls 48 times, so `MetaKernelCache` answers a repeated call with fresh meta tensors of the
recorded layout instead of running the kernel again.

Only calls whose answer cannot depend on anything else are answered from memory: every tensor
argument on the meta device (a CPU tensor's values can decide a shape), nothing written in place
or through `out=`, no output that aliases an argument or another output (a view must stay a view,
for the activation count that follows storages), no random kernel, and outputs that are plain
tensors (not zero tensors, no numbers or flags) whose fresh copy has the storage size the kernel
gave. The default dtype is part of the key. Anything else runs as it would without the cache.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from elixir_ray.engine.live_memory import storage_key
from elixir_ray.engine.op_args import flatten, leaves, unflatten

_NOT_CACHEABLE = object()
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # a subclass of its own may compute other layouts


def _returns_fresh(func) -> bool:
    """Whether the schema promises new tensors: no argument written, no return aliasing one."""
    schema = func._schema
    if any(a.alias_info is not None for a in schema.arguments):
        return False
    if any(r.alias_info is not None for r in schema.returns):
        return False
    return torch.Tag.nondeterministic_seeded not in func.tags and not func.is_view


def _arg_key(x):
    """A hashable stand-in for one argument, or _NOT_CACHEABLE."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "meta" or x.layout != torch.strided or type(x) not in _PLAIN:
            return _NOT_CACHEABLE
        return ("T", tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, x.is_conj(), x.is_neg())
    if x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                   torch.memory_format)):
        return (type(x), x)
    return _NOT_CACHEABLE


class MetaKernelCache(TorchDispatchMode):
    """Below every other mode of a trace: answers repeated meta kernel calls from a record."""

    def __init__(self):
        super().__init__()
        self._fresh: dict = {}  # operator -> whether its schema allows an answer from memory
        self._answers: dict = {}  # call key -> (output tree spec, layouts), or None: run it every time
        self.hits = 0
        self.misses = 0

    def _key(self, func, args: tuple, kwargs: dict):
        fresh = self._fresh.get(func)
        if fresh is None:
            fresh = self._fresh[func] = _returns_fresh(func)
        if not fresh:
            return None
        values, spec = flatten((args, kwargs))
        keys = []
        for leaf in values:
            k = _arg_key(leaf)
            if k is _NOT_CACHEABLE:
                return None
            keys.append(k)
        # a factory without a dtype, or an integer division, takes the default dtype (which a model may set)
        return (func, spec, tuple(keys), torch.get_default_dtype())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        key = self._key(func, args, kwargs)
        if key is None:
            return func(*args, **kwargs)
        if key in self._answers:
            answer = self._answers[key]
            if answer is None:
                return func(*args, **kwargs)
            self.hits += 1
            spec, layouts = answer
            return unflatten([None if layout is None else _fresh_like(layout) for layout in layouts], spec)
        self.misses += 1
        out = func(*args, **kwargs)
        self._answers[key] = _record(out, args, kwargs)
        return out


def _fresh_like(layout: tuple) -> torch.Tensor:
    shape, stride, dtype = layout
    return torch.empty_strided(shape, stride, dtype=dtype, device="meta")


def _record(out, args: tuple, kwargs: dict):
    """The outputs' layouts, or None where a fresh copy would not be the same thing."""
    outs, spec = flatten(out)
    inputs = {storage_key(t) for t in leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    seen: set[int] = set()
    layouts = []  # per output leaf: (shape, stride, dtype) of a tensor, or None
    for leaf in outs:
        if isinstance(leaf, torch.Tensor):
            if type(leaf) not in _PLAIN or leaf.device.type != "meta" or leaf.layout != torch.strided:
                return None
            storage = storage_key(leaf)
            if storage in inputs or storage in seen or leaf.storage_offset() != 0 or leaf._is_zerotensor():
                return None
            seen.add(storage)
            layout = (tuple(leaf.shape), leaf.stride(), leaf.dtype)
            if _fresh_like(layout).untyped_storage().nbytes() != leaf.untyped_storage().nbytes():
                return None
            layouts.append(layout)
        elif leaf is None:
            layouts.append(leaf)
        else:  # a number or flag may depend on what the key leaves out (the arguments' storage sizes)
            return None
    return spec, layouts
