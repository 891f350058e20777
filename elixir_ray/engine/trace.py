"""Trace which parameters a training step touches, and in what order, without real weights.

One forward and backward of the sample inputs runs on the meta device (parameters, buffers and
inputs are swapped for meta tensors, then restored), recording:
- every module forward (recomputation under activation checkpointing included) with its direct
  parameters, and every parameter read back from autograd's saved tensors in backward;
- which parameters received a gradient, and in what order (how many chunks collect gradients at once);
- the bytes of activations autograd saved, the peak of all activation memory alive at once
  (`live_memory`: saved tensors plus backward's gradients and recomputed blocks), the
  matmul-class FLOPs of the step (torch's FLOP formulas, as its FlopCounterMode uses them; the
  mode itself is not used, since its module tracking keeps tensors alive), and every distinct kernel
  call with its shapes and count (`op_record`), for the planner to time on the device.
Repeated meta kernel calls are answered from a record of the first (`meta_kernels`): a model's
blocks repeat them, and computing meta outputs was most of a trace's time.
Parameters are identified by their storage, so views (a transposed weight) count as the weight,
and a saved activation counts once however many ops save it or views of it.

On the meta device `scaled_dot_product_attention` always takes the math path, which saves the
T×T attention matrix in fp32; on a GPU (and on CPU) torch runs a fused kernel that saves only the
output and the log-sum-exp. The trace therefore routes attention to the fused kernel's meta
implementation (`_FusedAttentionOnMeta`), or it would count several times the real activations.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from elixir_ray.engine.live_memory import LiveBytes, storage_key
from elixir_ray.engine.meta_kernels import MetaKernelCache
from elixir_ray.engine.op_record import OpCall, OpRecorder
from elixir_ray.engine.sample import SampleInputs, as_sample_inputs, check_scalar_loss, loss_in, tuple_hint
from elixir_ray.engine.shadow_values import MAX_SHADOW_ELEMENTS, ShadowValues


@dataclass
class AccessTrace:
    order: list[int]  # parameter indices in first-use order
    events: list[tuple[int, ...]]  # parameter indices touched by each access, in step order
    phases: list[str]  # per event: "forward", "recompute" or "backward"
    got_grad: list[bool]  # per parameter: received a gradient in the traced step
    saved_activation_bytes: int
    saved_before: list[int] = field(default_factory=list)  # per event: activation bytes saved so far
    largest_saved_bytes: int = 0  # the largest single saved activation
    activation_peak_bytes: int = 0  # the most bytes of activations (and their gradients) alive at once
    live_before: list[int] = field(default_factory=list)  # per event: activation bytes alive
    # per event: the most activation bytes alive since the event before (the last one also counts
    # what follows it), so that the largest is activation_peak_bytes
    live_high: list[int] = field(default_factory=list)
    flops: int = 0  # matmul-class FLOPs of the step (forward, recompute and backward)
    forward_flops: int = 0  # of which the forward pass (before backward starts)
    grad_epochs: list[int] = field(default_factory=list)  # per event: gradients accumulated before it
    grad_order: list[int] = field(default_factory=list)  # parameter indices in the order their gradients were final
    # backward's memory over time, sampled at each event and at each gradient's arrival: (the most
    # activation bytes alive since the sample before, the moment it ends: 2k after k gradients have
    # arrived, 2k+1 as gradient k arrives), for the planner to set beside the gradient buffers
    # held at the same moments (layout.gradient_buffer_moments); the last sample covers the end
    memory_samples: list[tuple[int, int]] = field(default_factory=list)
    ops: list[OpCall] = field(default_factory=list)  # the distinct kernel calls of the step, with counts
    # the step read values computed from the weights (a learned router): traced with the real weights
    # beside the meta ones, and another step, or another rank, may use other parameters
    weights_read: bool = False
    # forward used a view of a parameter taken before another module's parameters were fetched
    # (`wa, wb = self.gate.weight.chunk(2)`, used after other layers ran), which the engine must
    # catch per op (hooks.py): a description of the first such use, "" for none, None when not watched
    held_view: Optional[str] = None


def unique_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(first name, parameter) for each distinct parameter; a tied weight appears once."""
    seen, out = set(), []
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


