"""The kernels a traced step launches, recorded by shape so that the planner can time them on a device.

FLOPs over a peak matmul rate miss what a GPU step really spends: on an H100 the layer norms,
GELUs, residual adds and casts of a GPT take about a third of plain PyTorch's step. The meta trace
records every distinct call (operator, argument shapes, strides and dtypes, other arguments) and
how often it runs, in forward and in the whole step, so that the planner can replay each distinct
call once on the real device (`elixir_ray.planner.op_timing`) and add up what the step costs.
Only `aten` kernels are recorded: a functional collective replayed on one rank would wait forever
for the others, and communication has its own place in the cost model.
Tensors are never kept: a call is described by `TensorSpec`s only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from elixir_ray.engine.op_args import leaves, map_leaves

# calls that allocate or alias without touching memory; timing them would only measure Python
_FREE = {"aten::detach", "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::lift_fresh", "aten::alias"}
# the fused attention kernels the trace uses (trace._fused_attention), forward and backward
ATTENTION_FORWARD = {"aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention"}
ATTENTION_BACKWARD = {f"{name}_backward" for name in ATTENTION_FORWARD}


def _grouped_mm_flops(a: torch.Tensor, b: torch.Tensor, *_args, out_val: torch.Tensor, **_kwargs) -> int:
    """Mixture-of-experts layers' grouped matmul, which torch's formulas leave out. Two 2-D operands
    (an expert weight's gradient) split their shared dimension over the groups, so every group's
    product adds up to one (M x T) @ (T x N); otherwise each output element is a dot product over
    the operands' last common dimension."""
    if a.dim() == 2 and b.dim() == 2:
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2 * out_val.numel() * a.shape[-1]


_OWN_FLOPS = {torch.ops.aten._grouped_mm: _grouped_mm_flops}


def _flops(func, name: str, args: tuple, kwargs: dict, out) -> int:
    """torch's FLOP formula for the call, or ours (0 where neither has one)."""
    if func.overloadpacket in _OWN_FLOPS:
        return int(_OWN_FLOPS[func.overloadpacket](*args, **kwargs, out_val=out))
    if func.overloadpacket not in flop_registry:
        return 0
    formula = flop_registry[func.overloadpacket]
    if name in ATTENTION_FORWARD | ATTENTION_BACKWARD:
        args = _heads_matched(args)
    return int(formula(*args, **kwargs, out_val=out))


def _heads_matched(args: tuple) -> tuple:
    """Grouped-query attention's key and value (fewer heads than the query) widened to the query's
    heads, as views: the attention does that much work, and torch before 2.12 counts only equal heads
    (its formula refuses the call otherwise)."""
    heads = max((a.shape[1] for a in args if isinstance(a, torch.Tensor) and a.dim() == 4), default=0)

    def widened(a):
        if isinstance(a, torch.Tensor) and a.dim() == 4 and 0 < a.shape[1] < heads and heads % a.shape[1] == 0:
            b, h, s, d = a.shape
            return a.unsqueeze(2).expand(b, h, heads // h, s, d).reshape(b, heads, s, d)
        return a
    return tuple(widened(a) for a in args)


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple
    stride: tuple
    dtype: torch.dtype


@dataclass
class OpCall:
    """One distinct call: the operator's name (as `torch.ops` spells it) and its arguments."""

    op: str  # e.g. "aten::addmm" (the default overload) or "aten::add.Tensor"
    args: tuple  # with TensorSpec in place of tensors and "DEVICE" in place of devices
    kwargs: dict
    flops: int  # per call (torch's FLOP formulas; 0 for memory-bound operators)
    bytes: int  # per call: tensors read and written
    count: int = 0  # calls in one step (forward, recomputation and backward)
    forward_count: int = 0  # of which in forward


def _spec(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided:
            return f"unreplayable {x.layout} tensor"  # its call is estimated, not replayed
        return TensorSpec(tuple(x.shape), tuple(x.stride()), x.dtype)
    if isinstance(x, torch.device):
        return "DEVICE"
    return x


def _key(op: str, args: tuple, kwargs: dict) -> str:
    return f"{op}|{args!r}|{sorted(kwargs.items())!r}"


def call_key(call: OpCall) -> str:
    """Identifies a distinct call: the same operator with the same argument shapes and values."""
    return _key(call.op, call.args, call.kwargs)


class OpRecorder(TorchDispatchMode):
    """Counts every distinct call made while it is on; `forward` says which phase the step is in."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, OpCall] = {}
        self.forward = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.name()
        if not name.startswith("aten::") or func.is_view or name.split(".")[0] in _FREE:
            return out  # collectives (their own cost model), profiler marks, aliases and allocations
        spec_args, spec_kwargs = map_leaves(_spec, args), map_leaves(_spec, kwargs)
        key = _key(name, spec_args, spec_kwargs)
        call = self.calls.get(key)
        if call is None:
            tensors = [t for t in leaves((args, kwargs, out))
                       if isinstance(t, torch.Tensor) and t.layout == torch.strided]
            flops = _flops(func, name, args, kwargs, out)
            call = self.calls[key] = OpCall(op=name, args=spec_args, kwargs=spec_kwargs, flops=flops,
                                            bytes=sum(t.numel() * t.element_size() for t in tensors))
        call.count += 1
        call.forward_count += int(self.forward)
        return out

    def recorded(self) -> list[OpCall]:
        return list(self.calls.values())
