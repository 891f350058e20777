"""The peak memory and step time this version predicts for plans measured earlier: `python
jobs/bench_repredict.py RESULT.json...`, each an `elixir_ray.json` written by `elixir-ray bench`
(its plan, shape and measured peak and step). Each plan's model is traced on the meta device (no
weights, a few seconds) and its placement costed with `elixir_ray.planner.search.plan_memory` and
`plan_step_seconds`, so a change to the cost model is checked against every GPU measurement
already made, without a GPU.

The step is re-costed with the rates and compute the plan was made with: the plan's `hardware`
(plans from version 4 on), else the rates line of its notes; its forward's compute, else the
traced FLOPs' forward share of its compute. `--compute-scale X` multiplies the compute and
`--link-gbps G` sets `copies_beside_cpu_adam_gbps` (`--device-adam-rate G`, the device AdamW's
G params/s), to see what a better-measured rate would predict; `--run-cpu-rate` costs each run's
CPU AdamW at the rate its own updates ran (the median over its timeline's updates), which tells a
wrong rate from a wrong model. `--search` also
searches each run's shape afresh at its cap and those rates (every checkpointing setting, the
compute from the traced FLOPs at the rate that gives the measured plan its own compute), to say
what plan this version would choose there and what it would predict. Its forward is then the
traced FLOPs' share of the compute, where the re-costed plan keeps its own measured forward, so
the two differ a little even for the same plan.

Each run's model is traced with the loss it computed (`sliced_loss` in its result: the logits a
slice of rows at a time, or, in a result that does not say, all at once); a search afresh traces
this version's GPT.

Beside each measured step, a run with the device's marks (CUDA) also has the mean interval
between the device's marks at its timed steps' starts, from the second step's: an estimate of a
long run's step, free of the timed window's ends (in runs timed after a synced warm-up step, the
window's first step found fewer CPU updates pending, and the window waited for its last step's
updates)."""

import argparse
import copy
import dataclasses
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from elixir_ray.bench.report import device_lag, step_interval, update_job_rates  # noqa: E402
from elixir_ray.bench.systems import SHAPES  # noqa: E402
from elixir_ray.chunk_plan.plan import Plan, recomputation  # noqa: E402
from elixir_ray.model.gpt import build_gpt  # noqa: E402
from elixir_ray.planner.api import Profiling, search_module, search_settings  # noqa: E402
from elixir_ray.planner.hardware import HardwareProfile  # noqa: E402
from elixir_ray.planner.model_profile import profile_model  # noqa: E402
from elixir_ray.planner.op_timing import ComputeTimes  # noqa: E402
from elixir_ray.planner.search import forward_wait, plan_memory, plan_step_seconds  # noqa: E402
from elixir_ray.units import format_bytes  # noqa: E402


def _rate(line: str, pattern: str, scale: float = 1.0, default=None) -> float:
    found = re.search(pattern, line)
    if found is None:
        if default is None:
            raise ValueError(f"no {pattern!r} in the plan's rates line: {line}")
        return default
    return float(found.group(1)) * scale


