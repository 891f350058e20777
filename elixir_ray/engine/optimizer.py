"""ChunkedAdam: the user's Adam/AdamW, run per chunk where that chunk's state lives.

The hyper-parameters are read from the user's optimizer's param groups (so a learning-rate
schedule that edits them works), and the update is torch's own Adam functional: fused on the
device for device chunks. Host chunks are updated on a background thread (host_updates.py), so
that it overlaps what the training thread does next, by a one-pass C kernel that also writes the
upload copy (host_kernel.py; torch's fused CPU Adam where it cannot be built). With Deep Optimizer
States (`dos_gap=k`), every k-th host chunk is instead copied to the compute device a tile at a
time, updated there and copied back, on side streams of their own (`_update_dos`), while the
background thread updates the others.

When the update of a chunk starts:
- at `step()`, in chunk order (the order the next forward needs them), for every chunk by default;
- during the backward, as soon as the chunk's gradient is final, when the engine knows this backward
  is the last before `step()` (`accumulation_steps=N`: every N-th backward) and nothing global has to
  be known first (no gradient clipping, which needs the global norm; no fp16, whose overflow check
  needs every gradient). `step()` then starts only what is left.
A device chunk whose update ran in the backward has its gradient released right after it (`c.grad`,
which took over the chunk's fp32 staging buffer, is dropped on the compute stream the update ran
on), so that no device gradient outlives its update: the planner counts none beyond the buffers
still collecting (`planner.search.gradients_released`). Nothing reads it later: `step()` skips
updated chunks, clipping and fp16 never start updates in backward, and `.grad` is None in any case
(param_guard.GradReads). A backward after `step()` with no `zero_grad()` between, which torch would
add to those gradients, is refused (`backward_started`).
Either way the result is exactly that of one torch AdamW step: what a chunk's update uses (its
gradient, step counts, hyper-parameters) is fixed when it starts, and nothing reads or writes a
chunk's state before its update has finished (`ChunkStore.settle`; a fetch waits for a device
update's copies back on the device, `ChunkStore._settle_for_fill`).

A parameter that received no gradient since the last `zero_grad` is not updated and its step count
does not advance, exactly as torch skips parameters whose `.grad` is None.
"""

from __future__ import annotations

import math
from collections import OrderedDict, defaultdict
from dataclasses import replace
from typing import Optional, Union

import torch
from torch.optim.adam import adam as adam_functional

from elixir_ray.chunk_plan.buffers import DOS_BUFFERS, DOS_TILE
from elixir_ray.engine.adam_step import AdamCall, AdamTensors
from elixir_ray.engine.chunks import Chunk, ChunkStore, ParamSlot
from elixir_ray.engine.host_kernel import HostAdamKernel, host_adam_kernel
from elixir_ray.engine.optimizer_state import load_optimizer_state_dict, optimizer_state_dict
from elixir_ray.engine.pool import ChunkPool
from elixir_ray.engine.timing import profiled

SUPPORTED = (torch.optim.AdamW, torch.optim.Adam)
HYPER = ("lr", "betas", "eps", "weight_decay")
UNSUPPORTED_FLAGS = ("amsgrad", "maximize", "differentiable")  # differentiable: autograd through the step


def unsupported_flag(param_groups: list) -> Optional[str]:
    """The first of UNSUPPORTED_FLAGS set on any group, else None."""
    return next((key for group in param_groups for key in UNSUPPORTED_FLAGS if group.get(key)), None)


def check_optimizer(optimizer) -> None:
    """Refuse, before anything is built, what the engine would otherwise train differently from torch."""
    if not isinstance(optimizer, SUPPORTED):
        raise TypeError(f"elixir_ray.wrap supports torch.optim.AdamW and torch.optim.Adam, "
                        f"got {type(optimizer).__name__}")
    key = unsupported_flag(optimizer.param_groups)
    if key:
        raise TypeError(f"elixir_ray.wrap does not support {type(optimizer).__name__}({key}=True): "
                        f"pass {key}=False (the default)")
    if optimizer.state:
        raise ValueError(f"the optimizer already has state for {len(optimizer.state)} parameter(s) (it has "
                         f"stepped, or loaded a state dict): the engine keeps its own AdamW state and would start "
                         f"it afresh. Wrap a new optimizer, then load the saved state into the one wrap returns "
                         f"(optimizer.load_state_dict(torch.load(...)): torch's AdamW format), or restore a "
                         f"checkpoint of a Ray run with load_engine_state")
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in seen:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} is listed twice in the optimizer's param "
                                 f"groups (torch would update it twice per step): list each parameter once")
            seen.add(id(p))


def updates_start_in_backward(accumulation_steps: Optional[int], max_grad_norm: Optional[float],
                               fp16: bool) -> bool:
    """The one rule for when host updates may start in the last backward: the loop declared its
    accumulation, and nothing needs every gradient first (clipping's norm, fp16's overflow check).
    The engine, wrap's own plan search and the Ray driver's planning all ask it."""
    return accumulation_steps is not None and max_grad_norm is None and not fp16


