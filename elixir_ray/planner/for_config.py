"""Planning a run's config without a cluster: what `elixir-ray plan CONFIG.yaml` shows."""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch

from elixir_ray.chunk_plan.errors import PlanError
from elixir_ray.chunk_plan.plan import Plan, recomputation
from elixir_ray.config import RunConfig
from elixir_ray.planner.alternatives import hand_made_plans
from elixir_ray.planner.api import Profiling, host_budget, planning_budget, search_module, search_settings
from elixir_ray.planner.hardware import HardwareProfile
from elixir_ray.planner.model_profile import ModelProfile, checkpointing_variants
from elixir_ray.planner.op_timing import device_is_here
from elixir_ray.planner.search import plan_layout


BATCH_HINT = re.compile(r"use micro-batch (\d+) or less, an estimate that takes activations as proportional to the "
                        r"micro-batch")
OWN_CHECKPOINTING = re.compile(r"call \w+\.\w+_checkpointing_enable\(\) before planning or wrap(?: \(activation "
                               r"checkpointing\))?")


@contextmanager
def config_hints(cfg: RunConfig, fits: Optional[Callable[[int], bool]] = None):
    """A PlanError raised inside names the config keys that act on its remedy (the planner itself
    knows nothing of configs). `fits(micro_batch)`, when given, turns the planner's estimate of a
    micro-batch that fits into one a plan was found for (it tries a few below the estimate)."""
    try:
        yield
    except PlanError as exc:
        if exc.remedy is None:
            raise
        remedy = exc.remedy
        if cfg.model.hf is not None:  # the model.hf model's own switch is a config key
            remedy = OWN_CHECKPOINTING.sub("turn on the model's own activation checkpointing "
                                           "(--set model.activation_checkpointing=true)", remedy, count=1)
        hints = {  # the planner's advice -> the config keys that follow it
            "enable activation checkpointing": "--set engine.search_checkpointing=true lets the planner choose per "
                                               "block, or --set model.activation_checkpointing=full",
            "recompute whole blocks: full activation checkpointing, or let the planner choose per block":
                "--set model.activation_checkpointing=full, or --set engine.search_checkpointing=true",
        }
        advice = next((a for a in hints if a in remedy), None)
        batch = BATCH_HINT.search(remedy)
        if advice is not None and not cfg.engine.search_checkpointing:
            remedy = remedy.replace(advice, f"{advice} ({hints[advice]})", 1)
        elif batch:
            remedy = remedy.replace(batch.group(0), _batch_advice(int(batch.group(1)), fits), 1)
        elif "use shorter sequences" in remedy:
            remedy = remedy.replace("use shorter sequences", "use shorter sequences (--set model.seq_len=...)", 1)
        if remedy == exc.remedy:
            raise
        raise exc.with_remedy(remedy) from None


def _batch_advice(estimate: int, fits: Optional[Callable[[int], bool]]) -> str:
    keep = "and raise train.grad_accum to keep the global batch"
    if fits is None:
        return (f"use micro-batch {estimate} or less, an estimate that takes activations as proportional to the "
                f"micro-batch (--set train.micro_batch={estimate}, {keep})")
    tried = range(estimate, max(0, estimate - 4), -1)
    for m in tried:
        if fits(m):
            return f"use micro-batch {m} (a plan at {m} fits: --set train.micro_batch={m}, {keep})"
    if tried[-1] == 1:
        return ("even micro-batch 1 does not fit (a plan at 1 was tried): use shorter sequences (--set "
                "model.seq_len=...) or a smaller model, or give the device more memory")
    return (f"use a micro-batch below {tried[-1]} (plans at {estimate} down to {tried[-1]} do not fit: "
            f"--set train.micro_batch=N, {keep})")


def _with_setting(setting: Optional[list]) -> str:
    if setting is None:
        return ""
    whole, selective = recomputation(setting)
    return (f" with {whole} of {len(setting)} blocks recomputed whole"
            + (f", {selective} selectively" if selective else ""))


