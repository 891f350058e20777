"""Run every system on one shape, each in its own process, and write the report.

The reference (plain PyTorch) runs uncapped; every other system runs under the same device
memory cap. `smoke` is a tiny CPU shape for the test suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Optional

from elixir_ray.bench.report import add_ratios, markdown_table, write_report
from elixir_ray.bench.systems import SHAPES, SYSTEMS


def run_bench(shape: str, cap_bytes: Optional[int], systems: list[str], out_dir: str, steps: int = 6,
              warmup: int = 2, device: Optional[str] = None, progress=print) -> tuple[list[dict], dict]:
    results = []
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for i, system in enumerate(systems):
            progress(f"[{i + 1}/{len(systems)}] {system} on {shape}" +
                     (f" capped at {cap_bytes / 2**30:.1f} GiB" if cap_bytes and system != "reference" else ""))
            out = os.path.join(tmp, f"{system}.json")
            cmd = [sys.executable, "-m", "elixir_ray.bench.one_system", "--system", system, "--shape", shape,
                   "--steps", str(steps), "--warmup", str(warmup), "--out", out]
            if cap_bytes and system != "reference":
                cmd += ["--cap-bytes", str(cap_bytes)]
            if device:
                cmd += ["--device", device]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            write_run_log(os.path.join(out_dir, f"{system}.log"), cmd, proc)
            if os.path.exists(out):
                with open(out) as f:
                    results.append(json.load(f))
            else:
                results.append({"system": system, "shape": shape,
                                "skipped": f"process exited {proc.returncode}: {proc.stderr.strip()[-300:]}"})
    add_ratios(results)
    title = f"{shape}: tokens/s and peak memory" + (f", cap {cap_bytes / 2**30:.0f} GiB" if cap_bytes else "")
    paths = write_report(results, out_dir, title)
    return results, paths


def write_run_log(path: str, cmd: list[str], proc: subprocess.CompletedProcess, title: str = "") -> None:
    """A measured process's whole output beside the report: a failure's traceback is there."""
    with open(path, "w") as f:
        f.write((f"# {title}\n" if title else "") +
                f"$ {' '.join(cmd)}\n# exit {proc.returncode}\n{proc.stdout}{proc.stderr}")


def main_args(args) -> int:
    from elixir_ray.units import parse_bytes

    shape = "smoke" if args.smoke else args.shape
    cap = parse_bytes(args.cap) if args.cap else None
    systems = args.systems or list(SYSTEMS)
    steps = args.steps if args.steps is not None else (2 if args.smoke else 6)
    warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 2)
    results, paths = run_bench(shape, cap, systems, args.out, steps=steps, warmup=warmup,
                               device="cpu" if args.smoke else None)
    print(markdown_table(results))
    print(f"\nwrote {paths['json']}, {paths['markdown']}, {paths['png']} and each system's output "
          f"({os.path.join(args.out, 'SYSTEM.log')})")
    return 0


def add_arguments(p) -> None:
    p.add_argument("--shape", choices=sorted(SHAPES), default="gpt-4b")
    p.add_argument("--cap", default=None, help="device memory cap for all but the reference, e.g. 24GiB")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, help="default: all")
    p.add_argument("--steps", type=int, default=None, help="timed steps (median reported); default 6, 2 with --smoke")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first; default 2, 1 with --smoke")
    p.add_argument("--smoke", action="store_true", help="a tiny shape on CPU, for tests (--shape is ignored)")
    p.add_argument("--out", default="runs/bench", help="directory for bench.json, bench.md, bench.png and each system's output (SYSTEM.log)")
