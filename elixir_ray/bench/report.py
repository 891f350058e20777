"""Benchmark results as a markdown table, JSON and a PNG chart."""

from __future__ import annotations

import json
import os
from typing import Optional

import numpy as np

from elixir_ray.planner.cost import dos_mask
from elixir_ray.units import format_bytes

# measured categories first (elixir_ray/engine/timing.py), then the remainder of the step
BREAKDOWN_ORDER = ("compute_and_waits", "h2d", "d2h", "cpu_adam_wait", "device_adam")
BREAKDOWN_COLORS = {"compute_and_waits": "#4472c4", "h2d": "#ed7d31", "d2h": "#ffc000",
                    "cpu_adam_wait": "#70ad47", "device_adam": "#a5a5a5"}


def add_ratios(results: list[dict]) -> list[dict]:
    ref = next((r for r in results if r["system"] == "reference" and not r.get("skipped")), None)
    for r in results:
        if ref and not r.get("skipped"):
            r["ratio_to_reference"] = r["tokens_per_s"] / ref["tokens_per_s"]
    return results


def label(r: dict) -> str:
    """A result's name in the report: its system, and its cap where the run had several; FSDP2
    offloading to pageable memory (`--fsdp2-pageable`) says so."""
    return (r.get("label") or r["system"]) + _pageable(r)


def _ratio(r: dict) -> str:
    """The ratio to the reference, or "n/a" in a run without one (the reference not among the systems)."""
    ratio = r.get("ratio_to_reference")
    return "n/a" if ratio is None or ratio != ratio else f"{ratio:.2f}"


def _pageable(r: dict) -> str:
    return " (pageable)" if r.get("fsdp2_pinned") is False else ""


def device_peak(r: dict) -> str:
    """The peak device memory of a result, or "n/a (CPU)" where there is no device to measure."""
    return format_bytes(r["peak_device_bytes"]) if str(r.get("device", "")).startswith("cuda") else "n/a (CPU)"


def _tflops(value: float) -> str:
    """One decimal on a GPU (hundreds of TFLOPS); three significant digits below 10, where one
    decimal would read a CPU's 0.03 as 0.0."""
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def _spread(r: dict) -> str:
    """The timed steps' fastest and slowest ("" for a result that has no per-step times)."""
    times = r.get("step_times") or []
    return f"{min(times):.3f} to {max(times):.3f} ({len(times)})" if times else ""


