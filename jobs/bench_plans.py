"""Searched plan vs hand-made recipes, measured: the planner issue's comparison table.

    python jobs/bench_plans.py --shape gpt-4b --cap 24GiB [--hardware hw.json] [--out runs/bench_plans.json]
    python jobs/bench_plans.py --smoke        # a tiny shape on CPU

Rates are measured on this machine unless --hardware gives a file (`elixir-ray plan --save-hardware`).
Each plan's run writes its whole output to plan-N.log beside the --out file.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from elixir_ray.bench.plans import plan_table_markdown, run_plan_table  # noqa: E402
from elixir_ray.bench.run import fraction  # noqa: E402
from elixir_ray.planner.search import SAFETY  # noqa: E402
from elixir_ray.cli import at_least  # noqa: E402
from elixir_ray.bench.systems import SHAPES  # noqa: E402
from elixir_ray.planner.hardware import HardwareProfile, profile_hardware  # noqa: E402
from elixir_ray.units import parse_bytes  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gpt-4b")
    parser.add_argument("--cap", default="24GiB", help="device memory budget for every plan")
    parser.add_argument("--hardware", help="HardwareProfile JSON (default: measure here)")
    parser.add_argument("--steps", type=at_least(1), default=None, help="timed steps per plan; default 4, 2 with --smoke")
    parser.add_argument("--smoke", action="store_true",
                        help="the tiny shape on CPU with a 24 MiB cap (--shape and --cap are ignored)")
    parser.add_argument("--memory-margin", type=fraction, default=SAFETY,
                        help=f"the share of the cap every plan keeps back for the allocator (default {SAFETY})")
    parser.add_argument("--out", default="runs/bench_plans.json")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        parser.error(f"no CUDA device here, and the {args.shape} shape is a GPU benchmark: run it on a GPU machine, "
                     f"or --smoke for the tiny CPU shape")
    shape, cap = ("smoke", parse_bytes("24MiB")) if args.smoke else (args.shape, parse_bytes(args.cap))
    if args.hardware:
        with open(args.hardware) as f:
            hw = HardwareProfile.from_json(f.read())
    else:
        hw = profile_hardware("cpu" if args.smoke else None)
    steps = args.steps if args.steps is not None else (2 if args.smoke else 4)
    rows = run_plan_table(shape, cap, hw, steps=steps, warmup=1 if args.smoke else 2,
                          device="cpu" if args.smoke else None, log_dir=os.path.dirname(os.path.abspath(args.out)),
                          memory_margin=args.memory_margin)
    print(plan_table_markdown(rows))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"shape": shape, "cap_bytes": cap, "hardware": json.loads(hw.to_json()), "rows": rows}, f, indent=1)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")
    failed = [r["plan"] for r in rows if r.get("skipped")]
    if failed:
        print(f"error: {', '.join(failed)} did not run to the end (see plan-N.log beside {args.out})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
