"""Building the chunked module from a plan: `check_wrappable`, `resolve_target`, then `build`.

`elixir_ray.wrap` calls these, with a plan searched between the last two when none is given.
Everything is checked before the module is touched: a bad optimizer or a plan that does not fit
the module raises with the module unchanged. Then parameters move into chunks (a module built on
the meta device is materialised module by module straight into the chunks), hooks are installed,
and the returned module and optimizer are used like the originals.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules.module import _IncompatibleKeys
from torch.utils._pytree import tree_flatten

from elixir_ray.chunk_plan.errors import PlanError
from elixir_ray.chunk_plan.layout import chunk_events, pack
from elixir_ray.chunk_plan.nodes import NodeLayout
from elixir_ray.chunk_plan.plan import Plan
from elixir_ray.engine.allocator import use_expandable_segments
from elixir_ray.engine.chunks import Chunk, ChunkStore, ParamSlot, own_part, write_part
from elixir_ray.engine.comm import Comm, NodeComms
from elixir_ray.engine.device import resolve_device
from elixir_ray.engine.hooks import EngineHooks
from elixir_ray.engine.materialise import materialise, post_order
from elixir_ray.engine.optimizer import (ChunkedAdam, DynamicLossScale, check_optimizer, refuse_other_optimizers,
                                         updates_start_in_backward)
from elixir_ray.engine.pool import ChunkPool
from elixir_ray.engine.sample import SampleInputs, as_sample_inputs, loss_in
from elixir_ray.engine.trace import check_not_wrapped, trace_step, unique_parameters
from elixir_ray.units import format_bytes


class StateDictMismatch(RuntimeError):
    """A state dict whose keys or shapes are not the module's: torch's RuntimeError, told apart from
    a failure a restore could retry."""


def _input_sizes(args: tuple, kwargs: dict) -> dict:
    """Elements of each tensor input, by position or keyword, and of the largest one anywhere in
    them (a tensor inside a list or dict): what a step's size is compared by."""
    sizes = {f"input {i}": a.numel() for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    sizes.update({f"input {k!r}": v.numel() for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
    sizes["largest input"] = max((x.numel() for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)),
                                 default=0)
    return sizes


def _largest_growth(step: dict, sample: dict) -> tuple[str, int, float]:
    """The input that grew most against the same input of the sample (a fixed-size table beside the
    tokens hides nothing), or the largest against the largest when the step names none the sample
    had (called positionally, traced by keyword)."""
    common = [k for k in step if k != "largest input" and sample.get(k)]
    keys = common or (["largest input"] if sample.get("largest input") else [])
    if not keys:
        return "", 0, 0.0
    key = max(keys, key=lambda k: step[k] / sample[k])
    return key, step[key], step[key] / sample[key]


class ChunkedModule(nn.Module):
    """The wrapped module: call it like the original; `state_dict()` returns full fp32 tensors."""

    def __init__(self, module: nn.Module, store: ChunkStore, pool: ChunkPool, hooks: EngineHooks,
                 slots: list[ParamSlot], plan: Plan, loss_scale: Optional[DynamicLossScale],
                 sample_sizes: Optional[dict] = None):
        super().__init__()
        # the wrapper's own attributes first: once `module` is set, a new name the module also has
        # is set on the module (__setattr__)
        self.store, self.pool, self.hooks, self.slots, self.plan = store, pool, hooks, slots, plan
        self.loss_scale = loss_scale
        # the sizes of sample_inputs' tensors (_input_sizes): the plan's activation budget is for steps that size
        self.sample_sizes, self.input_over_sample, self._warned_input = sample_sizes or {}, 0.0, False
        self.slot_by_param = {id(s.param): s for s in slots}
        self.module = module

    def forward(self, *args, **kwargs):
        if self.sample_sizes and torch.is_grad_enabled():
            self._check_input_size(args, kwargs)
        with self.store.on_device():
            out = self.hooks.forward(*args, **kwargs)
        if self.loss_scale is not None and torch.is_grad_enabled():
            loss = loss_in(out)
            if not (loss is not None and loss.requires_grad and loss.numel() == 1):
                raise TypeError("with dtype=torch.float16 the module must return the scalar loss (or a Hugging Face "
                                "ModelOutput holding it), so that the engine can scale it; return the loss from "
                                "forward, or use bfloat16")
            scale = self.loss_scale.scale
            loss.register_hook(lambda g: g * scale)
        return out

    def _check_input_size(self, args, kwargs) -> None:
        """A training step on inputs larger than sample_inputs saves more activations than the plan
        budgeted (the trace measured them at the sample's size): say so once, and keep the largest
        ratio for engine_stats(). Nothing else would tell, until the device runs out of memory."""
        name, numel, ratio = _largest_growth(_input_sizes(args, kwargs), self.sample_sizes)
        if ratio <= self.input_over_sample:
            return
        self.input_over_sample = ratio
        if ratio > 1 and not self._warned_input:
            self._warned_input = True
            acts = self.plan.memory.get("activations")
            budget = (f" (the plan's activations, {format_bytes(acts)}, of a predicted peak of "
                      f"{format_bytes(self.plan.predicted_peak_bytes)} within device_memory "
                      f"{format_bytes(self.plan.budget_bytes)})") if acts and self.plan.budget_bytes else ""
            warnings.warn(
                f"this training step's {name} has {numel:,} elements, {ratio:.2g}x as many as in sample_inputs: "
                f"the plan budgeted activation memory for the sample{budget}, and a step's activations grow with "
                f"its inputs, so this step may exceed device_memory. Give wrap sample_inputs shaped like the "
                f"largest micro-batch you train on (the longest padded length); "
                f"engine_stats()['input_over_sample'] keeps the largest ratio seen",
                stacklevel=5)  # model(...)'s caller: past this, forward and nn.Module's two call frames

    def generate(self, *args, **kwargs):
        """The module's own `generate` (a Hugging Face model's), with its parameters fetched as the
        wrapped forward fetches them: the module itself may not be called directly."""
        generate = getattr(self.module, "generate", None)
        if not callable(generate):
            raise AttributeError(f"{type(self.module).__name__} has no generate method")
        with self.store.on_device(), torch.no_grad():
            return self.hooks.call(generate, *args, **kwargs)

    def __getattr__(self, name: str):
        """What the wrapper itself lacks is the module's: code written for the model reads
        `model.config`, `model.device` or `model.generation_config`, and calls its helpers, on
        what wrap returned. Its parameters stay guarded (an evicted one refuses a read) and its
        submodules still refuse to be called outside the wrapped forward. Private names are not
        passed on, so torch's own probes of the wrapper see the wrapper."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_") or "module" not in self.__dict__.get("_modules", {}):
                raise
        module = self._modules["module"]
        try:
            return getattr(module, name)
        except AttributeError:
            if hasattr(type(module), name):  # a property of the module that raised: its own error says why
                raise
            raise AttributeError(f"neither the wrapped model nor its {type(module).__name__} "
                                 f"has an attribute {name!r}") from None

    def __setattr__(self, name: str, value) -> None:
        """An attribute the module has (and the wrapper does not) is set on the module, so that what
        the reads above pass on can be changed too (`model.generation_config = ...`, which the
        module's generate reads). Submodules, parameters and tensors are not passed on."""
        modules = self.__dict__.get("_modules", {})
        if (not name.startswith("_") and "module" in modules and name not in self.__dict__
                and not hasattr(type(self), name) and not isinstance(value, (nn.Module, torch.Tensor))
                and name in dir(modules["module"])):
            setattr(modules["module"], name, value)
            return
        super().__setattr__(name, value)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """A Hugging Face model's `save_pretrained`, given the engine's full weights
        (`state_dict=model.state_dict()`) unless the call names its own `state_dict`: the module's
        own parameters have no data while their chunks are evicted. Those weights are fp32, while
        the module's parameters are in the compute dtype, which the saved config would otherwise
        name (a bf16 run's model would load back in bf16). With several ranks `state_dict()` is a
        collective: call this on every rank, with `is_main_process=(rank == 0)`."""
        save = getattr(self.module, "save_pretrained", None)
        if not callable(save):
            raise AttributeError(f"{type(self.module).__name__} has no save_pretrained method: save the weights "
                                 f"with torch.save(model.state_dict(), path)")
        if "state_dict" in kwargs:
            return save(save_directory, *args, **kwargs)
        kwargs["state_dict"] = self.state_dict()
        config = getattr(self.module, "config", None)
        kept = {k: v for k, v in vars(config).items() if k in _DTYPE_KEYS} if config is not None else {}
        try:
            out = save(save_directory, *args, **kwargs)
        finally:
            if config is not None:  # save_pretrained writes the parameters' dtype into the config
                vars(config).update(kept)
        if kwargs.get("is_main_process", True):
            _config_names_fp32(os.path.join(os.fspath(save_directory), "config.json"))
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The engine's gradients live in chunks, not in `.grad`: this clears them, as the optimizer's
        zero_grad does (nn.Module's own would find no `.grad` to clear and the next backward would add
        to this one's)."""
        if self.hooks.optimizer is not None:
            self.hooks.optimizer.zero_grad(set_to_none)

    def engine_stats(self) -> dict:
        return dict(self.store.stats, n_blocks=self.pool.n_blocks, chunks=len(self.store.chunks),
                    input_over_sample=round(self.input_over_sample, 3))

    @torch.no_grad()
    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """Whole fp32 tensors on the host, under the module's own keys (each with `prefix` before it),
        into `destination` when given. `keep_vars` has no effect: there are no live tensors to keep."""
        if args:  # torch's old positional order, which it still takes
            destination, prefix, keep_vars = (list(args) + [destination, prefix, keep_vars][len(args):])[:3]
        with self.store.on_device():
            out = self._state_dict()
        if destination is None and not prefix:
            return out
        destination = OrderedDict() if destination is None else destination
        for key, value in out.items():
            destination[prefix + key] = value
        return destination

    def _state_dict(self):
        full = {}
        out = OrderedDict()
        for key, t in self.module.state_dict(keep_vars=True).items():
            slot = self.slot_by_param.get(id(t))
            if slot is None:
                out[key] = t.detach().cpu().clone()
                continue
            c = self.store.chunks[slot.chunk]
            if c.index not in full:
                full[c.index] = self.store.full_master(c)
            out[key] = full[c.index][slot.offset: slot.offset + slot.numel].view(slot.shape).clone()
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Copy values into the masters (and buffers), checked as torch checks them: every key and
        shape before anything is written. Returns torch's (missing_keys, unexpected_keys)."""
        if assign:
            raise ValueError("load_state_dict(assign=True) would replace the module's parameters, which are views "
                             "of the engine's chunks: load with assign=False (the default)")
        if self.hooks.optimizer is not None:
            self.hooks.optimizer.refuse_mid_update("load a state dict")
        with self.store.on_device():
            return self._load_state_dict(state_dict, strict)

    @torch.no_grad()
    def load_state_parts(self, state_dict, read_part: Callable[[str, int, int], torch.Tensor],
                         shape_of: Callable[[str], tuple]) -> None:
        """`load_state_dict` for a restore: each parameter's part this rank keeps is read with
        `read_part(key, lo, hi)` (elements [lo, hi) of its flat order), so a sharded checkpoint is
        never read whole on each rank; `shape_of(key)` is the shape of the value there (checked
        against the parameter's before anything is written); buffers come from `state_dict`.
        Refused between a backward that started updates and `optimizer.step()`, as
        `load_state_dict` is: the step would treat those chunks as updated and skip them."""
        if self.hooks.optimizer is not None:
            self.hooks.optimizer.refuse_mid_update("restore an engine state (load_engine_state)",
                                                   "Restore into a newly wrapped model, or after optimizer.step()")
        with self.store.on_device():
            try:
                self._load_state_dict(state_dict, True, read_part, shape_of)
            except StateDictMismatch as exc:  # a checkpoint of another model: no restart mends it
                raise ValueError(str(exc)) from exc

    def _load_state_dict(self, state_dict, strict: bool, read_part=None, shape_of=None) -> _IncompatibleKeys:
        self.store.settle_all()
        own = self.module.state_dict(keep_vars=True)
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if strict and (missing or unexpected):
            hint = ""
            if unexpected and all(k.startswith("module.") and k[len("module."):] in own for k in unexpected):
                hint = (" (the keys start with 'module.', as model.named_parameters() names them: state_dict() and "
                        "load_state_dict() use the module's own keys)")
            raise StateDictMismatch(f"Error(s) in loading state_dict for {type(self.module).__name__}: missing keys "
                               f"{missing[:5]}{' ...' if len(missing) > 5 else ''}, unexpected keys "
                               f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}{hint}; nothing was loaded "
                               f"(strict=False loads the keys that match)")
        if shape_of is None:
            def shape_of(key):
                return tuple(torch.as_tensor(state_dict[key]).shape)
        wrong = []  # every shape checked before anything is written, as torch does
        for key, t in own.items():
            shape = tuple(shape_of(key)) if key in state_dict else tuple(t.shape)
            if shape != tuple(t.shape) and not (t.numel() == 1 and math.prod(shape) == 1):  # 0-d saved as [1]
                wrong.append(f"{key}: {list(shape)} for {list(t.shape)}")
        if wrong:
            raise StateDictMismatch(f"size mismatch in load_state_dict ({len(wrong)} key(s)): {'; '.join(wrong[:4])}")
        last_key = {}  # a tied parameter is loaded once, from the last of its keys given (as torch does)
        for key, t in own.items():
            if key not in state_dict:
                continue
            slot = self.slot_by_param.get(id(t))
            if slot is None:
                value = torch.as_tensor(state_dict[key])
                if value.numel() == t.numel() == 1:
                    value = value.reshape(t.shape)  # a 0-d buffer saved as [1] (older checkpoints)
                t.copy_(value)
            else:
                last_key[id(slot)] = (key, slot)
        for key, slot in last_key.values():
            c = self.store.chunks[slot.chunk]
            lo, hi = own_part(c, slot)
            if lo < hi:
                part = (read_part(key, lo, hi) if read_part is not None
                        else torch.as_tensor(state_dict[key]).detach().float().reshape(-1)[lo:hi].cpu())
                write_part(c, c.master, slot, lo, hi, part)
        for c in self.store.chunks:
            self.store.refresh_upload(c)
        self.pool.reset()
        self.store.weights_version += 1
        return _IncompatibleKeys(missing, unexpected)


_DTYPE_KEYS = ("dtype", "torch_dtype")  # where Hugging Face configs (v5, v4) record the weights' dtype


def _config_names_fp32(path: str) -> None:
    """Make a saved Hugging Face config name float32, the dtype of the weights saved beside it
    (written to a temporary name, then renamed)."""
    if not os.path.isfile(path):
        return
    with open(path) as f:
        config = json.load(f)
    keys = [k for k in _DTYPE_KEYS if config.get(k) not in (None, "float32")]
    if not keys:
        return
    for key in keys:
        config[key] = "float32"
    _write_atomic(path, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())


def _write_atomic(path: str, payload: bytes) -> None:
    """Write under a temporary name in the same directory, synced, then rename over `path`: a crash
    leaves the old file or the new one, never half of one."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(payload)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    folder_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(folder_fd)
    finally:
        os.close(folder_fd)


def one_plan_for_all_ranks(comm: Comm, search: Callable[[], Plan]) -> Plan:
    """Rank 0's searched plan on every rank.

    Each rank measuring and searching alone could pick different chunkings (measured rates and
    kernel times vary), and the ranks' collectives would then not match. Rank 0's error, if it
    has one, is raised on every rank, so that none is left waiting.
    """
    if comm.world == 1:
        return search()
    error, text = None, None
    if comm.rank == 0:
        try:
            text = json.dumps({"plan": search().to_json()})
        except Exception as exc:  # sent on, then raised here too
            error = exc
            text = json.dumps({"error": f"{type(exc).__name__}: {exc}", "plan_error": isinstance(exc, PlanError),
                               "parts": exc.parts() if isinstance(exc, PlanError) else {}})
    message = json.loads(comm.broadcast_text(text))
    if error is not None:
        raise error
    if "error" in message:
        if message["plan_error"]:  # with its attributes: a loop that reads min_bytes reads it on every rank
            raise PlanError(f"rank 0 could not plan: {message['error']}", **message["parts"])
        raise RuntimeError(f"rank 0 could not plan: {message['error']}")
    return Plan.from_json(message["plan"])


def _check_same_accesses_on_every_rank(comm: Comm, events: list, prefetch: int) -> None:
    """Refuse, on every rank, ranks whose traced steps access the chunks in different orders.

    Each rank traces its own sample_inputs, and its pool fetches, evicts and prefetches by that
    trace; a sharded chunk's fetch is an all-gather every rank must join at the same point, so
    traces that differ (inputs routing to other layers, another `prefetch`) hang the first step
    instead of failing. Checked before anything is converted: one broadcast and one reduction."""
    if comm.world == 1:
        return
    digest = hashlib.sha256(json.dumps([[list(e) for e in events], prefetch]).encode()).hexdigest()
    differs = torch.zeros(comm.world, dtype=torch.float32)
    differs[comm.rank] = float(comm.broadcast_text(digest if comm.rank == 0 else None) != digest)
    ranks = [r for r, d in enumerate(comm.all_reduce_sum(differs).tolist()) if d]
    if ranks:
        raise ValueError(
            f"rank(s) {ranks} traced another order of chunk accesses than rank 0 from their sample_inputs (or were "
            f"given another prefetch): with sharded chunks every rank fetches (all-gathers) them at the same "
            f"points, so the first step would hang. Give every rank the same sample_inputs, or ones that take "
            f"the same path through the model, and the same prefetch")


def _check_meta_initialisable(module: nn.Module) -> None:
    """Without init_fn, a submodule whose own weights or buffers are on the meta device is initialised
    by its reset_parameters(); one without that method would keep whatever memory it was given (NaN
    losses, or a rotary embedding's frequencies made of garbage), so it is refused before any work."""
    names = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}

    def resets(mod) -> bool:
        return callable(getattr(mod, "reset_parameters", None))

    # a weight shared by several modules (tied) is initialised if any of them resets it
    reset_somewhere = {id(p) for mod in module.modules() if resets(mod)
                       for p in mod._parameters.values() if p is not None}
    seen: set[int] = set()
    missing = []
    for mod in post_order(module):
        if resets(mod):
            continue
        params = [(n, p) for n, p in mod._parameters.items() if p is not None and id(p) not in seen]
        seen.update(id(p) for _, p in params)
        tensors = [n for n, p in params if p.device.type == "meta" and id(p) not in reset_somewhere]
        tensors += [f"buffer {n}" for n, b in mod._buffers.items() if b is not None and b.device.type == "meta"]
        if tensors:
            missing.append(f"{names.get(id(mod)) or '(the module itself)'} ({type(mod).__name__}: {', '.join(tensors)})")
    if missing:
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        raise ValueError(
            f"{type(module).__name__} is on the meta device, and {len(missing)} of its modules hold meta weights or "
            f"buffers but have no reset_parameters() to initialise them: {'; '.join(missing[:4])}{more}. Pass "
            f"init_fn=, called on each module with meta weights (for a Hugging Face model: "
            f"init_fn=model._init_weights), or build the module with real weights")


def _check_parameter_dtypes(module: nn.Module) -> None:
    """Every parameter becomes a view of a chunk in one compute dtype (fp32 masters beside it): a model
    whose parameters differ in dtype, or are float64, would silently run in another precision."""
    counts: dict = {}
    for p in module.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + 1
    if len(counts) > 1 or torch.float64 in counts:
        found = ", ".join(f"{n} {str(d).replace('torch.', '')}" for d, n in counts.items())
        raise ValueError(f"the module's parameters are {found}: the engine keeps every parameter in one compute "
                         f"dtype (wrap's dtype=) with fp32 master weights. Convert the module first "
                         f"(module.float()), and choose the compute precision with dtype=")


@dataclass(frozen=True)
class WrapOptions:
    """What the engine takes from `elixir_ray.wrap` besides the module, the optimizer and the plan
    (its docstring says what each does)."""

    process_group: Optional[dist.ProcessGroup] = None
    max_grad_norm: Optional[float] = None
    dtype: Optional[torch.dtype] = None
    device: Union[torch.device, str, None] = None
    init_fn: Optional[Callable[[nn.Module], None]] = None
    loss_fn: Optional[Callable] = None
    accumulation_steps: Optional[int] = None
    prefetch: Optional[int] = None


@dataclass(frozen=True)
class Target:
    """Where and how a module will train, resolved once before its plan is searched or checked:
    what the plan search is given and what `build` runs the plan on."""

    sample_inputs: SampleInputs
    device: torch.device
    dtype: torch.dtype
    comm: Comm
    options: WrapOptions

    @property
    def updates_in_backward(self) -> bool:
        """Whether the optimizer's updates start in the last backward (`updates_start_in_backward`)."""
        return updates_start_in_backward(self.options.accumulation_steps, self.options.max_grad_norm,
                                         self.dtype == torch.float16)


def check_wrappable(module: nn.Module, optimizer: torch.optim.Optimizer, options: WrapOptions) -> None:
    """What wrap refuses before it resolves, plans or touches anything: an optimizer it cannot run, a
    module already wrapped, parameters of mixed dtypes, meta weights nothing initialises, and
    options out of range."""
    check_optimizer(optimizer)
    check_not_wrapped(module)
    _check_parameter_dtypes(module)
    if options.init_fn is None:
        _check_meta_initialisable(module)
    steps = options.accumulation_steps
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        raise ValueError(f"accumulation_steps must be a positive int (backward() calls per optimizer.step()) "
                         f"or None, got {steps!r}")
    if options.prefetch is not None:
        _check_prefetch(options.prefetch, "prefetch", " or None (the plan's)")


def _check_prefetch(value, what: str, otherwise: str = "") -> None:
    """Chunks to load ahead: a bool (an int to Python) would read as 0 or 1 chunks, not as on or off."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{what} must be an int >= 0 (chunks to load ahead){otherwise}, got {value!r}")


def resolve_target(module: nn.Module, optimizer: torch.optim.Optimizer, sample_inputs: Union[tuple, dict, None],
                   options: WrapOptions) -> Target:
    """The device, compute dtype, process group and sample inputs a module trains with. Call it
    within `device_scope(resolve_device(options.device))`: creating the process group's
    communicator and planning run on the engine's device."""
    device = resolve_device(options.device)
    use_expandable_segments(device)  # before the engine allocates: its plans' default margin assumes them
    sample = as_sample_inputs(sample_inputs) if sample_inputs is not None else None
    dtype = options.dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    process_group = options.process_group
    if process_group is None and dist.is_available() and dist.is_initialized():
        process_group = dist.group.WORLD
    comm = Comm(process_group, device)
    in_module = {id(p) for _, p in unique_parameters(module)}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in in_module:
                raise ValueError("the optimizer holds a parameter that is not in the module")
    if sample is None:
        raise ValueError("wrap needs sample_inputs=(batch,) (or a dict of forward's keyword inputs) to trace the "
                         "order parameters are used in")
    return Target(sample_inputs=sample, device=device, dtype=dtype, comm=comm, options=options)


def build(module: nn.Module, optimizer: torch.optim.Optimizer, plan: Plan,
          target: Target) -> tuple[ChunkedModule, ChunkedAdam]:
    """Convert `module` into chunks as `plan` says and return (model, optimizer) used like the
    originals. Everything about the plan is checked before the module is modified."""
    if plan.world_size != target.comm.world:
        raise ValueError(f"the plan was made for {plan.world_size} rank(s), the process group has {target.comm.world}")
    sample_inputs, device, dtype, comm = target.sample_inputs, target.device, target.dtype, target.comm
    options = target.options
    accumulation_steps, loss_fn = options.accumulation_steps, options.loss_fn
    named = unique_parameters(module)
    names = [n for n, _ in named]
    params = [p for _, p in named]
    _check_prefetch(plan.prefetch_depth, "the plan's prefetch_depth")
    prefetch = plan.prefetch_depth if options.prefetch is None else options.prefetch
    if sorted(plan.param_order) != sorted(names):
        raise ValueError("the plan's param_order does not name exactly this module's parameters")
    if plan.host_grads_low and dtype != torch.bfloat16:
        raise ValueError(f"the plan keeps host gradients in the compute dtype (host_grads_low), which needs "
                         f"dtype=torch.bfloat16, got {dtype}: plan again for this dtype, or set host_grads_low=False")
    if plan.host_grads_low and accumulation_steps not in (None, 1):
        raise ValueError(f"the plan keeps host gradients in bfloat16 (host_grads_low), made for one backward() per "
                         f"step, but accumulation_steps={accumulation_steps}: they would accumulate in bfloat16. "
                         f"Plan with grad_accum={accumulation_steps}, or set host_grads_low=False")
    if plan.activation_checkpointing is not None:
        if not callable(getattr(module, "set_checkpointing", None)):
            raise ValueError(f"the plan sets activation checkpointing but {type(module).__name__} has no "
                             f"set_checkpointing(mask)")
        module.set_checkpointing(plan.activation_checkpointing)
    # as the planner traced it; watching for views of parameters kept across fetches (hooks.py)
    trace = trace_step(module, sample_inputs, loss_fn, dtype=dtype, watch_views=True)
    # ---- nothing above modified the module; from here on it is converted ----
    index = {n: i for i, n in enumerate(names)}
    ordered = [params[index[n]] for n in plan.param_order]
    layout, sizes = pack([p.numel() for p in ordered], plan.chunk_size, comm.world)
    if len(plan.placements) != len(sizes) or len(plan.sharded) != len(sizes):
        raise ValueError(f"the plan describes {len(plan.placements)} chunks but packing gives {len(sizes)}")
    node_sharded = _node_sharded(plan, len(sizes))
    originals = [p.data for p in ordered]
    chunks = [Chunk(index=i, size=size, sharded=plan.sharded[i], placement=plan.placements[i],
                    node_sharded=node_sharded[i], stays_resident=plan.is_resident(i)) for i, size in enumerate(sizes)]
    slots = []
    for p, name, pos in zip(ordered, plan.param_order, layout):
        slot = ParamSlot(name=name, param=p, chunk=pos.chunk, offset=pos.offset, numel=pos.numel, shape=p.shape)
        chunks[pos.chunk].slots.append(slot)
        slots.append(slot)
    chunk_of_param = [0] * len(names)
    for s in slots:
        chunk_of_param[index[s.name]] = s.chunk
    events, min_blocks = chunk_events(trace.events, trace.phases, chunk_of_param, trace.grad_epochs)
    if any(plan.sharded):
        _check_same_accesses_on_every_rank(comm, events, prefetch)
    nodes = NodeComms(comm, NodeLayout.of(plan.node_of_rank, comm.world)) if any(node_sharded) else None
    store = ChunkStore(chunks, comm, device, dtype, plan.upload_copies, plan.host_grads_low, nodes)
    materialise(module, slots, originals, store, options.init_fn)
    for c in chunks:
        store.refresh_upload(c)
    pool = ChunkPool(store, max(plan.n_blocks, min(min_blocks, len(chunks))), events,
                     keep_recent=max(1, min_blocks - 1), prefetch_depth=prefetch)
    hooks = EngineHooks(module, store, pool, slots, held_view=trace.held_view)
    loss_scale = DynamicLossScale() if dtype == torch.float16 else None
    model = ChunkedModule(module, store, pool, hooks, slots, plan, loss_scale,
                          _input_sizes(sample_inputs.args, sample_inputs.kwargs))
    chunked_optimizer = ChunkedAdam(optimizer, store, pool, slots, options.max_grad_norm, plan.dos_gap, loss_scale,
                                    accumulation_steps)
    hooks.optimizer = chunked_optimizer
    _warn_if_released_gradients_planned(plan, chunked_optimizer)
    optimizer.register_step_pre_hook(_refuse_original_step)
    optimizer._elixir_ray_original = True
    refuse_other_optimizers(slots)
    # the optimizer passed in holds no gradients or state of its own now: these act on the engine's,
    # so a loop that zeroes, saves or loads through it does what it did before wrap
    optimizer.zero_grad = chunked_optimizer.zero_grad
    module.zero_grad = chunked_optimizer.zero_grad  # nn.Module's would look in .grad, find None, and clear nothing
    optimizer.state_dict = chunked_optimizer.state_dict
    optimizer.load_state_dict = chunked_optimizer.load_state_dict
    return model, chunked_optimizer


def _node_sharded(plan: Plan, n_chunks: int) -> list[bool]:
    """The plan's chunks sharded within each node, checked against its other fields (before the
    module is touched): only sharded chunks, on as many ranks per node (`NodeComms`)."""
    nodes = NodeLayout.of(plan.node_of_rank, plan.world_size)  # a node for each rank
    if not plan.node_sharded:
        return [False] * n_chunks
    if len(plan.node_sharded) != n_chunks:
        raise ValueError(f"the plan's node_sharded lists {len(plan.node_sharded)} chunks, its placements {n_chunks}")
    wrong = [i for i, (n, s) in enumerate(zip(plan.node_sharded, plan.sharded)) if n and not s]
    if wrong:
        raise ValueError(f"the plan shards chunk(s) {wrong[:4]} within each node but does not shard them "
                         f"(sharded False): a node-sharded chunk is a sharded one")
    if any(plan.node_sharded) and not nodes.uniform:
        raise ValueError(f"the plan shards chunks within each node, which needs as many ranks on every node; its "
                         f"node_of_rank is {plan.node_of_rank}")
    return [bool(n) for n in plan.node_sharded]


def _warn_if_released_gradients_planned(plan: Plan, optimizer: ChunkedAdam) -> None:
    """A plan made for one backward per step whose updates start in it counts each device chunk's
    gradient as released once applied there (planner.search.gradients_released); wrapped so that
    the updates start at step() (max_grad_norm, fp16, no accumulation_steps) or after several
    backwards, those gradients stay until zero_grad(): more device memory than planned."""
    if not (plan.updates_in_backward and plan.grad_accum == 1 and "device" in plan.placements):
        return
    if optimizer.updates_in_backward and optimizer.accumulation_steps == 1:
        return
    warnings.warn(
        "the plan was made for one backward per step whose updates start in it (updates_in_backward, grad_accum=1), "
        "so it counts no gradient of the chunks whose state is on the device beyond the buffers collecting them "
        "(each is released once applied in backward); wrapped with "
        f"accumulation_steps={optimizer.accumulation_steps}"
        + (f", max_grad_norm={optimizer.max_grad_norm}" if optimizer.max_grad_norm is not None else "")
        + (", fp16" if optimizer.loss_scale is not None else "")
        + ", those gradients stay until zero_grad(), which needs more device memory than planned. Wrap with "
          "accumulation_steps=1 and no clipping (not fp16), or plan with updates_in_backward=False", stacklevel=4)


def _refuse_original_step(optimizer, args, kwargs):
    """The original optimizer's step would find no gradients (they live in chunks) and do nothing."""
    raise RuntimeError(f"this {type(optimizer).__name__} was given to elixir_ray.wrap: step the optimizer wrap "
                       f"returned (model, optimizer = elixir_ray.wrap(...)); this one only holds the param groups "
                       f"it reads (learning-rate schedulers may keep using it)")


def manual_plan(module: nn.Module, sample_inputs: Union[tuple, dict], *, chunk_size: int, n_blocks: int,
                world_size: int = 1, placements: Union[str, list] = "host", sharded: Union[bool, list, None] = None,
                dos_gap: int = 0, loss_fn: Optional[Callable] = None, upload_copies: bool = False,
                host_grads_low: bool = False, prefetch_depth: int = 1, node_sharded: Union[bool, list] = False,
                node_of_rank: Optional[list] = None, resident: Union[bool, list] = False) -> Plan:
    """A plan with the given chunk size and pool, packing parameters in traced first-use order.
    `node_sharded` (a bool, or one per chunk, of the sharded ones): split within each node of
    `node_of_rank` (each rank's node, numbered) and whole on every node. `resident` (a bool for
    every host chunk, or one per chunk, of the host ones): compute copies kept on the device
    (Plan.resident)."""
    named = unique_parameters(module)
    trace = trace_step(module, as_sample_inputs(sample_inputs), loss_fn)
    order = [named[i][0] for i in trace.order]
    slots, sizes = pack([named[i][1].numel() for i in trace.order], chunk_size, world_size)
    n = len(sizes)
    numels = [0] * n
    for slot in slots:
        numels[slot.chunk] += slot.numel
    places = [placements] * n if isinstance(placements, str) else list(placements)
    if isinstance(resident, bool):
        resident = [p == "host" for p in places] if resident else []
    return Plan(
        chunk_size=chunk_size, n_blocks=n_blocks, param_order=order, world_size=world_size, chunk_numels=numels,
        placements=places, resident=[bool(r) for r in resident],
        sharded=[world_size > 1 if sharded is None else sharded] * n if not isinstance(sharded, list) else sharded,
        dos_gap=dos_gap, upload_copies=upload_copies, host_grads_low=host_grads_low, prefetch_depth=prefetch_depth,
        node_sharded=([] if node_sharded is False else [node_sharded] * n if not isinstance(node_sharded, list)
                      else list(node_sharded)),
        node_of_rank=list(node_of_rank or []),
        notes=[f"manual plan: {n} chunks of {chunk_size:,} elements, {n_blocks} blocks"],
    )
