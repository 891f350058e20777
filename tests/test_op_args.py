"""The trace's own flattening of kernel arguments gives what torch's pytree gives."""

import collections
from collections import OrderedDict

import torch
from torch.utils import _pytree as pytree

from elixir_ray.engine.op_args import flatten, leaves, map_leaves, unflatten

Pair = collections.namedtuple("Pair", "a b")
T = torch.ones(2, 3)


def _trees():
    """Arguments and results as kernels see them, and the containers pytree knows beyond them."""
    return [
        T,
        None,
        (T, [T, T], 1, 2.5, True, None, "mean", torch.float16, torch.device("meta"), torch.strided,
         torch.contiguous_format),
        ((T, T), {"dim": [0, 1], "keepdim": False, "dtype": None}),
        {"b": T, "a": (1, [2, {"c": None}])},  # insertion order, not sorted keys
        [torch.Size([4, 5]), T.shape, (), [], {}],
        torch.return_types.max((T, T.long())),
        Pair(T, [1, 2]),
        OrderedDict([("y", T), ("x", 3)]),
        (torch.nn.Parameter(T.clone()), slice(1, 2), 3 + 1j),
    ]


def _same(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return x is y
    if type(x) is not type(y):
        return False
    if isinstance(x, (tuple, list)):
        return len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y))
    if isinstance(x, dict):
        return list(x) == list(y) and all(_same(x[k], y[k]) for k in x)
    return x == y


def test_leaves_and_rebuilt_trees_are_pytrees():
    for tree in _trees():
        expected = pytree.tree_leaves(tree)
        got = leaves(tree)
        assert len(got) == len(expected) and all(a is b for a, b in zip(got, expected)), tree
        values, spec = flatten(tree)
        assert all(a is b for a, b in zip(values, expected))
        assert _same(unflatten(values, spec), pytree.tree_unflatten(*pytree.tree_flatten(tree))), tree
        hash(spec)  # a key of the meta kernel cache
        as_names = map_leaves(lambda x: type(x).__name__, tree)
        assert _same(as_names, pytree.tree_map(lambda x: type(x).__name__, tree)), tree


def test_specs_tell_shapes_apart_and_match_equal_ones():
    _, a = flatten(((T, T), {"dim": 0}))
    _, b = flatten(((T, T), {"dim": 1}))  # other values, the same shape
    _, c = flatten(([T, T], {"dim": 0}))
    _, d = flatten(((T, T), {"axis": 0}))
    _, e = flatten(((T, (T,)), {"dim": 0}))
    assert a == b and hash(a) == hash(b)
    assert len({a, c, d, e}) == 4