@dataclass
class ConfigPlan:
    plan: Plan
    profile: ModelProfile  # the profile (checkpointing setting) the plan chose
    elem_bytes: int
    alternatives: dict  # name -> Plan or None (does not fit)
    misfits: dict = field(default_factory=dict)  # name -> why it does not fit (device or host memory)
    host_budget: int = 0  # host RAM per rank the plans could keep optimizer state in


def plan_config(cfg: RunConfig, hardware: HardwareProfile, device_memory: Optional[str] = None,
                world_size: int = 1, host_memory: Optional[str] = None, progress=None) -> ConfigPlan:
    from elixir_ray.model.factory import build_model, sample_inputs, trace_loss
    from elixir_ray.run_plan import resolve_dtype, updates_in_backward

    device = torch.device(hardware.device)
    dtype_name = resolve_dtype(cfg.train.dtype, device.type)
    dtype = getattr(torch, dtype_name)
    elem = torch.empty(0, dtype=dtype).element_size()
    in_backward = updates_in_backward(cfg, dtype_name)
    memory = device_memory or cfg.engine.device_memory
    budget = planning_budget(memory, hardware)
    host, host_from = host_budget(host_memory or None, hardware, world_size, flag="--host-memory")

    settings = search_settings(hardware, budget, world_size, dtype, grad_accum=cfg.train.grad_accum, host_budget=host,
                               host_budget_from=host_from,
                               updates_in_backward=in_backward, replicate=cfg.engine.replicate,
                               memory_margin=cfg.engine.memory_margin)

    def search(micro_batch: int, timed: bool, say=None, variants=None):
        profiling = Profiling(loss_fn=trace_loss(cfg), search_checkpointing=cfg.engine.search_checkpointing,
                              variants=variants, time_compute=timed)
        return search_module(build_model(cfg, device="meta"), sample_inputs(cfg, micro_batch), settings, profiling,
                             say)

    def fits(micro_batch: int) -> bool:
        """Whether some checkpointing setting has a plan at `micro_batch`: memory alone decides (no
        kernel timing), and the settings are tried one at a time, the most recomputation first, so
        that a micro-batch that fits usually costs one trace instead of one per setting."""
        settings = checkpointing_variants(build_model(cfg, device="meta")) if cfg.engine.search_checkpointing \
            else [None]
        say = progress or (lambda line: None)
        for setting in sorted(settings, key=recomputation, reverse=True):
            say(f"checking whether micro-batch {micro_batch} fits" + _with_setting(setting))
            try:
                search(micro_batch, timed=False, variants=[setting])
                return True
            except PlanError:
                continue
        return False

    with config_hints(cfg, fits):
        plan, chosen = search(cfg.train.micro_batch, device_is_here(hardware), progress)
    layout = plan_layout(chosen, plan)
    why_not: dict = {}
    alternatives = hand_made_plans(layout, replace(settings, memory_margin=plan.memory_margin), why_not)
    return ConfigPlan(plan=plan, profile=chosen, elem_bytes=elem, alternatives=alternatives, misfits=why_not,
                      host_budget=host)


def comparison_table(result: ConfigPlan) -> str:
    """Markdown: the searched plan beside each hand-made recipe, predicted time and peak."""
    from elixir_ray.units import format_bytes

    rows = [("searched", result.plan), *result.alternatives.items()]
    best = result.plan.predicted_step_seconds
    lines = ["| plan | predicted step | vs searched | predicted peak | device chunks | pool |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, p in rows:
        if p is None:
            why = result.misfits.get(name)
            lines.append(f"| {name} | does not fit{f' ({why})' if why else ''} | | | | |")
            continue
        lines.append(f"| {name} | {p.predicted_step_seconds * 1e3:,.1f} ms | {p.predicted_step_seconds / best:.2f}x | "
                     f"{format_bytes(p.predicted_peak_bytes)} | {p.placements.count('device')}/{p.n_chunks} | "
                     f"{p.n_blocks} |")
    return "\n".join(lines)
