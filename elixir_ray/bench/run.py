"""Run every system on one shape, each in its own process, and write the report.

The reference (plain PyTorch) runs uncapped; every other system runs under the same device
memory cap, or once under each of several. `smoke` is a tiny CPU shape for the test suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Optional

from elixir_ray import storage
from elixir_ray.bench.report import add_ratios, device_peak, label, markdown_table, write_report
from elixir_ray.bench.systems import SHAPES, SYSTEMS
from elixir_ray.config import OptimConfig
from elixir_ray.engine.allocator import MARGIN_CACHING, MARGIN_EXPANDABLE, SETTING
from elixir_ray.planner.search import check_margin
from elixir_ray.units import format_bytes

# what every system trains with unless the command says otherwise: the run config's defaults (its
# gradient clipping, the allocator's expandable segments elixir_ray turns on), and enough timed
# steps for a median and a spread
STEPS = 20
MAX_GRAD_NORM = OptimConfig.max_grad_norm
ALLOC_CONF = f"{SETTING}:True"


def run_bench(shape: str, caps, systems: list[str], out_dir: str, steps: int = STEPS,
              warmup: int = 3, device: Optional[str] = None, progress=print,
              memory_margin: Optional[float] = None, alloc_conf: Optional[str] = ALLOC_CONF,
              fsdp2_pageable: bool = False,
              max_grad_norm: Optional[float] = MAX_GRAD_NORM, data: Optional[str] = None) -> tuple[list[dict], dict]:
    """`caps`: one cap in bytes (or None), or a list of them. The reference runs once, uncapped;
    every other system once per cap, in the caps' order. With several caps each capped result is
    kept as SYSTEM-CAP.json (e.g. elixir_ray-24GiB.json) and named with its cap in the report.
    `memory_margin`: elixir_ray's plan search keeps this share of the cap back (default: the
    planner's for the device); `alloc_conf`: PYTORCH_CUDA_ALLOC_CONF for every system's process
    alike (default: expandable segments, as elixir_ray trains; None: this environment's);
    `max_grad_norm`: every system clips its gradients' global norm to it (default: the run
    config's, 1.0; None: no clipping); `data`: a token dataset (or "builtin") every system's
    batches come from, instead of random tokens;
    `fsdp2_pageable`: FSDP2 offloads to pageable host memory (blocking gradient copies) instead of
    its default, pinned (`systems._build`)."""
    caps = list(caps) if isinstance(caps, (list, tuple)) else [caps]
    if memory_margin is not None:
        check_margin(memory_margin)  # before the reference's minutes
        if "elixir_ray" not in systems:
            progress(f"note: --memory-margin {memory_margin} applies to elixir_ray only, which is not among the systems")
    if fsdp2_pageable and "fsdp2_offload" not in systems:
        progress("note: --fsdp2-pageable applies to fsdp2_offload only, which is not among the systems")
    several = len(caps) > 1
    runs = [("reference", None)] if "reference" in systems else []  # first: the ratios' base
    runs += [(system, cap) for cap in caps for system in systems if system != "reference"]
    results = []
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for i, (system, cap_bytes) in enumerate(runs):
            name = system + (f"-{_cap_name(cap_bytes)}" if several and cap_bytes else "")
            progress(f"[{i + 1}/{len(runs)}] {system} on {shape}" +
                     (f" capped at {format_bytes(cap_bytes)}" if cap_bytes else ""))
            out = os.path.join(tmp, f"{name}.json")
            cmd = [sys.executable, "-m", "elixir_ray.bench.one_system", "--system", system, "--shape", shape,
                   "--steps", str(steps), "--warmup", str(warmup), "--out", out]
            if cap_bytes:
                cmd += ["--cap-bytes", str(cap_bytes)]
            if device:
                cmd += ["--device", device]
            if memory_margin is not None and system == "elixir_ray":
                cmd += ["--memory-margin", str(memory_margin)]
            if fsdp2_pageable and system == "fsdp2_offload":
                cmd += ["--fsdp2-pageable"]
            if max_grad_norm is not None:
                cmd += ["--max-grad-norm", str(max_grad_norm)]
            if data is not None:
                cmd += ["--data", data]
            env = {"PYTORCH_CUDA_ALLOC_CONF": alloc_conf} if alloc_conf is not None else {}
            code, tail = run_logged(cmd, os.path.join(out_dir, f"{name}.log"), env=env)
            if os.path.exists(out):
                with open(out) as f:
                    results.append(json.load(f))
            else:
                results.append({"system": system, "shape": shape, "cap_bytes": cap_bytes,
                                "skipped": f"process exited {code}: {tail}"})
            if system == "fsdp2_offload" and device != "cpu":  # on a GPU (only --smoke runs on the CPU), failed or not
                results[-1]["fsdp2_pinned"] = not fsdp2_pageable
            if several and cap_bytes:
                results[-1]["label"] = f"{system} at {format_bytes(cap_bytes)}"
            # each result is kept as it comes: a run stopped later (a time limit) loses only what was running
            write_json(os.path.join(out_dir, f"{name}.json"), results[-1])
            progress(f"    {_one_line(results[-1])}")
    add_ratios(results)
    capped = [format_bytes(c) for c in caps if c]
    title = f"{shape}: tokens/s and peak memory" + (f", cap {', '.join(capped)}" if capped else "")
    paths = write_report(results, out_dir, title)
    return results, paths


def _prepared(data: Optional[str]) -> Optional[str]:
    """--data as every system's process reads it: "builtin" is prepared once here, first (each
    process would otherwise race to write the same cache file); a missing path is refused now."""
    if data is None:
        return None
    from elixir_ray.data.dataset import TokenDataset, resolve_data_uri

    uri = resolve_data_uri(data, None)
    TokenDataset(uri, what="--data")  # a ConfigError naming it, before the reference's minutes
    return uri


def _cap_name(cap_bytes: int) -> str:
    """A cap in a file name: 24GiB, 1.5GiB, 512MiB."""
    return format_bytes(cap_bytes).replace(" ", "").replace(".0", "")


def write_json(path: str, data) -> None:
    storage.write_bytes_atomic(*storage.resolve(path), json.dumps(data, indent=1).encode())


def _one_line(r: dict) -> str:
    """A system's result in one line of the progress output (and so in a stage's log)."""
    if r.get("skipped"):
        return f"{label(r)}: skipped: {r['skipped'][:200]}"
    return (f"{label(r)}: {r['step_seconds']:.3f} s/step, {r['tokens_per_s']:,.0f} tokens/s, "
            f"{r['tflops']:.3g} TFLOPS, peak device {device_peak(r)}, "
            f"peak host {format_bytes(r.get('peak_host_bytes') or 0)}")


def run_logged(cmd: list[str], path: str, title: str = "", env: Optional[dict] = None) -> tuple[int, str]:
    """Run a measured process with its whole output going into `path` as it comes (a failure's
    traceback is there, and so is what a process stopped midway had printed); returns its exit
    status and the output's last 300 characters."""
    with open(path, "w") as log:
        log.write((f"# {title}\n" if title else "") + f"$ {' '.join(cmd)}\n")
        log.flush()
        start = log.tell()
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}).returncode
    with open(path, errors="replace") as log:
        log.seek(start)
        tail = log.read()[-300:].strip()
    with open(path, "a") as log:
        log.write(f"\n# exit {code}\n")
    return code, tail


