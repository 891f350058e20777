"""Parameters that refuse to be read while their chunk has no compute copy.

The engine frees an evicted chunk's compute copy by shrinking its storage to zero bytes, and the
module's parameters stay views of it, with their shapes. An op that read one then (`print(p)`,
`p.norm()` in a logging loop, `module.to(...)`, `torch.save(module)`) would read through a null
pointer: a segfault on the CPU, an illegal memory access that ends the CUDA context on a GPU.

So while its chunk is evicted, a parameter's class is ChunkParameter (an nn.Parameter still),
whose torch-function handler refuses such a read with an error that says how to get the weights;
what reads no element data (shape, dtype, requires_grad, .grad, hooks, `zeros_like`, a conversion
to the device and dtype it has, or to meta) passes. The class is
switched back to nn.Parameter when the chunk is fetched, so ops in forward and backward, where
the engine fetches before every use, pay nothing for the guard: a class assignment per parameter
per fetch and eviction instead of a Python call per op.

Inside the wrapped model's forward the guard fetches instead of refusing: a parameter read outside
its own module (a tied weight used by the parent, a layer's weight passed to a functional call) or
after another module's fetch evicted its chunk gets its chunk back first, with the chunks of every
other parameter the op reads (`GradReads.fetch`, set by the engine's hooks). A chunk still being
copied in by a prefetch keeps the class until the compute stream is ordered after the copy
(`ChunkStore.make_usable`), so a read waits for it, in forward or not.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn

_NO_SUBCLASS = torch._C.DisableTorchFunctionSubclass

_GRAD = torch.Tensor.grad

# attribute reads that hand out the parameter's memory under another name: refused like an op
_ALIASING_GETTERS = frozenset(getattr(torch.Tensor, name) for name in ("data", "T", "mT", "H", "mH", "real", "imag"))

# methods that read no element data and return no view of it
_READS_NO_DATA = frozenset({
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.ndimension, torch.Tensor.numel, torch.Tensor.nelement,
    torch.Tensor.element_size, torch.Tensor.stride, torch.Tensor.storage_offset, torch.Tensor.is_contiguous,
    torch.Tensor.untyped_storage, torch.Tensor.data_ptr, torch.Tensor.is_floating_point, torch.Tensor.is_complex,
    torch.Tensor.get_device, torch.Tensor.requires_grad_, torch.Tensor.register_hook,
    torch.Tensor.register_post_accumulate_grad_hook, torch.Tensor.is_pinned, torch.Tensor.is_shared,
    torch.Tensor._is_view, torch.Tensor.__len__, torch.Tensor.__dir__, torch.Tensor.__hash__,
    torch.Tensor.is_inference, torch.Tensor.is_conj, torch.Tensor.is_neg, torch.Tensor.dim_order,
    torch._has_compatible_shallow_copy_type, torch.numel, torch.is_floating_point, torch.is_complex,
    # new tensors of the parameter's shape, dtype or device (an EMA or a buffer started beside it)
    torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like, torch.rand_like, torch.randn_like,
    torch.randint_like, torch.Tensor.new_empty, torch.Tensor.new_zeros, torch.Tensor.new_ones,
    torch.Tensor.new_full, torch.Tensor.new_tensor,
})


# conversions that return the tensor itself when nothing changes (`model.to(device)` on the device
# it is on, `model.float()` in fp32): answered by asking an empty tensor of the same kind first
_CONVERSIONS = frozenset({
    torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.float, torch.Tensor.double, torch.Tensor.half,
    torch.Tensor.bfloat16, torch.Tensor.type, torch.Tensor.contiguous,
})


def _converts_to_itself(func, args: tuple, kwargs: dict) -> bool:
    """Whether the conversion reads no data: it returns the tensor itself, or a meta tensor (shapes
    only), or a type name (`p.type()`)."""
    probe = torch.empty(0, dtype=args[0].dtype, device=args[0].device)
    result = func(probe, *args[1:], **kwargs)
    return result is probe or not isinstance(result, torch.Tensor) or result.device.type == "meta"


def _reads_no_data(func) -> bool:
    if func in _READS_NO_DATA:
        return True
    name = getattr(func, "__name__", None)
    if name == "__set__":
        return True
    return name == "__get__" and getattr(func, "__self__", None) not in _ALIASING_GETTERS


def _evicted(t) -> bool:
    return type(t) is ChunkParameter and t.untyped_storage().nbytes() == 0 and t.numel() > 0


def _refuse_evicted(func, args: tuple, kwargs: dict) -> None:
    for group in (args, kwargs.values()):
        for a in group:
            found = [a] if isinstance(a, torch.Tensor) else list(a) if isinstance(a, (list, tuple)) else []
            for t in found:
                if _evicted(t):
                    raise RuntimeError(_message(t, func))


def _message(t: "ChunkParameter", func) -> str:
    what = getattr(func, "__name__", str(func))
    if what == "__get__":
        what = f".{func.__self__.__name__}"
    return (f"parameter {getattr(t, '_engine_name', '?')} was read ({what}) while its chunk has no copy on the "
            f"device: elixir_ray frees a chunk's compute copy when it evicts it (after every optimizer.step(), all "
            f"of them), so outside the wrapped model's forward and backward a parameter has no data. Read the "
            f"weights with model.state_dict() (full fp32 tensors on the host; a Hugging Face model saves them with "
            f"model.save_pretrained(path)), and compute with them (a regulariser, a norm "
            f"to log) inside the model's forward")


@dataclass
class GradReads:
    """Whether the engine holds gradients that a training loop may look for in `.grad` (from the end
    of a backward until zero_grad), and which accesses have been warned of.

    `.grad` stays None: gradients go into the chunks as they arrive. A loop that clips with
    `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`, or logs a norm from `.grad`, would
    otherwise clip nothing and log zeros, and one that clears `.grad` itself would clear nothing,
    silently. While gradients are held, every parameter is a ChunkParameter (resident ones too),
    so that its `.grad` access is seen; the wrapped model's next forward switches resident ones back.

    `released`: this step's updates started in the backward (accumulation_steps) and the gradients of
    the chunks whose state is on the device were released once applied (ChunkedAdam._release_gradient),
    until zero_grad: the warning says so, since nothing done between backward and step reaches them."""
    held: bool = False
    warned: set = field(default_factory=set)  # "__get__", "__set__"
    released: bool = False
    # the engine's hooks' fetch (EngineHooks.fetch_for_op): called with an op's arguments when it
    # reads a guarded parameter; one per wrapped model, shared by its parameters (dropped when
    # one is pickled or copied)
    fetch: Optional[Callable] = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "fetch": None}


# hand out the parameter's memory itself (a custom kernel's pointer): fetched in forward like a read
_HANDS_OUT_MEMORY = frozenset({torch.Tensor.data_ptr, torch.Tensor.untyped_storage})


# reads .grad only to convert it with the weights (module.to(...), .float()): not a loop looking for gradients
_CONVERTS_GRADS = nn.Module._apply.__code__


def _called_from_apply() -> bool:
    frame = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return False
        if frame.f_code is _CONVERTS_GRADS:
            return True
        frame = frame.f_back
    return False


def _warn_grad_access(t, func) -> None:
    reads = getattr(t, "_engine_grad_reads", None)
    kind = func.__name__
    if reads is None or not reads.held or kind in reads.warned or (kind == "__get__" and _called_from_apply()):
        return
    reads.warned.add(kind)
    name = getattr(t, "_engine_name", "?")
    if kind == "__get__":
        text = (f"the .grad of parameter {name} was read after backward(), but elixir_ray keeps gradients in its "
                f"chunks, so .grad is None: torch.nn.utils.clip_grad_norm_ clips nothing, a norm computed from .grad "
                f"is 0, and a submodule's zero_grad() clears nothing. Clip with elixir_ray.wrap(..., "
                f"max_grad_norm=...) (the norm is then optimizer.last_grad_norm), and clear gradients with "
                f"model.zero_grad() or optimizer.zero_grad()")
    else:
        text = (f"the .grad of parameter {name} was set after backward(), but elixir_ray keeps gradients in its "
                f"chunks: setting .grad (p.grad = None) neither clears nor changes them. Clear them with "
                f"model.zero_grad() or optimizer.zero_grad(), and clip with elixir_ray.wrap(..., max_grad_norm=...)")
    if reads.released:
        text += (". Besides, this step's updates already ran during backward (wrap(..., accumulation_steps=N) starts "
                 "them there), and the gradients of the chunks whose optimizer state is on the device were applied "
                 "and released then: nothing done between backward() and optimizer.step() reaches them. Clipping "
                 "(max_grad_norm=...) starts the updates at step() instead, as does accumulation_steps=None, which "
                 "keeps the gradients in the chunks until zero_grad()")
    warnings.warn(text, stacklevel=outside_torch_and_us())


_LIBRARY_DIRS = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.dirname(__file__)) + os.sep)


def outside_torch_and_us() -> int:
    """The stacklevel, for a warn in the function that calls this, of the first caller outside torch and
    this package: the user's line (a clip_grad_norm_ call), not the comprehension inside torch that read."""
    frame, level = sys._getframe(2), 2  # level 1: the function that warns
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def _fetch_for_op(args: tuple, kwargs: dict) -> None:
    """The engine of each guarded parameter among an op's arguments (one level into lists:
    `torch.cat([a.weight, b.weight])`) gets the op's arguments: inside its forward it fetches the
    chunks of all the parameters they hold, plain ones too (a fetch for one must not evict another
    the op reads); elsewhere it only waits for a copy in flight, and an evicted read is refused."""
    engines = []
    for group in (args, kwargs.values()):
        for a in group:
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if type(t) is ChunkParameter:
                    reads = getattr(t, "_engine_grad_reads", None)
                    if reads is not None and reads.fetch is not None and not any(r is reads for r in engines):
                        engines.append(reads)
    for reads in engines:
        reads.fetch(args, kwargs)


