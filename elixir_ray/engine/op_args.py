"""The tensors and values in a kernel's arguments and results, for the trace's dispatch modes.

Every kernel of a traced step passes through four dispatch modes (ShadowValues, LiveBytes,
OpRecorder, MetaKernelCache), and each looks at the kernel's arguments or results. An aten
kernel's are flat: tuples and lists of tensors and numbers, a dict of keyword arguments. torch's
general pytree asks of every value which registered container it is, which made flattening a large
part of a trace's time. This walks plain tuples, lists and dicts itself, takes tensors and
scalars as leaves, and hands anything else (torch.Size, a named tuple of results) to torch's
pytree, so its leaves come in the same order as torch's pytree gives them.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

_LEAVES = frozenset({torch.Tensor, torch.nn.Parameter, int, float, bool, complex, str, type(None),
                     torch.dtype, torch.device, torch.layout, torch.memory_format})
_BY_PYTREE = "pytree"  # a spec's tag for a part torch's pytree flattened


def _flatten_into(x: Any, out: list) -> Any:
    """Appends `x`'s leaves to `out`; returns the spec of `x` (None for a leaf)."""
    kind = type(x)
    if kind is tuple or kind is list:
        return kind, tuple([_flatten_into(v, out) for v in x])
    if kind is dict:
        return dict, tuple(x), tuple([_flatten_into(v, out) for v in x.values()])
    if kind in _LEAVES:
        out.append(x)
        return None
    values, spec = pytree.tree_flatten(x)
    out.extend(values)
    return _BY_PYTREE, spec, len(values)


def flatten(tree: Any) -> tuple[list, Any]:
    """The leaves of `tree` and a hashable spec of its shape, for `unflatten`."""
    out: list = []
    return out, _flatten_into(tree, out)


def leaves(tree: Any) -> list:
    out: list = []
    _flatten_into(tree, out)
    return out


def _build(spec: Any, values) -> Any:
    if spec is None:
        return next(values)
    kind = spec[0]
    if kind is tuple:
        return tuple([_build(s, values) for s in spec[1]])
    if kind is list:
        return [_build(s, values) for s in spec[1]]
    if kind is dict:
        return {k: _build(s, values) for k, s in zip(spec[1], spec[2])}
    return pytree.tree_unflatten([next(values) for _ in range(spec[2])], spec[1])


def unflatten(values: list, spec: Any) -> Any:
    """The tree of `spec`'s shape holding `values` in place of its leaves."""
    return _build(spec, iter(values))


def map_leaves(fn: Callable[[Any], Any], tree: Any) -> Any:
    values, spec = flatten(tree)
    return unflatten([fn(v) for v in values], spec)