@contextmanager
def _on_meta(module: nn.Module, params: list[nn.Parameter], dtype: Optional[torch.dtype] = None):
    """Temporarily replace every parameter and buffer by a meta stand-in of the same shape.

    Floating-point stand-ins take `dtype` (the compute dtype) when given, so that the activations
    counted are those the engine's compute copies will produce. Yields the stand-ins in the order
    of `params` (a tied parameter gets one shared stand-in), and the buffers' stand-ins.
    """
    def meta_like(t):
        return torch.empty_like(t, device="meta", dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype)

    stand_in = {id(p): nn.Parameter(meta_like(p), requires_grad=p.requires_grad) for p in params}
    swapped, buffers, originals = [], [], []
    for mod in module.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                swapped.append((mod._parameters, name, p))
                mod._parameters[name] = stand_in[id(p)]
        for name, buf in mod._buffers.items():
            if buf is not None:
                swapped.append((mod._buffers, name, buf))
                mod._buffers[name] = meta_like(buf)
                buffers.append(mod._buffers[name])
                originals.append(buf)
    try:
        yield [stand_in[id(p)] for p in params], list(zip(buffers, originals))
    finally:
        for table, name, original in swapped:
            table[name] = original


def _shadow_of(x, dtype: Optional[torch.dtype] = None) -> Optional[torch.Tensor]:
    """A private copy of a sample input's values (in-place kernels on it must not touch the caller's)."""
    if not isinstance(x, torch.Tensor) or x.layout != torch.strided or x.numel() > MAX_SHADOW_ELEMENTS:
        return None
    return x.detach().to("cpu", dtype if dtype is not None and x.is_floating_point() else x.dtype, copy=True)


def _to_meta(x, dtype: Optional[torch.dtype] = None):
    if not isinstance(x, torch.Tensor):
        return x
    return torch.empty_like(x, device="meta", dtype=dtype if dtype is not None and x.is_floating_point() else x.dtype)


class _FusedAttentionOnMeta(TorchFunctionMode):
    """Trace `F.scaled_dot_product_attention` on meta tensors as the fused kernel a device runs.

    Without a mask, flash attention's meta implementation (which takes fewer key/value heads than
    query heads, as the real kernels do); with one, the memory-efficient kernel's. Both save what
    the real fused kernels save (query, key, value, output, log-sum-exp, and the mask), and torch's
    FLOP formulas count them, backward's recomputation of the scores included. Calls they cannot
    take (other devices, nested tensors, not 4-D) run unchanged. A CPU step with attention dropout
    takes the math path for real, which this under-counts (see docs/planner.md).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            out = _fused_attention(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


class _IndexListsOnCpu(TorchFunctionMode):
    """`ids[:, [-1, 0]]` on a meta tensor: torch turns the list into an index tensor on the meta
    device, whose values are lost, so a value read after it (Hugging Face's check for padding in
    `input_ids`, `pad_token_id in ids[:, [-1, 0]]`) fails. Made on the CPU instead, the index keeps
    its values and ShadowValues follows the result."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__ and len(args) == 2 and args[0].device.type == "meta":
            index = args[1]
            if isinstance(index, tuple):
                args = (args[0], tuple(_cpu_index(i) for i in index))
            else:
                args = (args[0], _cpu_index(index))
        return func(*args, **kwargs)


