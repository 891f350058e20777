"""The planner's compute prediction against a measured plain forward and backward, per GPT shape.

    python jobs/bench_compute.py                       # GPU: gpt-1.5b and gpt-4b in bf16; CPU: small fp32 shapes
    python jobs/bench_compute.py --shapes gpt-4b --out runs/bench_compute.json
    python jobs/bench_compute.py --smoke               # the tiny shape, for tests
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from elixir_ray.bench.compute import default_shapes, markdown, measure_shape  # noqa: E402
from elixir_ray.bench.systems import SHAPES  # noqa: E402
from elixir_ray.planner.hardware import profile_hardware  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), help="default: by device")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per shape (median reported); default 5, 2 with --smoke")
    parser.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU (--shapes is ignored)")
    parser.add_argument("--out", default="runs/bench_compute.json")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    hw = profile_hardware(device)
    shapes = [SHAPES["smoke"]] if args.smoke else (
        [SHAPES[s] for s in args.shapes] if args.shapes else default_shapes(device))
    rows = []
    for i, shape in enumerate(shapes):
        print(f"[{i + 1}/{len(shapes)}] {shape.name} on {device}", flush=True)
        rows.append(measure_shape(shape, hw, steps=args.steps if args.steps is not None else (2 if args.smoke else 5)))
    print(f"matmul rate measured here: {hw.matmul_tflops:.2f} TFLOPS")
    print(markdown(rows))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"hardware": json.loads(hw.to_json()), "rows": [r.to_dict() for r in rows]}, f, indent=1)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
