"""Where the engine meets autograd: fetch before use, collect gradients into chunks, reduce.

- Forward: a pre-hook on every module with parameters fetches its chunks. A parameter used
  outside its own module (a tied weight used by the parent), or after another module's fetch
  evicted its chunk, is fetched by its guard (param_guard.ChunkParameter) when an op reads it.
  A model whose forward keeps a view of a parameter across other fetches (seen in the trace at
  wrap), one whose step took a path the trace did not (from its next forward on), several ranks
  (which record the parameters a forward uses), or a parameter of another class than
  nn.Parameter (which the guard leaves alone) take a torch-function mode instead, which checks
  every op's arguments (a Python call per op): `per_op_reason` says which.
- Backward: autograd's saved-tensor unpack hook fetches the chunk of any saved parameter view whose
  copy was evicted; a module forward during backward is recomputation (activation checkpointing),
  and its chunks stay pinned until the next recomputed region starts.
- Gradients: each parameter's gradient goes into its chunk's staging buffer and is dropped;
  with one rank a chunk whose gradients are all in is reduced at once, the rest at the end of
  backward; with several, chunks are reduced in one fixed order, each once the gradients this
  rank's graph will give it are in (see EngineHooks.__init__).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import threading
import warnings
from typing import Optional

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from elixir_ray.engine.chunks import ChunkStore, ParamSlot
from elixir_ray.engine.pool import ChunkPool

_NO_TORCH_FUNCTION = torch._C.DisableTorchFunction  # modes and subclasses alike
_NO_MODE = contextlib.nullcontext()  # reusable: entering it does nothing


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
            elif type(a) is torch.Tensor:  # a view of a parameter (w.chunk(2), w.t()) kept across other modules'
                base = a._base             # calls: its chunk may have been evicted since (the view shares the
                if base is not None and id(base) in slots:  # storage a fetch regrows)
                    found.append(slots[id(base)])
            elif isinstance(a, (list, tuple)):  # builtin types: cheap, unlike nn.Parameter's isinstance
                for x in a:
                    if id(x) in slots:
                        found.append(slots[id(x)])
                    elif type(x) is torch.Tensor and x._base is not None and id(x._base) in slots:
                        found.append(slots[id(x._base)])
    return found


def _tensors_in(out) -> list[torch.Tensor]:
    """The tensors of a forward's result: a tensor, or inside tuples, lists, dicts (a Hugging Face
    ModelOutput is a dict) and dataclass instances."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    elif dataclasses.is_dataclass(out) and not isinstance(out, type):
        out = [getattr(out, f.name) for f in dataclasses.fields(out)]
    if isinstance(out, (list, tuple)):
        return [t for item in out for t in _tensors_in(item)]
    return []


def _parameters_reached(nodes: list, slot_by_param: dict) -> set[int]:
    """Ids of the slots whose parameters the autograd graph from `nodes` accumulates gradients into
    (reentrant checkpointed regions hide theirs: the forward records those); one walk for all of
    them, since a forward's outputs share most of their graph.

    `seen` holds the nodes themselves, not only their ids: torch makes a node's Python object when
    it is asked for and frees it when nothing holds it, so an id seen before can name another node
    later (with torch 2.11 every parameter after the first layer's was missed so)."""
    found, seen, stack = set(), {}, list(nodes)
    while stack:
        n = stack.pop()
        if n is None or id(n) in seen:
            continue
        seen[id(n)] = n
        variable = getattr(n, "variable", None)  # an AccumulateGrad node
        if variable is not None:
            slot = slot_by_param.get(id(variable))
            if slot is not None:
                found.add(id(slot))
        stack.extend(nxt for nxt, _ in n.next_functions)
    return found