def main_args(args) -> int:
    import torch

    from elixir_ray.errors import ConfigError
    from elixir_ray.units import parse_bytes

    shape = "smoke" if args.smoke else args.shape
    try:
        caps = [parse_bytes(c) for c in args.cap] if args.cap else [None]
    except ValueError as exc:
        raise ConfigError(f"--cap: {exc}") from None
    if len(caps) > 1 and (not all(caps) or len({_cap_name(c) for c in caps}) != len(caps)):
        raise ConfigError(f"--cap: each cap once, and none 0 (they name the results' files), got {' '.join(args.cap)}")
    if shape != "smoke" and not torch.cuda.is_available():
        raise ConfigError(f"no CUDA device here, and the {shape} shape is a GPU benchmark (building it would take "
                          f"tens of GiB of host RAM): run it on a GPU machine, or --smoke for the tiny CPU shape")
    systems = args.systems or list(SYSTEMS)
    steps = args.steps if args.steps is not None else (2 if args.smoke else STEPS)
    warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 3)
    results, paths = run_bench(shape, caps, systems, args.out, steps=steps, warmup=warmup,
                               device="cpu" if args.smoke else None, memory_margin=args.memory_margin,
                               alloc_conf=args.alloc_conf or None, fsdp2_pageable=args.fsdp2_pageable,
                               max_grad_norm=None if args.max_grad_norm == 0 else args.max_grad_norm,
                               data=_prepared(args.data))
    print(markdown_table(results))
    charts = paths["png"] + (f", {paths['loss_png']}" if "loss_png" in paths else "")
    print(f"\nwrote {paths['json']}, {paths['markdown']}, {charts} and each system's output "
          f"({os.path.join(args.out, 'SYSTEM.log')})")
    failed = [r["system"] for r in results if str(r.get("skipped", "")).startswith(("failed", "process exited"))]
    if failed or all(r.get("skipped") for r in results):  # a peer that is not installed is only skipped
        print(f"elixir-ray: error: {', '.join(failed) or 'no system'} did not run to the end (see "
              f"{os.path.join(args.out, 'SYSTEM.log')})", file=sys.stderr)
        return 1
    return 0