class DynamicLossScale:
    """fp16 loss scaling: halve on overflow (and skip the step), double after `interval` clean steps."""

    def __init__(self, init: float = 2.0**16, interval: int = 2000):
        self.scale, self.interval, self.clean = init, interval, 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale, self.clean = max(self.scale / 2, 1.0), 0
        else:
            self.clean += 1
            if self.clean % self.interval == 0:
                self.scale *= 2


# elements of a low-precision gradient widened to fp32 at a time, per intra-op thread of the update
GRAD_TILE_PER_THREAD = 1 << 20


def grad_tile_elements(threads: Optional[int] = None) -> int:
    """How many elements of a low-precision gradient are widened and updated at a time.

    Each tile is a few parallel regions (the widening copy, the fused update), each ending in a
    barrier of the whole OpenMP team, and a few returns to Python that must take the GIL back
    from the training thread. With a fixed tile of 1M elements, 16 host cores split a tile into
    pieces of about 70K elements, a few microseconds of work each, so barriers and GIL hand-offs
    set the pace: on the H100 machine the engine's CPU AdamW ran at 1.4 to 1.6 G params/s beside
    training against 4.3 G measured alone. Scaled to a million elements per thread, each piece is
    milliseconds of work, and a 155M chunk is about ten tiles, not 150. The widened tile no longer
    stays in cache, which costs about 14% when nothing else runs (measured on the 2-core VM).
    """
    return GRAD_TILE_PER_THREAD * max(1, torch.get_num_threads() if threads is None else threads)