class _GroupedMmAtAnyDtype(TorchDispatchMode):
    """torch's meta kernel for `_grouped_mm` takes only bfloat16, while its CPU kernel, and the
    engine's fp32 and fp16 compute, take the others too. Hugging Face's mixture-of-experts layers
    (Mixtral, Qwen-MoE) call it at the model's dtype, so their step could not be traced at fp32.
    On meta tensors of another dtype this answers with the bfloat16 kernel's shape in the inputs'
    dtype (its backward calls `_grouped_mm` again and is answered the same way). Entered only for
    modules with 3-D parameters (stacked experts' weights), which are what it multiplies by."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default:
            a, b = args[0], args[1]
            if a.device.type == "meta" and b.device.type == "meta" and a.dtype == b.dtype != torch.bfloat16 \
                    and a.dtype.is_floating_point:
                as_bf16 = [x.to(torch.bfloat16) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                           for x in args]
                out_dtype = kwargs.get("out_dtype") or (args[4] if len(args) > 4 else None) or a.dtype
                shaped = func(*as_bf16, **{k: v for k, v in kwargs.items() if k != "out_dtype"})
                return torch.empty(shaped.shape, dtype=out_dtype, device="meta")
        return func(*args, **kwargs)


class _HeldViewWatch(TorchFunctionMode):
    """Finds a forward that keeps a view of a parameter across another fetch.

    The engine fetches a module's chunks in its pre-hook, and an evicted parameter fetches itself
    when an op reads it (param_guard.ChunkParameter). A view of a parameter is a plain tensor,
    though: taken while its chunk was resident and read after another fetch may have evicted that
    chunk, it would read freed memory. Such a model needs the engine's per-op check (a Python call
    per op in forward), which every other model is spared. Here each view of a parameter made in
    forward (any tensor on a parameter's storage: `w.t()`, `w.chunk(2)`, `w.detach()`) is noted
    with the count of fetches (`epoch`) so far, and an op that takes one made before the latest
    fetch is the use that needs it. Fetches are the modules' pre-hooks and, since a guard may
    fetch there, ops that read a parameter of another module than the one fetched last.
    Only the sample's path is seen: the engine takes the per-op check for good once a step takes
    a path the trace did not (hooks.py).
    """

    def __init__(self, param_keys: set, param_ids: set, phase: dict):
        super().__init__()
        self.param_keys, self.param_ids, self.phase = param_keys, param_ids, phase
        self.epoch = 0
        self.own: set = set()  # ids of the parameters of the module fetched last
        self.views: dict[int, tuple[torch.Tensor, int]] = {}  # id -> (the view, held so that its id stays its own; epoch)
        self.found = ""

    def fetched(self, module: nn.Module) -> None:
        """A module's pre-hook ran."""
        self.epoch += 1
        self.own = {id(p) for p in module.parameters(recurse=False)}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.found or self.phase["phase"] != "forward":
            return func(*args, **kwargs)
        foreign = False
        for a in (*args, *kwargs.values()):
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                seen = self.views.get(id(t))
                if seen is not None and seen[1] != self.epoch:
                    self.found = (f"{getattr(func, '__name__', func)} took a view of a parameter made before "
                                  f"{self.epoch - seen[1]} later fetch(es)")
                elif id(t) in self.param_ids and id(t) not in self.own:
                    foreign = True
        if foreign:  # after the check: a view and a parameter read by one op are fetched together
            self.epoch += 1
            self.own = set()
        out = func(*args, **kwargs)
        for t in (out if isinstance(out, (list, tuple)) else (out,)):
            if type(t) is torch.Tensor and t.layout == torch.strided and t.device.type == "meta":
                try:
                    key = storage_key(t)
                except (NotImplementedError, RuntimeError):  # a wrapper without storage (vmap's batched tensors)
                    continue
                if key in self.param_keys:
                    self.views[id(t)] = (t, self.epoch)
        return out


def _cpu_index(index):
    if isinstance(index, list) and index and all(type(i) in (int, bool) for i in index) \
            and len({type(i) for i in index}) == 1:
        return torch.tensor(index, device="cpu")
    return index


def _fused_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False) -> Optional[torch.Tensor]:
    tensors = (query, key, value) + ((attn_mask,) if attn_mask is not None else ())
    if not all(isinstance(t, torch.Tensor) and t.device.type == "meta" and not t.is_nested for t in tensors):
        return None
    if query.dim() != 4 or (attn_mask is not None and is_causal):
        return None
    if key.shape[1] != query.shape[1] and not enable_gqa:
        return None  # torch refuses it too; let it say so
    if attn_mask is None:
        return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal,
                                                                  scale=scale)[0]
    if key.shape[1] != query.shape[1]:  # the memory-efficient kernel wants one key/value head per query head
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    bias = attn_mask if attn_mask.dtype != torch.bool else torch.empty(
        attn_mask.shape, dtype=query.dtype, device=query.device)
    bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    out = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, query.requires_grad or key.requires_grad or value.requires_grad,
        dropout_p, is_causal, scale=scale)
    return out[0]


