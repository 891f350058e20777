"""`elixir_ray.wrap(module, optimizer, ...)`: train any nn.Module within a device-memory budget, in
your own training loop.

It composes the planner and the engine: the engine checks the module and optimizer and resolves
the device, dtype and process group; when no plan is given, rank 0 searches one (the planner) and
every rank runs it; then the engine builds the chunked module from the plan. Nothing touches the
module before the plan is there: a bad optimizer or a budget too small raises with it unchanged.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from elixir_ray.chunk_plan.plan import Plan
from elixir_ray.engine.chunks import device_scope
from elixir_ray.engine.device import random_state_kept, resolve_device
from elixir_ray.engine.wrap import Target, WrapOptions, build, check_wrappable, one_plan_for_all_ranks, resolve_target
from elixir_ray.planner.api import plan as search_plan
from elixir_ray.planner.api import quick_hardware
from elixir_ray.planner.search import check_margin


def wrap(module: nn.Module, optimizer: torch.optim.Optimizer, *, sample_inputs: Union[tuple, dict, None] = None,
         device_memory: Union[int, str, None] = None, plan: Optional[Plan] = None,
         process_group: Optional[dist.ProcessGroup] = None, max_grad_norm: Optional[float] = None,
         dtype: Optional[torch.dtype] = None, device: Union[torch.device, str, None] = None,
         init_fn: Optional[Callable[[nn.Module], None]] = None, loss_fn: Optional[Callable] = None,
         accumulation_steps: Optional[int] = None, prefetch: Optional[int] = None,
         memory_margin: Optional[float] = None):
    """Returns (model, optimizer) that train `module` chunk by chunk within `device_memory`.

    `sample_inputs` is one step's inputs, traced to order the chunks: a tuple of forward's positional
    inputs, or a dict of its keyword inputs (a Hugging Face model's `input_ids` and `labels`). The
    trace runs backward from the loss: forward's output when it is a tensor, else its `loss` (a
    ModelOutput's), else what `loss_fn(output)` returns; those two must be scalars.
    `plan`: a `Plan` to run (`elixir_ray.plan`, `engine.manual_plan`, `Plan.from_json`); without
    one, wrap measures the device briefly and searches the fastest plan within `device_memory`.
    `accumulation_steps=N` promises `optimizer.step()` after every N backward() calls, which lets
    host chunks start their CPU update during the N-th backward, and device chunks update there and
    release their gradients once applied (see docs/engine.md); `prefetch`
    is how many chunks ahead of the trace the pool loads (0: only on demand; see pool.py; default
    the plan's `prefetch_depth`).
    `memory_margin`: the fraction of `device_memory` the plan search keeps back for the allocator
    (default 0.1 on CUDA, where the engine turns on the allocator's expandable segments unless
    PYTORCH_CUDA_ALLOC_CONF turns them off, else 0.2: engine/allocator.py; only where wrap searches
    the plan).
    """
    options = WrapOptions(process_group=process_group, max_grad_norm=max_grad_norm, dtype=dtype, device=device,
                          init_fn=init_fn, loss_fn=loss_fn, accumulation_steps=accumulation_steps, prefetch=prefetch)
    check_wrappable(module, optimizer, options)
    if memory_margin is not None:
        if plan is not None:
            raise ValueError("memory_margin is the plan search's, and a plan was given: pass it to elixir_ray.plan "
                             "instead, or drop plan= to let wrap search")
        check_margin(memory_margin)
    options = replace(options, device=resolve_device(device))
    # the engine's device is current while it is set up (the pinned arena's registration, streams,
    # planning): a CUDA call on another current device would create a context there
    with device_scope(options.device):
        target = resolve_target(module, optimizer, sample_inputs, options)
        if plan is None:
            plan = one_plan_for_all_ranks(target.comm, partial(_search, module, target, device_memory, memory_margin))
        return build(module, optimizer, plan, target)


def _search(module: nn.Module, target: Target, device_memory: Union[int, str, None],
            memory_margin: Optional[float]) -> Plan:
    """The plan wrap runs when given none: searched for the loop the options describe, after a
    short measurement of the device, leaving the random generators as they were."""
    steps = target.options.accumulation_steps
    with random_state_kept(target.device):
        return search_plan(module, target.sample_inputs, device_memory=device_memory, world_size=target.comm.world,
                           hardware=quick_hardware(target.device, device_memory), dtype=target.dtype,
                           loss_fn=target.options.loss_fn, grad_accum=steps or 1, low_host_grads=steps == 1,
                           updates_in_backward=target.updates_in_backward, memory_margin=memory_margin)