def plan_hardware(plan: Plan) -> HardwareProfile:
    """The rates the plan was costed at: its `hardware`, or for an older plan its notes' rates line
    (`HardwareProfile.rates()`, rounded as printed)."""
    if plan.hardware:
        return HardwareProfile(**plan.hardware)
    line = next((n for n in plan.notes if n.startswith("rates (")), None)
    if line is None:
        raise ValueError("the plan has neither hardware nor a rates line in its notes")
    return HardwareProfile(
        device="cuda:0", h2d_gbps=_rate(line, r"host->device ([\d.]+) GB/s"),
        d2h_gbps=_rate(line, r"device->host ([\d.]+) GB/s"),
        cpu_adam_params_per_s=_rate(line, r"CPU AdamW ([\d.]+) G", 1e9),
        cpu_adam_low_grad_params_per_s=_rate(line, r"\(([\d.]+) G from bf16", 1e9, 0.0),
        cpu_adam_beside_copies=_rate(line, r"x([\d.]+) beside copies", 1.0, 0.0),
        copies_beside_cpu_adam_gbps=_rate(line, r"beside it ([\d.]+) GB/s", 1.0, 0.0),
        device_adam_params_per_s=_rate(line, r"device AdamW ([\d.]+) G", 1e9),
        matmul_tflops=_rate(line, r"matmul ([\d.]+) TFLOPS"), cpu_threads=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="elixir_ray.json files from elixir-ray bench")
    parser.add_argument("--compute-scale", type=float, default=1.0,
                        help="multiply each plan's compute by this before re-costing its step")
    parser.add_argument("--link-gbps", type=float, default=None,
                        help="re-cost the steps with copies_beside_cpu_adam_gbps set to this")
    parser.add_argument("--device-adam-rate", type=float, default=None,
                        help="re-cost the steps with the device AdamW at this many G params/s (it also sets the "
                             "device memory rate the engine's own kernels are costed at)")
    parser.add_argument("--run-cpu-rate", action="store_true",
                        help="re-cost each step with the CPU AdamW at the rate the run's own updates ran (the "
                             "median over its timeline; a run without updates on its timeline keeps the plan's)")
    parser.add_argument("--search", action="store_true",
                        help="also search each run's shape afresh at its cap and the rates it is re-costed at")
    parser.add_argument("--memory-margin", type=float, default=None,
                        help="with --search: the share of the cap the search keeps back (default: the plan's)")
    args = parser.parse_args()
    if args.memory_margin is not None and not args.search:
        parser.error("--memory-margin is for --search")
    if args.device_adam_rate is not None and not args.device_adam_rate > 0:
        parser.error(f"--device-adam-rate must be a positive number of G params/s, got {args.device_adam_rate}")
    results = []
    for path in args.results:  # every file checked before any model is traced
        try:
            with open(path) as f:
                result = json.load(f)
        except (OSError, ValueError) as exc:
            parser.error(f"{path}: cannot read it as JSON ({exc})")
        if not isinstance(result, dict) or not result.get("plan") or not result.get("peak_device_bytes") \
                or result.get("shape") not in SHAPES:
            parser.error(f"{path}: not an elixir_ray result of a CUDA run of elixir-ray bench (it needs the plan, "
                         f"the measured peak and one of the shapes {', '.join(sorted(SHAPES))})")
        results.append(result)
    print("| shape | cap | measured peak | predicted at the run | predicted now | largest parts now |")
    print("|---|---|---|---|---|---|")
    steps, paths, searched = [], [], []
    traced: dict = {}  # runs of one shape, loss and checkpointing share one trace (a 10B GPT's takes seconds)
    for result in results:
        shape, plan = SHAPES[result["shape"]], Plan.from_dict(result["plan"])
        # the loss as the run computed it: a result that does not say took the logits whole
        model = build_gpt(shape.model_shape(), shape.activation_checkpointing, device="meta",
                          sliced_loss=bool(result.get("sliced_loss")))
        sample = torch.randint(0, shape.vocab_size, (shape.micro_batch, shape.seq_len + 1))
        dtype = getattr(torch, plan.dtype)
        elem = torch.empty(0, dtype=dtype).element_size()
        key = (shape.name, bool(result.get("sliced_loss")), json.dumps(plan.activation_checkpointing), plan.dtype)
        if key not in traced:
            traced[key] = profile_model(model, (sample,), None, plan.activation_checkpointing, dtype)
        profile = copy.copy(traced[key])  # its compute is set per run below
        parts = plan_memory(plan, profile, elem)
        now, measured, then = sum(parts.values()), result["peak_device_bytes"], plan.predicted_peak_bytes
        largest = ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v)
        print(f"| {shape.name} | {format_bytes(result['cap_bytes'])} | {format_bytes(measured)} | "
              f"{format_bytes(then)} ({then / measured:.2f}x) | {format_bytes(now)} ({now / measured:.2f}x) | {largest} |",
              flush=True)
        if plan.time.get("compute") and result.get("step_seconds"):
            compute = plan.time["compute"] / plan.grad_accum * args.compute_scale  # one micro-step's
            forward = (plan.forward_compute_seconds * args.compute_scale if plan.forward_compute_seconds
                       else compute * profile.trace.forward_flops / max(profile.trace.flops, 1))
            profile.compute = ComputeTimes(device="cuda:0", forward_seconds=forward, step_seconds=compute, timed=0)
            hw = plan_hardware(plan)
            if args.link_gbps is not None:
                hw = dataclasses.replace(hw, copies_beside_cpu_adam_gbps=args.link_gbps)
            if args.device_adam_rate is not None:
                hw = dataclasses.replace(hw, device_adam_params_per_s=args.device_adam_rate * 1e9)
            ran = update_job_rates(result.get("timeline") or []).get("median") if args.run_cpu_rate else None
            if ran:  # the factor on the plan's rate that gives the run's (`HardwareProfile.cpu_adam_rate`)
                base = hw.cpu_adam_rate(low_grads=plan.host_grads_low) / (hw.cpu_adam_beside_copies or 1.0)
                if base > 0:
                    hw = dataclasses.replace(hw, cpu_adam_beside_copies=ran / base)
            path: dict = {}
            step = plan_step_seconds(plan, profile, hw, elem, updates_in_backward=updates_in_backward(plan),
                                     path=path)
            steps.append((shape.name, result["cap_bytes"], result["step_seconds"], plan.predicted_step_seconds, step,
                          step_interval(result.get("timeline") or [])))
            if args.search:
                now_model = build_gpt(shape.model_shape(), shape.activation_checkpointing, device="meta")
                searched.append((shape.name, result["cap_bytes"], step, search_again(
                    now_model, sample, result["cap_bytes"], plan, profile, hw, dtype, compute, args.memory_margin)))
            paths.append((shape.name, result["cap_bytes"], path, device_lag(result.get("timeline") or [])))
    if steps:
        print()
        print("| shape | cap | measured step | predicted at the run | predicted now | between the device's step "
              "starts, against now |")
        print("|---|---|---|---|---|---|")
        for name, cap, measured, then, now, interval in steps:
            between = f"{interval:.3f} s ({interval / now:.2f}x)" if interval else ""
            print(f"| {name} | {format_bytes(cap)} | {measured:.3f} s | {then:.3f} s ({measured / then:.2f}x) | "
                  f"{now:.3f} s ({measured / now:.2f}x) | {between} |")
        print()
        print("Where the step goes, now: the model's critical path beside the run's medians on the device "
              "(a run without the device's marks has none)")
        print()
        print("| shape | cap | forward + its wait, model | forward, measured | recompute and backward, model | "
              "backward, measured |")
        print("|---|---|---|---|---|---|")
        for name, cap, path, lag in paths:
            wait, for_updates = forward_wait(path)
            kind = "updates, loads" if for_updates else "copies"
            forward = f"{lag['device_forward'] * 1e3:.0f} ms" if lag else ""
            backward = f"{lag['device_backward'] * 1e3:.0f} ms" if lag else ""
            print(f"| {name} | {format_bytes(cap)} | {float(path['forward']) * 1e3:.0f} + {wait * 1e3:.0f} ms ({kind}) | "
                  f"{forward} | {float(path['rest']) * 1e3:.0f} ms | {backward} |")
    if searched:
        print()
        print("Searched afresh at each run's cap and the rates above (compute from the traced FLOPs at the rate "
              "that gives the measured plan its own)")
        print()
        print("| shape | cap | measured plan, re-costed | searched now | its plan |")
        print("|---|---|---|---|---|")
        for name, cap, step, found in searched:
            print(f"| {name} | {format_bytes(cap)} | {step:.3f} s | {found.predicted_step_seconds:.3f} s "
                  f"({step / found.predicted_step_seconds:.2f}x faster) | {plan_summary(found)} |")
        print()
        for name, cap, _, found in searched:  # each found plan's own account of its step
            path = next((n for n in found.notes if n.startswith("critical path:")), "")
            print(f"- {name} at {format_bytes(cap)}: {path}")
    return 0