def markdown_table(results: list[dict]) -> str:
    lines = ["| system | cap | tokens/s | TFLOPS | ratio to reference | peak device | peak host | step (s), median | "
             "steps, min to max |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.get("skipped"):
            lines.append(f"| {r['system']}{_pageable(r)} | | skipped: {r['skipped']} | | | | | | |")
            continue
        cap = format_bytes(r["cap_bytes"]) if r.get("cap_bytes") else "none"
        lines.append(
            f"| {r['system']}{_pageable(r)} | {cap} | {r['tokens_per_s']:,.0f} | {_tflops(r['tflops'])} | "
            f"{_ratio(r)} | {device_peak(r)} | "
            f"{format_bytes(r['peak_host_bytes'])} | {r['step_seconds']:.3f} | {_spread(r)} |"
        )
    clipped = {r.get("max_grad_norm") for r in results if not r.get("skipped")}
    if clipped and clipped != {None}:
        lines += ["", "Every system clipped its gradients' global norm to "
                      + " / ".join(str(c) for c in sorted(clipped, key=str)) + " before each update."]
    losses = [f"{label(r)} {r['first_loss']:.3f} to {r['final_loss']:.3f}" for r in results
              if not r.get("skipped") and r.get("first_loss") is not None]
    if losses:  # the same GPT from the same batch: a system apart from the others is not training the same
        lines += ["", "Loss from the first warm-up step to the last timed one: " + "; ".join(losses) + "."]
    lines += [f"**{line}**" for line in training_apart(results)]
    finals = final_loss_lines(results)
    if finals:
        lines += ["", "Final loss against the reference's, the same batches: " + "; ".join(finals) + "."]
    whole = [label(r) for r in results if not r.get("skipped") and r.get("sliced_loss") is False]
    if whole and any(r.get("sliced_loss") for r in results):  # the same values, more activation memory
        lines += ["", "The loss took the head's logits all at once (not a slice of rows at a time, as the "
                      f"others did) in: {', '.join(whole)}."]
    breakdown = breakdown_table(results)
    if breakdown:
        lines += ["", breakdown]
    predictions = prediction_lines(results)
    if predictions:
        lines += ["", *predictions]
    cpu = host_cpu_line(results)
    if cpu:
        lines += ["", cpu]
    python = python_lines(results)
    if python:
        lines += ["", "Python on the training thread, one more step under cProfile (self time; it slows Python calls, "
                      "so read the shares):", *python]
    return "\n".join(lines)


# a reference whose loss fell by less than this is too close to its start to tell trainings apart
MIN_REFERENCE_FALL = 0.2


def training_apart(results: list[dict]) -> list[str]:
    """A line per system whose loss fell by less than half of what the reference's did over the
    same steps from the same batches (or rose): it is not doing the reference's training, so its
    speed is not one to compare with. Every system but DeepSpeed (which builds under its zero.Init)
    draws the same initial weights; a first loss apart moves the start, not how far the steps take
    it. On the H100
    (2026-11-27) FSDP2 offload's loss ended at 13.9 where plain PyTorch's fell to 9.5
    (docs/benchmarks.md, "Peers at 24 GiB")."""
    ref = next((r for r in results if r["system"] == "reference" and not r.get("skipped")
                and r.get("first_loss") is not None), None)
    fell = ref["first_loss"] - ref["final_loss"] if ref is not None else 0.0
    if fell < MIN_REFERENCE_FALL:
        return []
    out = []
    for r in results:
        if r is ref or r.get("skipped") or r.get("first_loss") is None:
            continue
        own = r["first_loss"] - r["final_loss"]
        if own < fell / 2:
            out.append(f"{label(r)} does not train as plain PyTorch does: its loss went from {r['first_loss']:.3f} "
                       f"to {r['final_loss']:.3f} where the reference's fell by {fell:.3f}, so its speed is not "
                       f"one to compare with")
    return out


def host_cpu_line(results: list[dict]) -> str:
    """The training thread's CPU time per timed step beside the step, per system: near the step,
    that thread's own work bounds it; the process's adds the background threads."""
    parts = [f"{label(r)} {r['host_thread_cpu_seconds'] * 1e3:.0f} ms of {r['step_seconds'] * 1e3:.0f} ms "
             f"({r['process_cpu_seconds'] * 1e3:.0f} ms in all threads)"
             for r in results if not r.get("skipped") and r.get("host_thread_cpu_seconds") is not None]
    if not parts:
        return ""
    return ("CPU time per timed step of the training thread (near the step: the host's own work bounds it, "
            "a spinning CUDA sync included; much less: it waits), and of the whole process: " + "; ".join(parts) + ".")


def python_lines(results: list[dict], top: int = 8) -> list[str]:
    """Per system, its profiled step's Python calls and the functions with the most self time."""
    out = []
    for r in results:
        rows = r.get("python_profile") or []
        if r.get("skipped") or not rows:
            continue
        _, calls, wall_ms, _ = rows[0]
        out.append(f"- {label(r)}: step {wall_ms:.1f} ms, {calls:,} Python calls; " + ", ".join(
            f"{where} {self_ms:.1f} ms ({n})" for where, n, self_ms, _ in rows[1:top + 1]))
    return out


def prediction_lines(results: list[dict]) -> list[str]:
    """The plan's predictions beside what was measured (the planner's accuracy, per run)."""
    out = []
    for r in results:
        if r.get("skipped") or not r.get("predicted_step_seconds"):
            continue
        line = (f"{label(r)}: predicted step {r['predicted_step_seconds']:.3f} s, measured {r['step_seconds']:.3f} s "
                f"({r['step_seconds'] / r['predicted_step_seconds']:.2f}x)")
        if r.get("last_updates_seconds") is not None:
            line += f" (the last step's CPU updates and copies ran {r['last_updates_seconds'] * 1e3:.0f} ms past the timed steps)"
        if r.get("peak_device_bytes") and r.get("predicted_peak_bytes"):
            line += (f"; predicted peak {format_bytes(r['predicted_peak_bytes'])}, measured "
                     f"{format_bytes(r['peak_device_bytes'])} ({r['peak_device_bytes'] / r['predicted_peak_bytes']:.2f}x)")
        rates = cpu_adam_rates(r)
        if rates:
            line += (f"; CPU AdamW {rates[0] / 1e9:.2f} G params/s in the background, planned at "
                     f"{rates[1] / 1e9:.2f} G")
        jobs = update_job_rates(r.get("timeline") or [])
        if jobs:
            line += (f"; untimed steps' CPU updates {jobs['median'] / 1e9:.2f} G params/s per update (median; "
                     f"{jobs['while_waited'] / 1e9:.2f} G while the training thread waited for one, "
                     f"{jobs['while_busy'] / 1e9:.2f} G otherwise)")
        pool = r.get("pool") or {}
        if pool.get("fetches"):
            line += (f"; {pool['fetches']:.0f} chunk loads per step, {pool['prefetches']:.0f} of them prefetched")
            if pool["prefetches"]:
                line += f" {pool.get('prefetch_lead', 0) / pool['prefetches']:.1f} accesses ahead on average"
            plan = r.get("plan") or {}
            if plan.get("n_blocks"):
                line += f" (a pool of {plan['n_blocks']} blocks, loading up to {plan.get('prefetch_depth', 1)} chunk(s) ahead)"
        lag = device_lag(r.get("timeline") or [])
        if lag:
            line += (f"; forward {lag['device_forward'] * 1e3:.0f} ms on the device ({lag['host_forward'] * 1e3:.0f} on "
                     f"the host), backward {lag['device_backward'] * 1e3:.0f} ms ({lag['host_backward'] * 1e3:.0f}), "
                     f"the device {lag['behind_at_step'] * 1e3:.0f} ms behind the host at step() (medians; near 0: "
                     f"the device waited for the host)")
        stalls = load_stalls(r.get("timeline") or [])
        if stalls:
            line += (f"; the compute stream stalled {stalls['forward_stall'] * 1e3:.0f} ms for chunk loads in the "
                     f"forward and {stalls['backward_stall'] * 1e3:.0f} ms in backward, beside "
                     f"{stalls['forward_loads'] * 1e3:.0f} and {stalls['backward_loads'] * 1e3:.0f} ms of loads "
                     f"(medians)")
        critical = next((n for n in (r.get("plan") or {}).get("notes", []) if n.startswith("critical path:")), None)
        if critical:  # the model's forward, waits and backward, beside the measured ones before it
            line += f"; the plan's {critical}"
        allocator = r.get("allocator") or {}
        if allocator:
            line += ("; per step the allocator made " + ", ".join(f"{v:g} {k.replace('num_', '').replace('_', ' ')}"
                                                               for k, v in allocator.items()))
        profile = r.get("host_profile") or []
        if profile:
            line += "; one profiled step: " + ", ".join(
                f"{name} {ms:.1f} ms" + (f" ({calls})" if name != "step" else "") for name, calls, ms in profile[:9])
        out.append(f"- {line}")
    return out


def device_lag(timeline: list) -> dict:
    """From a run's timeline with the device's marks (CUDA): per measured step, how long forward
    (step start to backward) and backward (to step()) took on the host and on the device, and how
    far the device trailed the host when the host called step(); medians. A device that trails by
    little and takes as long as the host was fed no faster than the host's Python ran (hooks, the
    pool's waits): there the host is the bottleneck, not the kernels. {} without device marks."""
    host = [_mark_times(timeline, c) for c in ("step start", "backward", "step")]
    device = [_mark_times(timeline, "device " + c) for c in ("step start", "backward", "step")]
    n = min(len(x) for x in host + device)
    if n == 0:
        return {}
    return {"steps": n,
            "host_forward": _median([host[1][i] - host[0][i] for i in range(n)]),
            "host_backward": _median([host[2][i] - host[1][i] for i in range(n)]),
            "device_forward": _median([device[1][i] - device[0][i] for i in range(n)]),
            "device_backward": _median([device[2][i] - device[1][i] for i in range(n)]),
            "behind_at_step": _median([device[2][i] - host[2][i] for i in range(n)])}


def step_interval(timeline: list) -> Optional[float]:
    """Mean seconds between the device's marks at the timed steps' starts (CUDA), from the second
    step's: an estimate of a long run's step, free of the window's ends (the last step's CPU updates
    after it; in results timed after a synced warm-up, a first step with fewer updates pending than
    any later one). None with fewer than three marks."""
    starts = _mark_times(timeline, "device step start")
    return float(np.mean(np.diff(starts[1:]))) if len(starts) >= 3 else None


def _mark_times(timeline: list, category: str) -> list:
    return [a for c, a, _, _, _ in timeline if c == category]


def _median(values) -> float:
    return float(np.median(values))


def load_stalls(timeline: list) -> dict:
    """From a run's timeline with the chunk stores' device marks (CUDA): per measured step, how
    long the compute stream stalled for chunk loads ("device load wait" to "device load waited",
    per chunk) and how long loads ran on their streams ("device load" to "device load done"), each
    in the forward (step start to backward) and in backward (to step()); medians over steps. A
    forward longer on the device than its compute says it waited: for loads here, or for the host
    (`device_lag`). Stalls between step() and the next step's start (the optimizer's own) are in
    neither. {} without such marks."""
    def spans(opening, closing):
        open_at, out = {}, []
        for c, a, _, chunk, _ in timeline:
            if c == opening:
                open_at[chunk] = a
            elif c == closing and chunk in open_at:
                out.append((open_at.pop(chunk), a))
        return out

    starts, backwards, ends = (_mark_times(timeline, "device " + c) for c in ("step start", "backward", "step"))
    stalls, loads = spans("device load wait", "device load waited"), spans("device load", "device load done")
    n = min(len(starts), len(backwards), len(ends))
    if n == 0 or not stalls:
        return {}

    def within(group, lo, hi):  # by when each span ends
        return sum(b - a for a, b in group if lo <= b < hi)

    return {"steps": n,
            "forward_stall": _median([within(stalls, starts[i], backwards[i]) for i in range(n)]),
            "backward_stall": _median([within(stalls, backwards[i], ends[i]) for i in range(n)]),
            "forward_loads": _median([within(loads, starts[i], backwards[i]) for i in range(n)]),
            "backward_loads": _median([within(loads, backwards[i], ends[i]) for i in range(n)])}


def update_job_rates(timeline: list) -> dict:
    """Parameters per second of the background CPU updates on a run's timeline (systems.timeline_events):
    the median over updates, and the rates (elements over seconds) of the updates that overlapped a
    wait of the training thread for one against those that did not. {} without updates. A slow
    update while the training thread only waits points at the update itself; slow only beside a
    busy training thread, at what that thread does."""
    jobs = [(a, b, n) for c, a, b, _, n in timeline if c == "cpu_adam" and b > a and n > 0]
    if not jobs:
        return {}
    waits = [(a, b) for c, a, b, _, _ in timeline if c == "cpu_adam_wait"]

    def waited(a, b):  # at least half the update's time inside waits
        return 2 * sum(max(0.0, min(b, wb) - max(a, wa)) for wa, wb in waits) >= b - a

    def rate(group):
        seconds = sum(b - a for a, b, _ in group)
        return sum(n for _, _, n in group) / seconds if seconds > 0 else 0.0

    during = [j for j in jobs if waited(j[0], j[1])]
    busy = [j for j in jobs if not waited(j[0], j[1])]
    return {"median": float(np.median([n / (b - a) for a, b, n in jobs])), "while_waited": rate(during),
            "while_busy": rate(busy), "updates": len(jobs)}


def cpu_adam_rates(r: dict):
    """(measured, planned) parameters per second of the CPU AdamW of one run's host chunks: the
    parameters the background thread updates per step (host chunks, less every dos_gap-th one,
    which the device updates), over the background seconds the breakdown measured and over the
    plan's "CPU AdamW" seconds. None without both. The rate a plan assumes comes from a short
    measurement with nothing else running; set beside the rate beside training, it says whether a
    step's wait on the CPU is a slow kernel or a wrong rate."""
    plan, seconds = r.get("plan") or {}, (r.get("background") or {}).get("cpu_adam")
    planned = (plan.get("time") or {}).get("CPU AdamW")
    if not seconds or not planned or not plan.get("chunk_numels"):
        return None
    host = np.array([p == "host" for p in plan["placements"]])
    params = int(np.array(plan["chunk_numels"])[host & ~dos_mask(host, plan.get("dos_gap", 0))].sum())
    return (params / seconds, params / planned) if params else None


def _categories(results: list[dict]) -> list[str]:
    seen = [k for r in results if r.get("breakdown") for k in r["breakdown"]]
    return [k for k in BREAKDOWN_ORDER if k in seen] + [k for k in dict.fromkeys(seen) if k not in BREAKDOWN_ORDER]


def breakdown_table(results: list[dict]) -> str:
    """Seconds per step by category, for the systems that report one (elixir_ray); "" if none do."""
    rows = [r for r in results if r.get("breakdown") and not r.get("skipped")]
    if not rows:
        return ""
    cats = _categories(rows)
    background = list(dict.fromkeys(k for r in rows for k in r.get("background") or {}))
    lines = ["Where a step's time goes, in milliseconds per step (mean of extra steps timed with device syncs, "
             "which can make them slower than the steps above; compute_and_waits is the untimed remainder). "
             "Background columns are work on another thread that overlaps the rest, so they are not part of "
             "the sum; cpu_adam_wait is what the CPU AdamW failed to hide:", "",
             "| system | timed step (ms) | " + " | ".join(cats) + " | " + " | ".join(f"{k} (background)" for k in background) + " |",
             "|---|---|" + "---|" * (len(cats) + len(background))]
    for r in rows:
        total = r.get("breakdown_step_seconds") or sum(r["breakdown"].values())
        cells = []
        for k in cats:
            v = r["breakdown"].get(k, 0.0)
            cells.append(f"{v * 1e3:.1f} ({v / total:.0%})" if total > 0 else f"{v * 1e3:.1f}")
        cells += [f"{(r.get('background') or {}).get(k, 0.0) * 1e3:.1f}" for k in background]
        lines.append(f"| {label(r)} | {total * 1e3:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# how close a system's final loss must come to the reference's to count as the same training
# (the mean of the last LOSS_TAIL steps', so one batch's noise does not decide it)
LOSS_TOLERANCE = 0.01
LOSS_TAIL = 10


def final_loss_lines(results: list[dict]) -> list[str]:
    """Per system beside the reference, over the same batches: its final loss (the mean of the last
    LOSS_TAIL steps) against the reference's, and whether it is within LOSS_TOLERANCE of it. Only
    where both recorded every step's loss over at least LOSS_TAIL steps."""
    ref = next((r for r in results if r["system"] == "reference" and len(r.get("losses") or []) >= LOSS_TAIL), None)
    if ref is None:
        return []
    base = sum(ref["losses"][-LOSS_TAIL:]) / LOSS_TAIL
    out = []
    for r in results:
        own = r.get("losses") or []
        if r is ref or r.get("skipped") or len(own) != len(ref["losses"]):
            continue
        tail = sum(own[-LOSS_TAIL:]) / LOSS_TAIL
        apart = abs(tail - base) / base
        verdict = "within" if apart <= LOSS_TOLERANCE else "NOT within"
        out.append(f"{label(r)}: final loss {tail:.4f} over the last {LOSS_TAIL} of {len(own)} steps against the "
                   f"reference's {base:.4f}, {apart:.2%} apart ({verdict} {LOSS_TOLERANCE:.0%})")
    return out


def write_loss_chart(results: list[dict], path: str, title: str) -> None:
    """Every system's loss at each step, warm-up and timed, on one chart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in results:
        if not r.get("skipped") and r.get("losses"):
            ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=label(r), linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{title}: loss per step" + (f" ({results[0].get('data')})" if results and results[0].get("data") else ""))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_chart(results: list[dict], path: str, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("the benchmark chart needs matplotlib: pip install matplotlib (a dependency of elixir_ray)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if not r.get("skipped")]
    split = [r for r in done if r.get("breakdown")]
    fig, axes = plt.subplots(1, 3 if split else 2, figsize=(16 if split else 11, 4))
    ax1, ax2 = axes[0], axes[1]
    names = [label(r) for r in done]
    ax1.bar(names, [r["tokens_per_s"] for r in done], color="#4472c4")
    ax1.set_ylabel("tokens/s")
    ax1.set_title("throughput")
    xs = list(range(len(done)))
    ax2.bar([x - 0.2 for x in xs], [r["peak_device_bytes"] / 2**30 for r in done], width=0.4,
            color="#ed7d31", label="device")
    ax2.bar([x + 0.2 for x in xs], [r["peak_host_bytes"] / 2**30 for r in done], width=0.4,
            color="#a5a5a5", label="host")
    ax2.set_xticks(xs, names)
    ax2.set_ylabel("GiB")
    ax2.set_title("peak memory")
    ax2.set_ylim(0, max([r[k] / 2**30 for r in done for k in ("peak_device_bytes", "peak_host_bytes")], default=1) * 1.25)
    ax2.legend(loc="upper center", ncol=2, fontsize=8)  # in the room above the bars, over none of them
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=20)
    if split:
        _breakdown_bars(axes[2], split)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _breakdown_bars(ax, rows: list[dict]) -> None:
    """One stacked bar per system: its timed step split into the breakdown's categories."""
    names = [label(r) for r in rows]
    bottom = [0.0] * len(rows)
    for k in _categories(rows):
        values = [r["breakdown"].get(k, 0.0) for r in rows]
        ax.bar(names, values, bottom=bottom, color=BREAKDOWN_COLORS.get(k), label=k, width=0.5)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xlim(-1, len(rows))  # a single system's bar stays bar-sized
    ax.set_ylabel("seconds per timed step")
    ax.set_title("step breakdown")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def write_report(results: list[dict], out_dir: str, title: str) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "bench.json"), "markdown": os.path.join(out_dir, "bench.md"),
             "png": os.path.join(out_dir, "bench.png")}
    if any(len(r.get("losses") or []) > 1 for r in results):
        paths["loss_png"] = os.path.join(out_dir, "bench-loss.png")
        write_loss_chart(results, paths["loss_png"], title)
    with open(paths["json"], "w") as f:
        json.dump({"title": title, "results": results}, f, indent=1)
    with open(paths["markdown"], "w") as f:
        f.write(f"## {title}\n\n{markdown_table(results)}\n")
    write_chart(results, paths["png"], title)
    return paths