# what torch says when a meta tensor's values are read (.item(), bool(), nonzero(), .tolist())
_VALUE_READS = ("cannot be called on meta tensors", "data-independent implementation does not exist",
                "no fake impl or Meta kernel", "Cannot copy out of meta tensor")


class _SavedInBackward:
    """A tensor autograd saved during backward (a recomputation's), as the trace keeps it: its
    unpack is no parameter access."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class ValueReadError(RuntimeError):
    """The step read the values of a tensor the trace has none for."""


def _forward_on_meta(module: nn.Module, inputs: SampleInputs, loss_fn):
    try:
        out = inputs.call(module)
        loss = loss_fn(out) if loss_fn else loss_in(out)
    except TypeError as exc:
        if "forward()" not in str(exc) or "argument" not in str(exc):
            raise
        one_dict = (" (a dict that forward takes as one input goes in a tuple: sample_inputs=(batch,))"
                    if inputs.kwargs and not inputs.args else "")
        raise TypeError(f"{exc}: the trace calls {type(module).__name__} with {inputs.describe()}. Give "
                        f"sample_inputs every input forward needs: a tuple of its positional inputs, or a dict "
                        f"of its keyword inputs{one_dict}") from exc
    except (RuntimeError, NotImplementedError) as exc:
        if not any(m in str(exc) for m in _VALUE_READS):
            raise
        raise ValueReadError(
            f"tracing one step of {type(module).__name__} on the meta device failed: {exc}. The trace can read "
            f"values computed from sample_inputs (masks, positions), and from the weights when the module has "
            f"real ones (not built on the meta device), but not from tensors the step makes on another "
            f"device") from exc
    if loss_fn is not None and not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss_fn returned a {type(loss).__name__}, not the step's loss tensor")
    if loss is None:
        # a step traced without its backward would plan without gradients, recomputation or backward's
        # order of accesses: refused rather than planned wrong
        what = "a ModelOutput with no loss" if hasattr(out, "loss") else f"a {type(out).__name__}"
        given = (tuple_hint(out) if isinstance(out, (tuple, list)) else
                 "loss_fn=, a function from forward's output to the loss")
        raise TypeError(f"{type(module).__name__}'s forward returned {what}, and the trace runs one backward "
                        f"from the step's loss: pass {given}, or return the loss (a Hugging Face model returns "
                        f"one when labels are among sample_inputs)")
    check_scalar_loss(loss, out, loss_fn, type(module).__name__)
    return loss


def _backward_with_modes(loss: torch.Tensor) -> None:
    """`loss.backward()` with this thread's function modes still on.

    `Tensor.backward` and `torch.autograd.backward` go through `__torch_function__`, which turns
    the active mode off while it handles them, so checkpointed blocks would be recomputed without
    `_FusedAttentionOnMeta` (and save different tensors than their forward did). Autograd's engine
    is what both of them call in the end.
    """
    torch.autograd.Variable._execution_engine.run_backward(
        (loss,), (torch.ones_like(loss),), False, False, (), True, True)


def check_not_wrapped(module: nn.Module) -> None:
    """A module wrapped before has its parameters in that wrap's chunks and its hooks on: a second
    trace would run into them (the "called directly" refusal, which points the wrong way)."""
    for name, mod in module.named_modules():
        if any(getattr(h, "__qualname__", "").startswith("EngineHooks.") for h in mod._forward_pre_hooks.values()):
            what = f"{type(module).__name__}" + (f" (its {name})" if name else "")
            raise ValueError(f"this {what} was already given to elixir_ray.wrap, and its parameters live in that "
                             f"wrap's chunks: keep training the model that wrap returned, or wrap a fresh module "
                             f"(copy.deepcopy(module) before the first wrap)")


def trace_step(module: nn.Module, sample_inputs, loss_fn=None, dtype: Optional[torch.dtype] = None,
               watch_views: bool = False) -> AccessTrace:
    """Trace one step on the meta device. A step that reads values computed from the weights (which
    experts a learned router picks) is traced again with the weights' real values carried beside
    the meta tensors: every kernel then also runs on the CPU, so this costs a real step there.
    `watch_views`: also find whether forward keeps a view of a parameter across another module's
    fetch (`AccessTrace.held_view`; wrap asks, the planner need not)."""
    sample_inputs = as_sample_inputs(sample_inputs)
    check_not_wrapped(module)
    try:
        return _trace_step(module, sample_inputs, loss_fn, dtype, with_weights=False, watch_views=watch_views)
    except ValueReadError as exc:
        if any(t.device.type == "meta" for t in [*module.parameters(), *module.buffers()]):
            raise ValueReadError(f"{exc}; this module's weights are on the meta device, so there are no values "
                                 f"to read: build it with real weights") from exc.__cause__
    return _trace_step(module, sample_inputs, loss_fn, dtype, with_weights=True, watch_views=watch_views)


def _trace_step(module: nn.Module, sample_inputs: SampleInputs, loss_fn, dtype: Optional[torch.dtype],
                with_weights: bool, cache_kernels: bool = True, watch_views: bool = False) -> AccessTrace:
    """`cache_kernels=False` runs every meta kernel (the tests compare the two)."""
    named = unique_parameters(module)
    params = [p for _, p in named]
    events: list[tuple[int, ...]] = []
    phases: list[str] = []
    got_grad = [False] * len(params)
    first_use: list[int] = []
    seen: set[int] = set()
    saved_before: list[int] = []
    live_before: list[int] = []
    live_high: list[int] = []
    live = None
    grad_epochs: list[int] = []
    state = {"phase": "forward", "saved": 0, "largest": 0, "grads": 0}
    # storage -> (bytes counted for it, the storage, held so that its key is never reused)
    saved_storages: dict[int, tuple[int, object]] = {}

    grad_order: list[int] = []
    memory_samples: list[tuple[int, int]] = []

    def on_grad(p, i):
        got_grad[i] = True
        memory_samples.append((live.take_high("sample"), 2 * state["grads"] + 1))
        grad_order.append(i)
        state["grads"] += 1
        p.grad = None  # the engine moves each gradient into its chunk's buffer, counted apart

    def record(indices, phase):
        if not indices:
            return
        events.append(tuple(indices))
        phases.append(phase)
        saved_before.append(state["saved"])
        live_before.append(live.live if live is not None else 0)
        live_high.append(live.take_high() if live is not None else 0)
        if live is not None:
            memory_samples.append((live.take_high("sample"), 2 * state["grads"]))
        grad_epochs.append(state["grads"])
        for i in indices:
            if i not in seen:
                seen.add(i)
                first_use.append(i)

    with _on_meta(module, params, dtype) as (metas, buffer_metas):
        key_to_index = {storage_key(p): i for i, p in enumerate(metas)}
        # buffers stay on the device whole (ModelProfile.buffer_bytes): a saved slice of one is no activation
        resident = set(key_to_index) | {storage_key(b) for b, _ in buffer_metas if b.layout == torch.strided}
        direct = {mod: [key_to_index[storage_key(p)] for p in mod.parameters(recurse=False)]
                  for mod in module.modules()}

        watch = _HeldViewWatch(set(key_to_index), {id(p) for p in metas}, state) if watch_views else None

        def pre_hook(mod, args):
            record(direct[mod], "forward" if state["phase"] == "forward" else "recompute")
            if watch is not None:
                watch.fetched(mod)

        pre_hook.keeps_layer_result = True  # reads only: the GPT's selective blocks trace as they run (model/gpt.py)

        def pack(t):
            # sparse gradients' parts are not counted, nor what backward saves: a recomputation's
            # (a block recomputed whole in its own autograd Function, model/gpt.py) lives only while
            # backward goes through that block, which the live bytes follow; and its unpacks are no
            # accesses, as the engine, whose saved-tensor hooks are on in forward only, makes none
            if state["phase"] != "forward":
                return _SavedInBackward(t)
            if t.layout != torch.strided:
                return t
            key = storage_key(t)
            if key not in resident:
                nbytes = max(t.untyped_storage().nbytes(), t.numel() * t.element_size())
                extra = nbytes - saved_storages.get(key, (0, None))[0]
                if extra > 0:  # a tensor (or a view of it) saved again costs nothing more
                    saved_storages[key] = (nbytes, t.untyped_storage())
                    state["saved"] += extra
                    state["largest"] = max(state["largest"], nbytes)
            return t

        def unpack(t):
            if type(t) is _SavedInBackward:
                return t.tensor
            i = key_to_index.get(storage_key(t)) if t.layout == torch.strided else None
            if i is not None and state["phase"] == "backward":
                record([i], "backward")
            return t

        handles = [m.register_forward_pre_hook(pre_hook) for m, ids in direct.items() if ids]
        handles += [p.register_post_accumulate_grad_hook(lambda p, i=i: on_grad(p, i))
                    for i, p in enumerate(metas) if p.requires_grad]
        recorder = OpRecorder()
        live = LiveBytes(resident)
        shadows = ShadowValues(max_elements=None if with_weights else MAX_SHADOW_ELEMENTS, follow_all=with_weights)
        if with_weights:
            for meta, p in zip(metas, params):
                shadows.add(meta, p.detach().to("cpu", meta.dtype, copy=True))
            for meta, buf in buffer_metas:
                shadows.add(meta, buf.detach().to("cpu", meta.dtype, copy=True))
        given = (sample_inputs.args, sample_inputs.kwargs)
        real_inputs = [_shadow_of(x, dtype) for x in tree_flatten(given)[0]]
        try:
            kernels = MetaKernelCache() if cache_kernels else nullcontext()  # first in: called last, by the kernel
            # the grouped matmul multiplies by experts' weights stacked in 3-D parameters: without one
            # it is never called, and a dispatch layer would cost every op of the trace (~10%)
            grouped = _GroupedMmAtAnyDtype() if any(p.dim() == 3 for p in metas) else nullcontext()
            with grouped, kernels, recorder, live, _FusedAttentionOnMeta(), _IndexListsOnCpu(), \
                    (watch if watch is not None else nullcontext()), \
                    torch.autograd.graph.saved_tensors_hooks(pack, unpack), shadows:
                inputs = tree_map(lambda x: _to_meta(x, dtype), given)
                for meta, real in zip(tree_flatten(inputs)[0], real_inputs):
                    if real is not None:
                        shadows.add(meta, real)
                loss = _forward_on_meta(module, SampleInputs(*inputs), loss_fn)
                state["phase"] = "backward"
                recorder.forward = False
                if isinstance(loss, torch.Tensor) and loss.requires_grad:
                    _backward_with_modes(loss)
        finally:
            for h in handles:
                h.remove()
    if live_high:
        live_high[-1] = max(live_high[-1], live.take_high())
    memory_samples.append((live.take_high("sample"), 2 * state["grads"]))  # what follows the last sample
    order = first_use + [i for i in range(len(params)) if i not in seen]
    ops = recorder.recorded()
    return AccessTrace(order=order, events=events, phases=phases, got_grad=got_grad,
                       saved_activation_bytes=state["saved"], saved_before=saved_before,
                       largest_saved_bytes=state["largest"], flops=sum(op.flops * op.count for op in ops),
                       forward_flops=sum(op.flops * op.forward_count for op in ops),
                       grad_epochs=grad_epochs, grad_order=grad_order, ops=ops,
                       activation_peak_bytes=live.peak, live_before=live_before, live_high=live_high,
                       memory_samples=memory_samples, weights_read=with_weights,
                       held_view=watch.found if watch is not None else None)