class _FetchParamsMode(TorchFunctionMode):
    """Safety net in forward: any op that receives an evicted parameter gets it fetched first."""

    def __init__(self, runtime: "EngineHooks"):
        super().__init__()
        self.runtime = runtime
        self.slots = runtime.slot_by_param  # read once here: this handler runs for every op in forward

    def __torch_function__(self, func, types, args=(), kwargs=None):
        used = _slots_used(self.slots, args, kwargs)
        if used:
            runtime = self.runtime
            store = runtime.store
            if runtime.recording is not None and not torch.is_grad_enabled() and func.__name__ != "__get__":
                runtime.recording.update(id(s) for s in used)
            if not all(store.usable(store.chunks[s.chunk]) for s in used):
                runtime.pool.access(tuple(s.chunk for s in used))
        return func(*args, **(kwargs or {}))


def _in_backward() -> bool:
    """Whether autograd is running a backward on this thread (torch has no public call for it;
    without the private one, any call is let through)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is None or task_id() != -1


class _SavedParam:
    """What autograd keeps for a saved parameter or parameter view (hooks.pack): the tensor and
    the index of its chunk, which unpack fetches again if it was evicted since."""

    __slots__ = ("tensor", "chunk")

    def __init__(self, tensor: torch.Tensor, chunk: int):
        self.tensor, self.chunk = tensor, chunk


def _module_tables(module: nn.Module) -> list[tuple[nn.Module, list, list]]:
    """Each module with what its own parameter and submodule tables held (values, in order)."""
    return [(m, list(m._parameters.values()), list(m._modules.values())) for m in module.modules()]


def _tables_unchanged(tables: list[tuple[nn.Module, list, list]]) -> bool:
    """Whether no module's own parameters or submodules were added, removed or replaced since
    `_module_tables`: then the module holds the same parameters (a new one lives in some module's
    table, and a new module hangs in its parent's)."""
    for m, params, children in tables:
        now_params, now_children = m._parameters, m._modules
        if len(now_params) != len(params) or len(now_children) != len(children):
            return False
        for a, b in zip(now_params.values(), params):
            if a is not b:
                return False
        for a, b in zip(now_children.values(), children):
            if a is not b:
                return False
    return True


def _per_op_reason(ordered: bool, slots: list[ParamSlot], store: ChunkStore, held_view: Optional[str]) -> str:
    """Why a forward needs the per-op mode (`_FetchParamsMode`), or "" when the pre-hooks and the
    parameters' guards fetch everything it reads."""
    if ordered:
        return "several ranks record which parameters each forward uses"
    guarded = {id(p) for c in store.chunks for p in c.guarded}
    if any(id(s.param) not in guarded for s in slots):
        return "a parameter of another class than nn.Parameter, which the guard leaves alone"
    if held_view is None:
        return "the trace did not watch for views of parameters kept across fetches"
    if held_view:
        return f"forward keeps a view of a parameter across other modules' fetches ({held_view})"
    return ""


class EngineHooks:
    def __init__(self, module: nn.Module, store: ChunkStore, pool: ChunkPool, slots: list[ParamSlot],
                 held_view: Optional[str] = None):
        """`held_view`: the trace's `AccessTrace.held_view` ("" when forward keeps no view of a
        parameter across another module's fetch; None when unknown, taken as one)."""
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
        # once every parameter this rank's backward will give a gradient (`_expected`) has it.
        self.ordered = store.comm.world > 1
        self.reduce_order = list(range(len(store.chunks) - 1, -1, -1))
        self.recording: Optional[set] = None  # ids of slots a forward under way used with gradients off
        # the parameters autograd saved in the forward under way, each with its update count then (a step
        # that changes one before its backward is refused, as torch's in-place check refuses it)
        self._saved: Optional[dict] = None
        self._slot_offsets = {c.index: [sl.offset for sl in c.slots] for c in store.chunks}
        self._changes_at_start: dict = {}  # id(slot) -> its weight's update count when the backward under way began
        self._armed = False  # an output's gradient arrived: a backward may open (callback queued)
        self._expected: Optional[set] = None  # several ranks: ids of slots this backward gives gradients
        self._late: set[int] = set()  # chunks that got a gradient after their reduction in this backward
        self._late_refused: list[str] = []  # parameters whose late gradient came after their update started
        self._next_reduce = 0
        self._deferred = []  # reduced, but a parameter had no gradient here: its update waits for all ranks' flags
        self._calling = False  # the wrapped model's forward is calling the module
        # why every op in forward goes through _FetchParamsMode, or "" when the guards suffice
        self.per_op_reason = _per_op_reason(self.ordered, slots, store, held_view)
        self._forward_thread = None  # the thread running the wrapped forward, while it runs
        store.grad_reads.fetch = self.fetch_for_op  # the guards' call (param_guard._fetch_for_op)
        self.handles = [module.register_forward_pre_hook(self._refuse_direct_call)]
        self._names = {id(mod): name for name, mod in module.named_modules()}  # for the refusal
        self._tables = _module_tables(module)  # what _refuse_new_parameters compares with
        for mod in module.modules():
            chunks = tuple(dict.fromkeys(self.slot_by_param[id(p)].chunk for p in mod.parameters(recurse=False)))
            if chunks:
                self.handles.append(mod.register_forward_pre_hook(self._pre_forward(chunks)))
        for s in slots:
            if s.param.requires_grad:
                self.handles.append(s.param.register_post_accumulate_grad_hook(self._on_grad))

    # -- forward and recomputation ----------------------------------------------------------------

    def _refuse_direct_call(self, mod, args):
        """The module given to wrap, called itself, would compute with parameters the engine has not
        fetched (or in the compute dtype with inputs that are not): an error deep in torch, or values
        read from freed chunk memory. Allowed inside the wrapped forward, and in a backward (a
        checkpoint of the whole module recomputes it there)."""
        if self._calling or _in_backward():
            return
        if mod is self.module:
            what = f"the {type(mod).__name__} given to elixir_ray.wrap was called directly"
        else:
            what = (f"a part of the {type(self.module).__name__} given to elixir_ray.wrap ran outside the wrapped "
                    f"model ({type(mod).__name__} {self._names.get(id(mod), '?')!r}, called directly or through a "
                    f"part that holds it); to compute with parts of it before the model (inputs_embeds from "
                    f"get_input_embeddings()), wrap a module whose forward does both")
        raise RuntimeError(
            f"{what}: call the model wrap returned "
            f"(model, optimizer = elixir_ray.wrap(module, ...); loss = model(batch)). Its parameters live in the "
            f"engine's chunks now, and only the wrapped model fetches them (as its forward uses them); for the "
            f"weights as plain tensors use model.state_dict()"
            + ("; its generate is model.generate(...)" if hasattr(self.module, "generate") else ""))

    def _refuse_new_parameters(self) -> None:
        """A parameter that is not in the chunks (a layer replaced or added after wrap: the module's
        resize_token_embeddings, an adapter injected) would be used without the engine, and the
        optimizer would never update it: a silent no-training. Every forward compares each module's
        own tables of parameters and submodules with what they held at the last full check (a few
        identity checks a module); only a change runs the full pass over the module's parameters,
        whose recursion took about a tenth of a 48-block GPT's forward host time."""
        if _tables_unchanged(self._tables):
            return
        known = self.slot_by_param
        for p in self.module.parameters():
            if id(p) not in known:
                name = next((n for n, q in self.module.named_parameters() if q is p), "?")
                raise RuntimeError(
                    f"parameter {name!r} of shape {tuple(p.shape)} was added to the module after wrap (a layer "
                    f"replaced or added, resize_token_embeddings, an adapter): the engine packed the module's "
                    f"parameters into chunks at wrap and would neither fetch nor train it. Change the module "
                    f"before wrap, with an optimizer built over its parameters then")
        self._tables = _module_tables(self.module)  # a change that added none (a layer replaced by itself)

    def _order_pending_prefetches(self) -> None:
        """Chunks prefetched for the backward may still be copying when forward returns, and their
        parameters, guarded until then, would be waited for only by an op that reads one itself, not
        by one that reads a view of it: code between forward and backward that reads them (a
        regulariser, a logged norm) would read a half-copied block. The compute stream waits for
        those copies now; they are the backward's first chunks, so little overlap is lost (however
        far ahead the pool loads: at the forward's end its blocks hold the chunks the backward
        needs first, which a prefetch does not evict, so in a GPT's step none is pending then).
        Nothing is pending off CUDA."""
        if self.store.copy_stream is not None:
            for c in self.store.chunks:
                if c.ready is not None:
                    self.store.make_usable(c)

    def _pre_forward(self, chunks):
        def hook(mod, args):
            if not self._calling:  # a submodule called on its own (model.transformer(ids)): refused as the module is
                self._refuse_direct_call(mod, args)
            if self.phase == "backward":  # recomputation of a checkpointed region
                if not self._recompute_open:
                    self.pool.release_pins()
                    self._recompute_open = True
                self.pool.access(chunks, pin=True)
            else:
                self.pool.access(chunks)
        # it returns nothing and changes nothing a layer computes: the built-in GPT's selective blocks
        # may run their layers inside autograd Functions with it (model/gpt.py, KEEPS_RESULT)
        hook.keeps_layer_result = True
        return hook

    def fetch_for_op(self, args: tuple, kwargs: dict) -> None:
        """The guards' call (param_guard._fetch_for_op) for an op that reads a guarded parameter:
        inside the wrapped forward, on its thread, the chunks of every parameter (and parameter
        view) the op reads are fetched together, as the per-op mode does, so that the fetch for one
        cannot evict another. Elsewhere (another thread, outside forward) nothing is fetched: a
        chunk still being copied in is only waited for, and the guard refuses an evicted read."""
        chunks = tuple(dict.fromkeys(s.chunk for s in _slots_used(self.slot_by_param, args, kwargs)))
        store = self.store
        if self._calling and self._forward_thread == threading.get_ident():
            if not all(store.usable(store.chunks[c]) for c in chunks):
                self.pool.access(chunks)
            return
        for c in chunks:
            chunk = store.chunks[c]
            if chunk.resident:
                store.make_usable(chunk)

    def pack(self, t: torch.Tensor):
        """A saved parameter (or view of one) is kept as a `_SavedParam`, which names its chunk for
        `unpack`; anything else as itself, so that unpack, which runs for every saved tensor in
        backward, looks at no storage."""
        # past the forward's torch-function mode: an op's own saves run inside the mode's handler,
        # where it is off anyway, but a custom autograd Function's (save_for_backward outside any
        # op, as the GPT's selective blocks do) would make each storage read a Python call
        with _NO_TORCH_FUNCTION():
            chunk = self.store.chunk_of(t)
            if chunk is None:
                return t
            offset = t.storage_offset()
        saved = self._saved
        if saved is not None:  # a parameter, or a view of one (w.t())
            slot = self._slot_at(chunk, offset)
            if slot is not None and id(slot) not in saved:
                saved[id(slot)] = (slot, slot.changes)
        return _SavedParam(t, chunk.index)

    def _changes_now(self) -> dict:
        return {id(slot): slot.changes for slot in self.slots}

    def _slot_at(self, chunk, offset: int) -> Optional[ParamSlot]:
        i = bisect.bisect_right(self._slot_offsets[chunk.index], offset) - 1
        if i >= 0:
            slot = chunk.slots[i]
            if offset < slot.offset + slot.numel:
                return slot
        return None

    def unpack(self, saved):
        if type(saved) is not _SavedParam:
            return saved
        self._recompute_open = False
        self.pool.access((saved.chunk,))  # also when resident: keeps the pool's place in the trace for prefetch
        return saved.tensor

    def forward(self, *args, **kwargs):
        return self.call(self.module, *args, **kwargs)

    def _warn_if_gradients_alive(self) -> None:
        """With one backward per step planned (Plan.host_grads_low), the plan counts each device
        chunk's gradient as gone from optimizer.zero_grad() until its chunk's next backward, so a
        forward that starts with them alive (zero_grad() called after the forward, or several
        backwards per step not declared) holds that much more device memory than planned. Said
        once, here, before the forward's activations pile up on top of them. With the updates
        started in backward, a device chunk's gradient is released once applied there
        (`ChunkedAdam._release_gradient`), so none is alive here whenever zero_grad() comes."""
        store = self.store
        if not store.device_grads_freed or store.warned_grads_alive:
            return
        alive = sum(c.grad.numel() * c.grad.element_size() for c in store.chunks
                    if c.placement == "device" and c.grad is not None)
        if alive:
            store.warned_grads_alive = True
            warnings.warn(
                f"this forward starts with {alive / 2**20:,.1f} MiB of gradients of the chunks whose state is on the "
                f"device, which the plan counted as freed by optimizer.zero_grad() before each forward (one backward "
                f"per step): call optimizer.zero_grad() before the forward (right after optimizer.step()); for "
                f"several backwards per step, pass accumulation_steps=N to wrap so that the plan counts them",
                stacklevel=3)

    def call(self, fn, *args, **kwargs):
        """Run `fn` (the module, or one of its methods that calls it, such as a Hugging Face model's
        generate) as the wrapped model's forward: the module may be called inside, and its
        parameters are fetched as it uses them."""
        self._refuse_new_parameters()
        if self.optimizer is not None:
            self.optimizer.refuse_mid_update(
                "run the model", "Run it before that backward or after optimizer.step() (or wrap with "
                "accumulation_steps=None, which starts the updates at step()); after a backward that raised, "
                "call optimizer.step() to end the step it began, or restore a checkpoint into a newly wrapped model")
        if torch.is_grad_enabled() and (self._backward_open or self._armed):
            self._drop_unfinished_backward()
        if torch.is_grad_enabled():
            self._warn_if_gradients_alive()
        self.store.hold_gradients(False)  # resident parameters back to the plain class: no handler per op
        if not self.per_op_reason and self.store.counts["untraced_accesses"]:
            # a path the trace did not take may keep a view of a parameter the trace never saw kept
            self.per_op_reason = "a step took a path the trace did not (engine_stats()['untraced_accesses'])"
        self.phase = "forward"
        # several ranks: the parameters this forward uses with gradients off (a reentrant checkpointed
        # region runs so, and backward gives them gradients all the same); the graph shows the rest
        self.recording = set() if self.ordered and torch.is_grad_enabled() else None
        self._saved = {}  # also under no_grad: a forward may turn gradients on inside
        try:
            self._calling, self._forward_thread = True, threading.get_ident()
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack), \
                    (_FetchParamsMode(self) if self.per_op_reason else _NO_MODE):
                out = fn(*args, **kwargs)
        finally:
            self._calling, self._forward_thread = False, None
            self.phase = "backward"
            self._order_pending_prefetches()
            self._recompute_open = False
            recorded, self.recording = self.recording, None
            saved, self._saved = list((self._saved or {}).values()), None
        outputs = [t for t in _tensors_in(out) if t.requires_grad]
        expected = None
        if recorded is not None:  # what a backward from any of the outputs gives gradients, read once here
            expected = set(recorded) | _parameters_reached([t.grad_fn for t in outputs], self.slot_by_param)
            expected |= {id(self.slot_by_param[id(t)]) for t in outputs if id(t) in self.slot_by_param}  # returned as is
        for t in outputs:
            # a leaf returned as is (a parameter) keeps its hook for good, and holds no activations to be stale:
            # only a computed output carries the weights' version
            version = (self.store.weights_version, saved) if t.grad_fn is not None else None
            t.register_hook(lambda grad, expected=expected, version=version: self._on_output_grad(expected, version))
        return out

    def _drop_unfinished_backward(self) -> None:
        """A backward that raised (an out-of-memory error caught by the loop, a refused extra
        backward) never reached its closing callback: forget its partial gradients, so that the
        next backward starts clean instead of adding to them."""
        warnings.warn("the last backward did not finish (an exception inside it): the gradients it had "
                      "collected but not yet reduced are dropped", stacklevel=3)
        for c in self.store.chunks:
            c.staging, c.pending, c.reduced = None, 0, True
        self._backward_open = self._armed = False
        self._late, self._late_refused = set(), []
        self.pool.release_pins()

    def _on_output_grad(self, expected: Optional[set], version: Optional[int]) -> None:
        """A backward through this forward's output begins (or an autograd.grad through it): queue
        the callback that closes it here, in the outermost graph task.

        A parameter's gradient may first arrive inside a nested backward (reentrant activation
        checkpointing runs one per region), and a callback queued there would fire when that region
        ends, splitting one backward into several. The backward itself opens (and counts, for
        accumulation_steps) at its first parameter gradient, so autograd.grad is not one. With
        several ranks, `expected` is what the forward read off the graph of all its outputs.

        Weights changed since that forward are refused here, as torch's in-place check refuses them:
        backward would fetch the new weights and pair them with activations of the old ones, a
        gradient of neither. `version` is the store's count of loads then, and the parameters autograd
        saved with their update counts: as in torch, a step that updated only parameters this forward
        did not save (a GAN's D step after its G forward) leaves the backward allowed. Updates that
        started during this backward (accumulation_steps) are not stale for it: an output whose
        gradient comes after they started compares with the counts at the backward's start.
        Each rank decides from what its own forward saved: with several ranks, a rank whose forward
        saved none of the changed weights (an expert routed only to another rank) goes on into this
        backward's collectives and waits there for the rank that refused, as under DDP."""
        if version is not None:
            loads, saved = version
            if loads != self.store.weights_version:
                raise RuntimeError("the model's weights were loaded (load_state_dict or load_engine_state) after "
                                   "the forward this backward goes through: its activations were computed with the "
                                   "old weights, so its gradients would mix the two (torch refuses this too). Run "
                                   "the forward again after loading")
            mid = self._backward_open or self._armed
            changed = [slot.name for slot, n in saved
                       if (self._changes_at_start.get(id(slot), slot.changes) if mid else slot.changes) != n]
            if changed:
                raise RuntimeError(
                    f"optimizer.step() updated parameters that the forward this backward goes through saved for it "
                    f"({', '.join(repr(n) for n in changed[:3])}"
                    + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
                    + "): the backward would pair the new weights with activations of the old (torch refuses this "
                      "too, as an in-place change of a saved tensor). Call optimizer.step() after backward(), and "
                      "run the forward again after a step")
        expected = None if expected is None else set(expected)
        if self._backward_open or self._armed:
            self._expect_more(expected)
            return
        self._changes_at_start = self._changes_now()
        self._armed = True
        self._expected = expected
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    # -- gradients --------------------------------------------------------------------------------

    def start_backward(self) -> None:
        """Expected gradients per chunk for this backward, and the callback that closes it."""
        if self.optimizer is not None:
            self.optimizer.backward_started()  # may refuse a backward the step did not expect
        self.store.hold_gradients(False)  # the hooks read .grad as each gradient arrives
        self._backward_open = True
        if not self._armed:  # no hook on an output saw it start: close it with this graph task
            self._expected = None
            # an output's gradient may still come after this backward's first updates (a loss term
            # the forward kept aside, not returned, opened it): it compares with the counts now
            self._changes_at_start = self._changes_now()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self._armed = False
        expected = self._expected
        # evicted parameters are guarded (param_guard.ChunkParameter): reading requires_grad without
        # the subclass's handler saves a Python call per parameter per backward
        with torch._C.DisableTorchFunctionSubclass():
            for c in self.store.chunks:
                c.pending = sum(1 for s in c.slots if s.param.requires_grad and (expected is None or id(s) in expected))
                c.reduced = False
        self._late, self._late_refused = set(), []
        self._next_reduce, self._deferred = 0, []

    def _expect_more(self, expected: Optional[set]) -> None:
        """Another output of the wrapped module (another forward's, summed into one loss) joins the
        backward under way: its parameters are waited for too."""
        if self._expected is None or expected is None:
            return
        new = expected - self._expected
        self._expected |= new
        if self._backward_open:
            for s in self.slots:
                if id(s) in new and s.param.requires_grad:
                    self.store.chunks[s.chunk].pending += 1

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self._backward_open:
            self.start_backward()
        self._recompute_open = False  # gradients arriving: the recomputed region's backward is under way
        slot = self.slot_by_param[id(param)]
        chunk = self.store.chunks[slot.chunk]
        if chunk.reduced:  # a second gradient in one backward (a parameter in two reentrant regions), or unexpected
            self._late_gradient(slot, chunk, param)
            return
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

    def _late_gradient(self, slot: ParamSlot, chunk, param: nn.Parameter) -> None:
        """A gradient for a chunk already reduced in this backward: reduced again, added to the first,
        at the end of backward; refused if the chunk's update has already started from the first."""
        if chunk.updated:  # refused at the end of backward, on every rank at once
            self._late_refused.append(slot.name)
            param.grad = None
            return
        self.store.add_grad(slot, param.grad)
        param.grad = None
        slot.has_grad = True
        self._late.add(chunk.index)

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
                f"got gradients in this step on some ranks but not on others, and their chunks {chunks} are "
                f"sharded: fetching a sharded chunk is a collective every rank must make at the same point, so this "
                f"step's gathers did not pair up. When ranks use different parameters, every chunk must be "
                f"replicated: a plan from elixir_ray.plan(..., replicate='all'), or engine.replicate: all in a "
                f"config; else use every parameter on every rank")

    def _end_backward(self) -> None:
        """Reduce every chunk not reduced yet, in the same order on every rank."""
        if not self._backward_open:  # armed by an output, but no parameter got a gradient (autograd.grad)
            self._armed = False
            return
        try:
            self._finish_backward()
        finally:
            self._backward_open = self._armed = False
            self.phase = "idle"
            self.pool.release_pins()
        self.store.hold_gradients(any(s.has_grad for s in self.slots))  # a loop may look in .grad now

    def _finish_backward(self) -> None:
        comm = self.store.comm
        late = []
        refused = list(self._late_refused)
        if self.ordered:
            self._reduce_in_order(final=True)
            late = self._deferred
            # whether each parameter got a gradient on any rank (then it has one, as in one-process
            # training), whether on every rank, which chunks got gradients after their reduction, and
            # whether any of those came after its chunk's update started
            n, m = len(self.slots), len(self.store.chunks)
            got = [float(s.has_grad) for s in self.slots]
            flags = comm.all_reduce_max(torch.tensor(got + [1.0 - g for g in got] +
                                                     [float(i in self._late) for i in range(m)] +
                                                     [float(bool(refused))])).tolist()
            for s, f in zip(self.slots, flags[:n]):
                s.has_grad = f > 0
            self._check_sharded_use(flags[:n], flags[n:2 * n])
            again = [i for i in self.reduce_order if flags[2 * n + i] > 0]
            started = any(self.store.chunks[i].updated for i in again)
            if again:  # a rank whose update of such a chunk started cannot add to it: all refuse, or none
                started = comm.all_reduce_max(torch.tensor([float(started)])).item() > 0
            if flags[-1] > 0 or started:
                refused = refused or ["a parameter on another rank"]
        else:
            for c in self.store.chunks:
                if not c.reduced and c.staging is not None:
                    self._reduce(c)
                    late.append(c)
                c.reduced = True
            again = sorted(self._late)
        if refused:
            raise RuntimeError(
                f"{refused[0]} received a second gradient in this backward after its chunk's update had started "
                f"(a parameter used in two reentrant activation-checkpointed regions gets one gradient per region): "
                f"use checkpoint(..., use_reentrant=False), or wrap without accumulation_steps")
        for i in again:  # second gradients: reduced and added to the first (zeros from ranks without one)
            c = self.store.chunks[i]
            self._reduce(c)
            if c not in late:
                late.append(c)
        if self.optimizer is not None:  # only now are these chunks' "has a gradient" flags final
            for c in late:
                self.optimizer.gradient_final(c)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