class TileScratch:
    """The fp32 buffer low-precision gradients are widened into, kept from one update to the next.

    The background thread runs one update at a time, so one buffer serves every host chunk; a
    buffer of tens of megabytes made per update would be a fresh mapping whose pages fault in on
    every update."""

    def __init__(self, elements: Optional[int] = None):
        self.elements = elements  # a fixed tile size (benchmarks); None: grad_tile_elements() where it runs
        self._buffer: Optional[torch.Tensor] = None

    def get(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        want = min(numel, self.elements or grad_tile_elements())
        buf = self._buffer
        if buf is None or buf.numel() < want or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._buffer = torch.empty(want, dtype=like.dtype, device=like.device)
        return buf[:want]


def run_adam(calls: list[AdamCall], master, grad, exp_avg, exp_avg_sq, grad_factor: float = 1.0,
             scratch: Optional[TileScratch] = None) -> None:
    """torch's fused AdamW over each call's segments of one chunk's shard.

    A gradient in a lower dtype than the master (host gradients in the compute dtype) is widened
    a tile at a time (`grad_tile_elements`) into an fp32 buffer (`scratch`'s, else a new one),
    since fused Adam wants one dtype: the host reads 2 gradient bytes per element, not 4.
    `grad_factor` (clipping) is applied to the widened tile, for such gradients only.
    """
    _check_grad_factor(master, grad, grad_factor)
    if grad.dtype == master.dtype:
        for call in calls:
            segs = call.segments
            _adam(call, [master[lo:hi] for lo, hi in segs], [grad[lo:hi] for lo, hi in segs],
                  [exp_avg[lo:hi] for lo, hi in segs], [exp_avg_sq[lo:hi] for lo, hi in segs])
        return
    tile = (scratch or TileScratch()).get(master.numel(), master)
    size = tile.numel()
    for call in calls:
        for lo, hi in call.segments:
            for start in range(lo, hi, size):
                end = min(hi, start + size)
                wide = tile[: end - start]
                wide.copy_(grad[start:end])
                if grad_factor != 1.0:
                    wide.mul_(grad_factor)
                _adam(call, [master[start:end]], [wide], [exp_avg[start:end]], [exp_avg_sq[start:end]])


def _check_grad_factor(master, grad, grad_factor: float) -> None:
    if grad.dtype == master.dtype and grad_factor != 1.0:
        raise ValueError("grad_factor is for low-precision gradients; scale an fp32 gradient in place")


def _tile_calls(calls: list[AdamCall], lo: int, hi: int) -> list[AdamCall]:
    """The calls' segments within [lo, hi) of a shard, shifted to start at 0: one tile's update
    (Adam is elementwise, so a tile at a time updates exactly as the whole shard at once)."""
    out = []
    for call in calls:
        segs = tuple((max(a, lo) - lo, min(b, hi) - lo) for a, b in call.segments if a < hi and b > lo)
        if segs:
            out.append(replace(call, segments=segs))
    return out


def host_update(calls: list[AdamCall], tensors: AdamTensors, grad_factor: float = 1.0,
                scratch: Optional[TileScratch] = None, kernel: Union[HostAdamKernel, None, str] = "auto") -> None:
    """The background thread's whole job for one host chunk: the update, then the new master cast
    into its upload copy (`tensors.upload`, with a compute dtype narrower than fp32). The hardware
    profile and the host-adam benchmark time this same function.

    `kernel`: "auto" takes the one-pass C kernel where it builds (host_kernel.py), else torch's
    three passes (`run_adam`, then the cast); None asks for torch's; the benchmark passes either."""
    master, grad, exp_avg, exp_avg_sq, upload = (tensors.master, tensors.grad, tensors.exp_avg, tensors.exp_avg_sq,
                                                 tensors.upload)
    if kernel == "auto":
        kernel = host_adam_kernel()
    if kernel is None or not HostAdamKernel.handles(master, grad, upload):
        run_adam(calls, master, grad, exp_avg, exp_avg_sq, grad_factor, scratch)
        if upload is not None:
            upload.copy_(master)
        return
    _check_grad_factor(master, grad, grad_factor)
    threads = torch.get_num_threads()  # the update thread's intra-op count (HostUpdates sets it)
    for call in calls:
        kernel.update(tensors, call, grad_factor, threads)
    if upload is not None:  # what no call updated (padding, parameters without a gradient) is cast as torch's path casts it
        end = 0
        for lo, hi in sorted(seg for call in calls for seg in call.segments) + [(master.numel(), master.numel())]:
            if lo > end:
                upload[end:lo].copy_(master[end:lo])
            end = max(end, hi)


def _adam(call: AdamCall, masters: list, grads: list, avgs: list, avg_sqs: list) -> None:
    # one step tensor per tensor (fused Adam increments each in place): views of one, so that a GPU
    # runs one fill for a chunk rather than one per parameter; torch.full, not torch.tensor, so
    # that no blocking host-to-device copy stalls the training thread
    steps = list(torch.full((len(masters),), float(call.step), dtype=torch.float32, device=masters[0].device).unbind())
    adam_functional(
        masters, grads, avgs, avg_sqs, [], steps, fused=True, amsgrad=False, beta1=call.beta1, beta2=call.beta2,
        lr=call.lr, weight_decay=call.weight_decay, eps=call.eps, maximize=False,
        decoupled_weight_decay=call.decoupled,
    )


NORM_TILE = 1 << 18  # elements widened to fp64 at a time for a host gradient's norm (2 MiB)


def _host_sum_of_squares(grad: torch.Tensor, kernel: Optional[HostAdamKernel] = None) -> float:
    """Sum of squares of a host gradient in fp64: through the C kernel's one read of each element
    where there is one (on the 2-core VM 3.3 G bf16 elements/s against torch's 0.95); else through
    torch, a tile at a time: widening a whole chunk at once made an 8-byte copy of every element and
    took a tenth of a second per 50M of them, on the training thread before any update could start."""
    if kernel is not None and grad.dtype in (torch.bfloat16, torch.float32) and grad.is_contiguous():
        return kernel.sum_of_squares(grad, torch.get_num_threads())
    total = 0.0
    for start in range(0, grad.numel(), NORM_TILE):
        tile = grad[start: start + NORM_TILE].double()
        total += float(torch.dot(tile, tile))
    return total


# torch's registry of step hooks is process-wide: the one hook below is registered there once, the
# first time a module is wrapped, and refuses only optimizers that step wrapped parameters
_OTHER_OPTIMIZER_HOOK: list = []
_CHUNKED_NAME = "_elixir_ray_chunked"  # set on each wrapped parameter: its name in the module


def refuse_other_optimizers(slots: list[ParamSlot]) -> None:
    """Another torch optimizer over wrapped parameters (SGD or Muon for the matrices beside AdamW for
    the rest, say) would find no gradients, as they live in the chunks, and silently train nothing."""
    for s in slots:
        setattr(s.param, _CHUNKED_NAME, s.name)
    if not _OTHER_OPTIMIZER_HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _OTHER_OPTIMIZER_HOOK.append(register_optimizer_step_pre_hook(_refuse_other_optimizer_step))


def _refuse_other_optimizer_step(optimizer, args, kwargs):
    if isinstance(optimizer, ChunkedAdam) or getattr(optimizer, "_elixir_ray_original", False):
        return  # the original optimizer's own hook says what to do instead
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = getattr(p, _CHUNKED_NAME, None)
            if name is not None:
                raise RuntimeError(
                    f"this {type(optimizer).__name__} steps {name!r}, a parameter elixir_ray.wrap packed into "
                    f"chunks: its gradient and its update live in the engine, so this step would change nothing. "
                    f"Give every trained parameter to the optimizer passed to wrap (Adam or AdamW, param groups "
                    f"for their own hyper-parameters), or keep this one's parameters out of the wrapped module")


class ChunkedAdam(torch.optim.Optimizer):
    """The optimizer wrap returns. A torch Optimizer to the code that checks (learning-rate
    schedulers built on it work), but little of Optimizer's own machinery is set up: its state lives
    in the chunks, its param groups are the original optimizer's, and it has no `state` attribute.
    Step hooks run as torch runs them (an EMA of the weights is often one): torch's global ones, and
    this optimizer's, which start as those registered on the original optimizer before wrap."""

    def __init__(self, base: torch.optim.Optimizer, store: ChunkStore, pool: ChunkPool, slots: list[ParamSlot],
                 max_grad_norm: Optional[float], dos_gap: int, loss_scale: Optional[DynamicLossScale],
                 accumulation_steps: Optional[int] = None):
        self.base, self.store, self.pool, self.slots = base, store, pool, slots
        self.max_grad_norm, self.dos_gap, self.loss_scale = max_grad_norm, dos_gap, loss_scale
        self.accumulation_steps = accumulation_steps
        # the step hooks registered on the original optimizer so far run on this one's step
        self._optimizer_step_pre_hooks = OrderedDict(base._optimizer_step_pre_hooks)
        self._optimizer_step_post_hooks = OrderedDict(base._optimizer_step_post_hooks)
        self.decoupled = isinstance(base, torch.optim.AdamW)
        group_of = {id(p): i for i, g in enumerate(base.param_groups) for p in g["params"]}
        for s in slots:
            s.group = group_of.get(id(s.param), -1)  # -1: not in the optimizer, never updated
        self._n_groups = len(base.param_groups)
        # gradients are collected only for parameters trainable at wrap (their hooks are set then)
        self._frozen_at_wrap = [s for s in slots if not s.param.requires_grad]
        # zero_grad(set_to_none=False) keeps zero gradients, which torch's AdamW still applies to a
        # parameter that gets no gradient in a step; the engine refuses that step instead
        self._zeros_kept = False
        host = [c.index for c in store.chunks if c.placement == "host"]
        self.dos_chunks = {i for k, i in enumerate(host) if dos_gap > 0 and k % dos_gap == dos_gap - 1}
        self.last_grad_norm: Optional[float] = None
        self.skipped_steps = 0
        self.backwards = 0  # backward passes since the last step
        self._started_with: Optional[tuple] = None  # hyper-parameters of updates started during a backward
        # this step's clip coefficient for low-precision gradients, applied when an update widens them
        # to fp32 (multiplying them in place would round them a second time); fp32 ones are scaled in place
        self._low_grad_factor = 1.0
        self._scratch = TileScratch()  # for the background thread's updates from low-precision gradients
        # this step's Deep Optimizer States buffers: made by the step's first DOS update (in backward,
        # or at step()), dropped once step() has queued the last (`_dos_lane_buffers`)
        self._dos_lanes: Optional[list] = None
        self._dos_turn = 0  # tiles queued this step: the next goes to lane _dos_turn % DOS_BUFFERS
        # the one-pass C kernel for host chunks, or None for torch's passes (ELIXIR_RAY_HOST_KERNEL=torch,
        # or no compiler here); settable, for a test that compares with torch's arithmetic exactly
        self.host_kernel: Optional[HostAdamKernel] = host_adam_kernel()

    @property
    def param_groups(self):
        return self.base.param_groups

    @property
    def defaults(self):
        return self.base.defaults

    _NO_STATE = ("the optimizer wrap returns has no per-parameter `state`: its AdamW moments live in the chunks, "
                 "on the device or the host. Read them in torch's format with optimizer.state_dict()['state'] (whole "
                 "tensors on the host), and set them with optimizer.load_state_dict()")

    @property
    def state(self):
        # torch's per-parameter dict would have to hold every moment as a whole tensor; an
        # AttributeError keeps hasattr(optimizer, "state") False for code that probes for it
        raise AttributeError(self._NO_STATE)

    @state.setter
    def state(self, value):
        raise AttributeError(self._NO_STATE)

    @property
    def updates_in_backward(self) -> bool:
        """Whether the last backward of a step starts the updates (see the module docstring)."""
        return updates_start_in_backward(self.accumulation_steps, self.max_grad_norm, self.loss_scale is not None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.store.hold_gradients(False)
        self.store.grad_reads.released = False
        for c in self.store.chunks:
            c.grad = None  # a running update holds its own reference to the gradient it reads
            c.grad_released = False
        for s in self.slots:
            if set_to_none:
                s.had_grad = False
            s.has_grad = False
        self._zeros_kept = not set_to_none

    def refuse_mid_update(self, what: str, instead: str = "Load before the step's forward, or after "
                                                               "optimizer.step()") -> None:
        """Between a backward that started updates (accumulation_steps) and the step, some chunks are
        already updated from the old state: loading now would be half overwritten by them and half
        not, and the step would apply nothing on top of what was loaded; a forward would compute
        with some weights old and some new."""
        if any(c.updated for c in self.store.chunks):
            raise RuntimeError(f"cannot {what} between backward() and optimizer.step() with accumulation_steps="
                               f"{self.accumulation_steps}: this step's updates already started during the backward. "
                               f"{instead}")

    def state_dict(self) -> dict:
        """The AdamW state in torch's format, whole tensors on the host (optimizer_state.py); with
        sharded chunks every rank must call it."""
        return optimizer_state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """A state dict from `state_dict()` or from a plain torch AdamW/Adam over the same parameters."""
        load_optimizer_state_dict(self, state_dict)

    def add_param_group(self, param_group: dict) -> None:
        raise RuntimeError("elixir_ray's optimizer cannot take a param group after wrap (its parameters are "
                           "already packed into chunks): build the optimizer with every group, then wrap")

    def _check_unchanged(self) -> None:
        """What changed since wrap that the engine would silently train differently from torch."""
        if len(self.param_groups) != self._n_groups:
            raise RuntimeError(f"the optimizer has {len(self.param_groups)} param groups, but it had {self._n_groups} "
                               f"at wrap: build the optimizer with every group, then wrap")
        key = unsupported_flag(self.param_groups)
        if key:
            raise RuntimeError(f"{key}=True was set on a param group after wrap, which elixir_ray does not "
                               f"support: keep {key}=False")
        for s in self._frozen_at_wrap:
            if s.param.requires_grad:
                raise RuntimeError(f"parameter {s.name!r} was frozen (requires_grad=False) at wrap and is trainable "
                                   f"now: the engine collects gradients only for parameters trainable at wrap. Set "
                                   f"requires_grad before wrap (freeze after wrap instead, which works)")
        if self._zeros_kept:
            for s in self.slots:
                # a parameter frozen since counts too: torch steps every parameter whose .grad is not None
                if s.had_grad and not s.has_grad and s.group >= 0:
                    frozen = "" if s.param.requires_grad else " (it was frozen since)"
                    raise RuntimeError(
                        f"parameter {s.name!r} got no gradient in this step{frozen} but kept a zero one from "
                        f"zero_grad(set_to_none=False): torch's AdamW would still move it (momentum, weight decay), "
                        f"elixir_ray updates only parameters with a gradient. Use zero_grad() (set_to_none=True, "
                        f"torch's default)")

    # -- called by the engine's hooks -------------------------------------------------------------

    def backward_started(self) -> None:
        n = self.accumulation_steps
        if n is not None and self.backwards >= n:
            raise RuntimeError(
                f"backward() called {self.backwards + 1} times since the last optimizer.step(), but "
                f"wrap(..., accumulation_steps={n}) said {n}: this step's updates already started during the "
                f"last of them, so the model and optimizer state no longer match plain training (restore a "
                f"checkpoint). Call optimizer.step() after every {n} backward() call(s), or pass the right "
                f"accumulation_steps (None: updates start at step())")
        if self.backwards == 0:
            released = [c for c in self.store.chunks if c.grad_released]
            if released:
                raise RuntimeError(
                    f"backward() after optimizer.step() without optimizer.zero_grad() in between: torch would add "
                    f"this backward's gradients to the last step's, but with wrap(..., accumulation_steps="
                    f"{self.accumulation_steps}) the updates start during the last backward, and the gradients of "
                    f"{len(released)} chunk(s) whose optimizer state is on the device were released once applied "
                    f"there. Call optimizer.zero_grad() after every optimizer.step() (or before each forward), or "
                    f"wrap with accumulation_steps=None, which starts the updates at step() and keeps the gradients "
                    f"until zero_grad()")
        self.backwards += 1
        self.store.timer.mark("backward")

    def gradient_final(self, c: Chunk) -> None:
        """The chunk's gradient for this backward is complete on this rank: start its update if allowed."""
        if not (self.updates_in_backward and self.backwards == self.accumulation_steps):
            return
        if c.updated or c.grad is None:
            return
        if self._started_with is None:
            self._started_with = self._hyper_parameters()
        work = self._start(c)
        if work is not None:  # a Deep Optimizer States chunk: its copies use the link while backward runs
            with self.store.timer.region("device_adam"):
                self._update_dos([work])
        elif c.placement == "device":
            self._release_gradient(c)

    def _release_gradient(self, c: Chunk) -> None:
        """Drop a device chunk's gradient once its update has run in the backward. `c.grad` is the
        buffer's only reference (the reduction let go of the staging buffer it took over, and of a
        sharded chunk's whole buffer after its reduce-scatter; the update keeps none), so the
        allocator frees it on the compute stream, after the update queued there. Nothing reads it
        later in this step (module docstring); a backward that would add to it is refused
        (`backward_started`)."""
        c.grad = None
        c.grad_released = True
        self.store.grad_reads.released = True

    # -- the step ---------------------------------------------------------------------------------

    def _hyper_parameters(self) -> tuple:
        """The values now (a tensor lr that a scheduler changes in place is the same object, so it is read)."""
        def value(v):
            return float(v) if isinstance(v, torch.Tensor) else v

        return tuple(tuple(tuple(map(value, g[k])) if k == "betas" else value(g[k]) for k in HYPER)
                     for g in self.param_groups)

    def _grad_norm_sq(self) -> float:
        """Sum of squared gradients over the whole model: sharded parts add up across ranks, those of
        chunks sharded within each node across the node's ranks.

        Host gradients are summed in fp64 on the host. Device gradients get one fp32 norm each,
        squared in fp64 and summed on the device, so that a GPU needs no fp64 copy of a chunk and
        the host waits for it once, not once per chunk."""
        local = [0.0, 0.0, 0.0]  # sharded, replicated, sharded within each node
        on_device: dict[int, list] = {0: [], 1: [], 2: []}
        for c in self.store.chunks:
            if c.grad is None:
                continue
            k = 2 if c.node_sharded else 0 if c.sharded else 1
            if c.grad.device.type == "cpu":
                local[k] += _host_sum_of_squares(c.grad, self.host_kernel)
            else:
                on_device[k].append(torch.linalg.vector_norm(c.grad).double().square())
        for k, norms in on_device.items():
            if norms:
                local[k] += float(torch.stack(norms).sum())
        total = self.store.comm.all_reduce_sum(torch.tensor([local[0]], dtype=torch.float64))
        if self.store.nodes is not None:  # every node holds the same gradient of its node-sharded chunks
            total = total + self.store.nodes.node.all_reduce_sum(torch.tensor([local[2]], dtype=torch.float64))
        return float(total[0] + local[1])  # replicated chunks: every rank holds the same full gradient

    def _overflow(self) -> bool:
        """Any inf or NaN in any gradient, on any rank (one wait for the device's gradients)."""
        finite = [torch.isfinite(c.grad).all() for c in self.store.chunks if c.grad is not None]
        on_host = [f for f in finite if f.device.type == "cpu"]
        on_device = [f for f in finite if f.device.type != "cpu"]
        bad = not all(bool(f) for f in on_host) or (bool(on_device) and not bool(torch.stack(on_device).all()))
        return bool(self.store.comm.all_reduce_max(torch.tensor([float(bad)]))[0] > 0)

    @torch.no_grad()
    def _no_state_dict_hooks(self, *args, **kwargs):
        raise NotImplementedError("the optimizer wrap returns writes its state_dict() from the chunks and loads "
                                  "it into them, without torch's state-dict hooks: change the dict you get from "
                                  "state_dict(), or the one you pass to load_state_dict(), yourself")

    register_state_dict_pre_hook = register_state_dict_post_hook = _no_state_dict_hooks
    register_load_state_dict_pre_hook = register_load_state_dict_post_hook = _no_state_dict_hooks

    # torch.amp.GradScaler hands an optimizer that says this its scale (`grad_scale`) and calls its step:
    # the engine scales an fp16 loss itself, so the step refuses a GradScaler with what to do instead
    _step_supports_amp_scaling = True

    @torch.optim.Optimizer.profile_hook_step  # torch's global and this optimizer's step hooks around it
    def step(self, closure=None) -> None:
        if getattr(self, "grad_scale", None) is not None:
            self.grad_scale = self.found_inf = None
            raise RuntimeError("a torch.amp.GradScaler stepped elixir_ray's optimizer: the engine keeps fp32 masters "
                               "and, with wrap(..., dtype=torch.float16), scales the loss itself (dynamic loss "
                               "scaling). Call loss.backward() and optimizer.step() without a GradScaler, and no "
                               "autocast: dtype= sets the compute dtype. The gradients of this step were computed "
                               "from the scaled loss: call optimizer.zero_grad() before the next backward")
        if closure is not None:
            raise ValueError("elixir_ray's optimizer does not take a closure")
        self.base._opt_called = True  # what torch's LR schedulers look for, to not warn of a step before any
        self.store.timer.mark("step")
        with self.store.on_device():
            try:
                self._step()
            finally:
                self.backwards = 0
                self._started_with = None
                self._low_grad_factor = 1.0
                for c in self.store.chunks:
                    c.updated = False
                self._dos_lanes = None  # freed once their streams are done with them (record_stream)
                self._dos_turn = 0
                self.pool.reset()  # compute copies are stale now

    @profiled("elixir.step")
    def _step(self) -> None:
        if self.loss_scale is not None or self.max_grad_norm is not None:
            # this thread reads every host gradient (overflow check, norm), and they were copied
            # asynchronously: wait until they have landed. Otherwise each update waits for its own
            # chunk's copy (the background thread on its event, a device update on the stream).
            self.store.wait_for_copies()
        self._check_unchanged()
        if self._started_with is not None and self._started_with != self._hyper_parameters():
            raise RuntimeError(
                "the learning rate (or another Adam hyper-parameter) changed between backward() and "
                "optimizer.step(), but with accumulation_steps set the updates start during the last backward() "
                "with the values in effect then: set hyper-parameters before the forward pass, or wrap without "
                "accumulation_steps")
        scale = 1.0
        if self.loss_scale is not None:
            scale = self.loss_scale.scale  # the scale this step's backward ran with
            overflow = self._overflow()
            self.loss_scale.update(overflow)
            if overflow:
                self.skipped_steps += 1
                return
        if scale != 1.0:
            for c in self.store.chunks:
                if c.grad is not None:
                    self.store.settle(c)  # a gradient kept from an earlier step may still be read by its update
                    c.grad.div_(scale)
        if self.max_grad_norm is not None:
            norm = math.sqrt(self._grad_norm_sq())
            self.last_grad_norm = norm
            coef = min(1.0, self.max_grad_norm / (norm + 1e-6))
            if coef < 1.0:
                self._low_grad_factor = coef
                for c in self.store.chunks:
                    if c.grad is not None and c.grad.dtype == torch.float32:
                        self.store.settle(c)
                        c.grad.mul_(coef)
        # host chunks first, in chunk order, so that the background thread starts at once; then the
        # device chunks on this thread, beside it, and the DOS chunks queued on their own stream
        pending = [c for c in self.store.chunks if c.grad is not None and not c.updated]
        for c in pending:
            if self._runs_on_host(c):
                self._start(c)
        # the DOS copies before the device chunks' updates: their streams start after what the
        # compute stream holds when they are queued, and those updates need not come first
        dos = [work for work in (self._start(c) for c in pending if c.placement == "host" and not self._runs_on_host(c))
               if work is not None]
        if dos:
            with self.store.timer.region("device_adam"):
                self._update_dos(dos)
        for c in pending:
            if c.placement == "device":
                self._start(c)

    def _runs_on_host(self, c: Chunk) -> bool:
        return c.placement == "host" and c.index not in self.dos_chunks

    def _calls(self, c: Chunk) -> list[AdamCall]:
        """What this chunk's update will do, fixed now; counts the update in each parameter's step."""
        # the parameters are guarded (param_guard.ChunkParameter) here: without this, each
        # `requires_grad` read below is a Python torch-function call (two per parameter per step)
        with torch._C.DisableTorchFunctionSubclass():
            return self._calls_unguarded(c)

    def _calls_unguarded(self, c: Chunk) -> list[AdamCall]:
        batches = defaultdict(list)
        for slot, lo, hi in c.segments():
            if slot.group < 0 or not slot.has_grad or not slot.param.requires_grad:
                continue
            batches[(slot.group, slot.step)].append((lo, hi))
        calls = []
        for (gi, step), segs in batches.items():
            group = self.param_groups[gi]
            beta1, beta2 = group["betas"]
            calls.append(AdamCall(tuple(segs), step, float(group["lr"]), float(beta1), float(beta2),
                                  float(group["eps"]), float(group["weight_decay"]),
                                  bool(group.get("decoupled_weight_decay", self.decoupled))))
        for slot in c.slots:  # every rank counts every parameter's steps, whichever ranks hold its slices
            if slot.group >= 0 and slot.has_grad and slot.param.requires_grad:
                slot.step += 1
                slot.changes += 1
                slot.had_grad = True
        return calls

    def _start(self, c: Chunk):
        """Start the chunk's update: on the background thread (host chunks) or on this one (device
        chunks). A Deep Optimizer States chunk is returned as (chunk, calls, gradient factor) for
        `_update_dos`."""
        c.updated = True
        self.store.settle(c)
        calls = self._calls(c)
        factor = self._low_grad_factor if c.grad is not None and c.grad.dtype != torch.float32 else 1.0
        if c.exp_avg is None:  # device chunks, at their first update (host chunks' moments are in the arena)
            c.exp_avg = torch.zeros(c.shard_len, dtype=torch.float32, device=c.master.device)
            c.exp_avg_sq = torch.zeros(c.shard_len, dtype=torch.float32, device=c.master.device)
        if not calls:
            return None
        if self._runs_on_host(c):
            tensors = AdamTensors(c.master, c.grad, c.exp_avg, c.exp_avg_sq, c.upload)
            scratch, kernel = self._scratch, self.host_kernel

            def job():
                host_update(calls, tensors, factor, scratch, kernel)

            # not before the gradient has landed, nor while a fetch still reads the state this job writes
            c.update = self.store.updates.submit(job, [e for e in (c.grad_ready, c.host_read) if e is not None],
                                                 priority=c.index,  # the next forward needs low indices first
                                                 elements=c.shard_len)
            return None
        if c.placement != "device":
            return c, calls, factor
        self.store.make_usable(c)  # a prefetch may still be reading the master this update writes
        with self.store.timer.region("device_adam"):
            run_adam(calls, c.master, c.grad, c.exp_avg, c.exp_avg_sq)
        return None

    def _dos_lane_buffers(self) -> list:
        """This step's DOS_BUFFERS buffers of 16 bytes per element of a tile (fp32 master, both
        moments and gradient: what the planner budgets, through backward and the next forward),
        each as [buffer, event after its last tile's copies back were queued (None at first)].
        They are allocated on the compute stream, so that their blocks return to that stream's
        pool, and recorded on both DOS streams, so that they are not handed out again before those
        have finished with them; the streams first wait for the compute queued so far (the blocks'
        earlier users)."""
        if self._dos_lanes is None:
            store = self.store
            width = min(DOS_TILE, max(store.chunks[i].shard_len for i in self.dos_chunks))
            for stream in store.dos_streams or ():
                stream.wait_stream(torch.cuda.current_stream(store.device))
            lanes = []
            for _ in range(DOS_BUFFERS):
                buf = torch.empty(4, width, dtype=torch.float32, device=store.device)
                for stream in store.dos_streams or ():
                    buf.record_stream(stream)  # now, so that an error below cannot free it under queued copies
                lanes.append([buf, None])
            self._dos_lanes = lanes
        return self._dos_lanes

    @profiled("elixir.dos_update")
    def _update_dos(self, work: list) -> None:
        """Deep Optimizer States: these host chunks' updates run on the compute device, a tile at a
        time (`DOS_TILE`), through the step's buffers in turn (`_dos_lane_buffers`).

        On CUDA a tile goes up and is updated on one stream and comes back on another
        (`ChunkStore.dos_streams`), so that one tile's state comes back while the next one's goes
        up, both directions of the link busy at once: with a stream per buffer, each running its
        tile's copies up, update and copies back in turn, the two could fall into step and take
        the link one direction at a time (on the H100, 2.5 to 3.2 G params/s where the link's
        rate each way allows 3.8 G). A tile's upload into a buffer waits for the copies back of
        the tile that used it before. The copies overlap compute instead of holding up the compute
        stream. A chunk's update starts when its gradient is final in the last backward, where the
        CPU updates may start there (`gradient_final`), else at `step()`; either way it overlaps
        the next forward too. Each chunk's `landed` events (one per DOS stream) tell its next readers
        when its state is back: a fetch makes its stream wait for them, a host reader (`settle`)
        waits for them on the host. A gradient in the compute dtype lands in the exp_avg row
        before the moment does, and the master's cast for the upload copy goes out through the
        gradient row once the update has used it: no fifth buffer.
        """
        for c, calls, factor in work:
            self._update_dos_chunk(c, calls, factor, self._dos_lane_buffers())

    def _dos_tiles(self, c: Chunk, calls: list, lanes: list):
        """(lane, the calls restricted to the tile, lo, hi) per tile of the chunk that has a gradient
        somewhere (elsewhere its state and upload copy stay), the lanes taken in turn."""
        width = lanes[0][0].shape[1]
        for lo in range(0, c.shard_len, width):
            hi = min(lo + width, c.shard_len)
            tile_calls = _tile_calls(calls, lo, hi)
            if tile_calls:
                lane = lanes[self._dos_turn % len(lanes)]
                self._dos_turn += 1
                yield lane, tile_calls, lo, hi

    def _update_dos_chunk(self, c: Chunk, calls: list, factor: float, lanes: list) -> None:
        streams = self.store.dos_streams
        if streams is None:  # no streams: each tile in turn, at once
            for lane, tile_calls, lo, hi in self._dos_tiles(c, calls, lanes):
                self._dos_tile_in(c, tile_calls, factor, lane[0], lo, hi)
                self._dos_tile_out(c, lane[0], lo, hi)
            return
        up, down = streams
        queued = False
        try:
            for lane, tile_calls, lo, hi in self._dos_tiles(c, calls, lanes):
                buf, free = lane
                with torch.cuda.stream(up):
                    if not queued:
                        queued = True
                        for event in (c.grad_ready, c.host_read):  # the gradient is down; no fetch still reads
                            if event is not None:
                                up.wait_event(event)
                    if free is not None:  # the buffer's last tile has gone back
                        up.wait_event(free)
                    self._dos_tile_in(c, tile_calls, factor, buf, lo, hi)
                    updated = torch.cuda.Event()
                    updated.record(up)
                with torch.cuda.stream(down):
                    down.wait_event(updated)
                    try:
                        self._dos_tile_out(c, buf, lo, hi)
                    finally:  # the next upload into this buffer waits for what was queued, even partly
                        lane[1] = torch.cuda.Event()
                        lane[1].record(down)
        finally:  # even when it raised partway: a copy already queued must still be waited for by readers
            if queued:
                events = []
                for stream in streams:
                    event = torch.cuda.Event(blocking=True)
                    event.record(stream)
                    events.append(event)
                c.landed = tuple(events)

    @staticmethod
    def _dos_tile_in(c: Chunk, calls: list, factor: float, buf: torch.Tensor, lo: int, hi: int) -> None:
        """The tile's gradient and state up into `buf`, updated there, and the master cast for the
        upload copy into the gradient row."""
        k = hi - lo
        master, m, v, grad = (buf[j, :k] for j in range(4))
        if c.grad.dtype == torch.float32:
            grad.copy_(c.grad[lo:hi], non_blocking=True)
        else:
            low = buf[1].view(c.grad.dtype)[:k]
            low.copy_(c.grad[lo:hi], non_blocking=True)
            grad.copy_(low)  # widened on the device: half the bytes cross
        if factor != 1.0:  # clipping of a low-precision gradient
            grad.mul_(factor)
        master.copy_(c.master[lo:hi], non_blocking=True)
        m.copy_(c.exp_avg[lo:hi], non_blocking=True)
        v.copy_(c.exp_avg_sq[lo:hi], non_blocking=True)
        run_adam(calls, master, grad, m, v)
        if c.upload is not None:
            buf[3].view(c.upload.dtype)[:k].copy_(master)  # cast on the device: half the bytes cross

    @staticmethod
    def _dos_tile_out(c: Chunk, buf: torch.Tensor, lo: int, hi: int) -> None:
        """The tile's updated state (and upload copy) back from `buf` to the host chunk."""
        k = hi - lo
        c.master[lo:hi].copy_(buf[0, :k], non_blocking=True)
        c.exp_avg[lo:hi].copy_(buf[1, :k], non_blocking=True)
        c.exp_avg_sq[lo:hi].copy_(buf[2, :k], non_blocking=True)
        if c.upload is not None:
            c.upload[lo:hi].copy_(buf[3].view(c.upload.dtype)[:k], non_blocking=True)