def fraction(text: str) -> float:
    """An argparse type: a fraction in [0, 1) (a memory margin)."""
    import argparse

    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"a fraction in [0, 1), got {text!r}")
    return value


def add_arguments(p) -> None:
    from elixir_ray.cli import at_least

    p.add_argument("--shape", choices=sorted(SHAPES), default="gpt-4b", help="model shape (default: gpt-4b; needs a GPU)")
    p.add_argument("--cap", nargs="+", default=None,
                   help="device memory cap for all but the reference, e.g. 24GiB; several (40GiB 24GiB) run each "
                        "capped system once per cap beside one reference, which runs first (default: none)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, help="default: all")
    p.add_argument("--steps", type=at_least(1), default=None,
                   help=f"timed steps, run back to back, a new batch each, the median reported with the spread; "
                        f"default {STEPS}, 2 with --smoke")
    p.add_argument("--warmup", type=at_least(0), default=None,
                   help="untimed steps first, run back to back as the timed ones are; default 3, 1 with --smoke")
    p.add_argument("--smoke", action="store_true", help="a tiny shape on CPU, for tests (--shape is ignored)")
    p.add_argument("--memory-margin", type=fraction, default=None,
                   help=f"elixir_ray's plan search keeps this fraction of the cap back for the allocator "
                        f"(default: {MARGIN_EXPANDABLE} with expandable segments, else {MARGIN_CACHING})")
    p.add_argument("--alloc-conf", default=ALLOC_CONF,
                   help=f"PYTORCH_CUDA_ALLOC_CONF for every system's process alike (default: {ALLOC_CONF}, as "
                        f"elixir_ray trains; '' for this environment's); each result records it")
    p.add_argument("--max-grad-norm", type=float, default=MAX_GRAD_NORM,
                   help=f"every system clips its gradients' global norm to this before each update (default: "
                        f"the run config's optim.max_grad_norm, {MAX_GRAD_NORM}; 0: no clipping)")
    p.add_argument("--data", default=None,
                   help="a token dataset (elixir-ray prepare-data) or 'builtin' (this Python's standard library "
                        "as bytes): every system trains on its windows, in the same order, instead of random tokens")
    p.add_argument("--fsdp2-pageable", action="store_true",
                   help="FSDP2 offload to pageable host memory, its gradients copied down in blocking copies, "
                        "instead of pinned memory and asynchronous copies (FSDP2's default)")
    p.add_argument("--out", default="runs/bench", help="directory for bench.json, bench.md, bench.png and each "
                                                       "system's output, SYSTEM.log (default: runs/bench)")
