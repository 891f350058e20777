"""The searched plan against the hand-made recipes, each measured in its own process.

For one bench shape and cap: search the plan (the shape's own activation-checkpointing setting, so
every row trains the same computation), cost the hand-made recipes (all state on the host, as
much as fits on the device, Gemini-style offload fractions), then run each plan that fits for a few
steps and set the measured step time and peak device memory beside the predictions.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from typing import Optional

import torch

from elixir_ray.bench.run import run_logged, write_json
from elixir_ray.bench.systems import SHAPES
from elixir_ray.planner.alternatives import hand_made_plans
from elixir_ray.planner.hardware import HardwareProfile
from elixir_ray.planner.model_profile import profile_model
from elixir_ray.planner.op_timing import device_is_here, time_ops
from elixir_ray.planner.search import SAFETY, SearchSettings, make_layout, plan_search
from elixir_ray.units import format_bytes


def candidate_plans(shape_name: str, cap_bytes: int, hardware: HardwareProfile, memory_margin: float = SAFETY) -> dict:
    from elixir_ray.model.gpt import build_gpt

    shape = SHAPES[shape_name]
    dtype = getattr(torch, shape.dtype)
    elem = torch.empty(0, dtype=dtype).element_size()
    model = build_gpt(shape.model_shape(), shape.activation_checkpointing, device="meta")
    sample = (torch.zeros(shape.micro_batch, shape.seq_len + 1, dtype=torch.long),)
    profile = profile_model(model, sample, None, None, dtype)
    if device_is_here(hardware):
        profile.compute = time_ops(profile.trace.ops, hardware, max_bytes=cap_bytes // 2)
    # the benchmark's loop declares one backward per step and does not clip: CPU updates start in backward
    settings = SearchSettings(hardware, cap_bytes, 1, shape.dtype, elem, updates_in_backward=True,
                              memory_margin=memory_margin)
    searched = plan_search([profile], settings)
    layout = make_layout(profile, searched.chunk_size, 1)
    return {"searched": searched,
            **hand_made_plans(layout, dataclasses.replace(settings, memory_margin=searched.memory_margin))}


def run_plan_table(shape_name: str, cap_bytes: int, hardware: HardwareProfile, steps: int = 4, warmup: int = 3,
                   device: Optional[str] = None, progress=print, log_dir: Optional[str] = None,
                   memory_margin: float = SAFETY) -> list[dict]:
    """`log_dir`: where each run's whole output goes (plan-N.log), a failure's traceback included.
    `memory_margin`: the share of the cap every plan keeps back."""
    rows = []
    plans = candidate_plans(shape_name, cap_bytes, hardware, memory_margin)
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, plan) in enumerate(plans.items()):
            if plan is None:
                rows.append({"plan": name, "fits": False})
                continue
            progress(f"[{i + 1}/{len(plans)}] {name}")
            plan_path, out = os.path.join(tmp, f"plan{i}.json"), os.path.join(tmp, f"result{i}.json")
            with open(plan_path, "w") as f:
                f.write(plan.to_json())
            cmd = [sys.executable, "-m", "elixir_ray.bench.one_system", "--system", "elixir_ray", "--shape", shape_name,
                   "--cap-bytes", str(cap_bytes), "--plan", plan_path, "--steps", str(steps), "--warmup", str(warmup),
                   "--out", out] + (["--device", device] if device else [])
            code, tail = run_logged(cmd, os.path.join(log_dir or tmp, f"plan-{i}.log"), title=name)
            result = json.load(open(out)) if os.path.exists(out) else {"skipped": f"process exited {code}: {tail}"}
            if log_dir:  # kept as it comes: a run stopped later (a time limit) loses only the plan running
                write_json(os.path.join(log_dir, f"plan-{i}.json"), {"plan": name, **result})
            progress(f"    {name}: " + (f"skipped: {result['skipped'][:200]}" if result.get("skipped") else
                                        f"{result['step_seconds']:.3f} s/step measured, "
                                        f"{plan.predicted_step_seconds:.3f} s predicted"))
            rows.append({"plan": name, "fits": True, "predicted_step_seconds": plan.predicted_step_seconds,
                         "predicted_peak_bytes": plan.predicted_peak_bytes, "device_chunks": plan.placements.count("device"),
                         "n_chunks": plan.n_chunks, "n_blocks": plan.n_blocks, **{k: result.get(k) for k in (
                             "step_seconds", "tokens_per_s", "peak_device_bytes", "breakdown", "background",
                             "skipped")}})
    return rows


def plan_table_markdown(rows: list[dict]) -> str:
    lines = ["| plan | device chunks | pool | predicted step | measured step | tokens/s | predicted peak | measured peak |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if not r["fits"]:
            lines.append(f"| {r['plan']} | does not fit the cap | | | | | | |")
        elif r.get("skipped"):
            lines.append(f"| {r['plan']} | {r['device_chunks']}/{r['n_chunks']} | {r['n_blocks']} | "
                         f"{r['predicted_step_seconds']:.3f} s | failed: {r['skipped'][:80]} | | | |")
        else:
            measured_peak = format_bytes(r["peak_device_bytes"]) if r.get("peak_device_bytes") else "n/a (CPU)"
            lines.append(f"| {r['plan']} | {r['device_chunks']}/{r['n_chunks']} | {r['n_blocks']} | "
                         f"{r['predicted_step_seconds']:.3f} s | {r['step_seconds']:.3f} s | {r['tokens_per_s']:,.0f} | "
                         f"{format_bytes(r['predicted_peak_bytes'])} | {measured_peak} |")
    return "\n".join(lines)