class ChunkParameter(nn.Parameter):
    """An nn.Parameter whose chunk is evicted (or still being copied in), or whose gradient the
    engine holds (see the module docstring and GradReads)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is _GRAD and args:
            _warn_grad_access(args[0], func)
        with _NO_SUBCLASS():  # results are plain tensors, as nn.Parameter's are; the checks call no handler
            reads_data = not _reads_no_data(func)
            if reads_data or func in _HANDS_OUT_MEMORY:
                _fetch_for_op(args, kwargs)
            if reads_data and not (func in _CONVERSIONS and _converts_to_itself(func, args, kwargs)):
                _refuse_evicted(func, args, kwargs)
            return func(*args, **kwargs)


def guardable(named: list[tuple[nn.Parameter, str]], grad_reads: GradReads) -> list[nn.Parameter]:
    """Those of a chunk's parameters the guard may switch (plain nn.Parameters: another subclass
    keeps its class), each told its name for the error and where the engine says whether it holds
    gradients."""
    out = []
    for param, name in named:
        if type(param) is nn.Parameter:
            param._engine_name = name
            param._engine_grad_reads = grad_reads
            out.append(param)
    return out


def mark_evicted(params: list[nn.Parameter], evicted: bool) -> None:
    """Switch the class of `params` (the same objects: optimizers and user code hold them)."""
    cls = ChunkParameter if evicted else nn.Parameter
    for p in params:
        p.__class__ = cls