def search_again(model, sample, cap: int, plan: Plan, profile, hw: HardwareProfile, dtype, compute: float,
                 margin) -> Plan:
    """The plan this version searches for a run: its cap, one rank, every checkpointing setting, the
    loop the plan was made for, at `hw` with the matmul rate at which the traced FLOPs of the
    measured plan's setting take its measured `compute` (the other settings have no timed kernels)."""
    effective = profile.trace.flops / compute / 1e12
    settings = search_settings(dataclasses.replace(hw, matmul_tflops=effective), cap, 1, dtype,
                               grad_accum=plan.grad_accum, updates_in_backward=updates_in_backward(plan),
                               memory_margin=plan.memory_margin if margin is None else margin)
    found, _ = search_module(model, (sample,), settings, Profiling(search_checkpointing=True))
    return found


def updates_in_backward(plan: Plan) -> bool:
    """Whether the plan's host updates start in backward: a plan made from version 4 on, the one with
    its hardware, says so itself; before, the benchmark's loop declared one backward per step, so
    they did."""
    return plan.updates_in_backward if plan.hardware else True


def plan_summary(plan: Plan) -> str:
    whole, selective = recomputation(plan.activation_checkpointing)
    host = plan.placements.count("host")
    return (f"{plan.n_chunks} chunks of {plan.chunk_size / 1e6:.0f}M, {host} on the host"
            + (f" (every {plan.dos_gap} by DOS)" if plan.dos_gap and host else "")
            + f", pool {plan.n_blocks} ({plan.prefetch_depth} ahead), {whole} blocks recomputed whole, "
            f"{selective} selectively, peak {format_bytes(plan.predicted_peak_bytes)}")


if __name__ == "__main__":
    sys.exit(main())
