"""Measure one system in a fresh process (so peak memory and CUDA state are its own); writes JSON."""

import argparse
import os
import sys
import traceback

import torch

from elixir_ray.bench.run import write_json  # under a temporary name first: never half a file
from elixir_ray.bench.systems import SHAPES, SYSTEMS, run_system


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--system", choices=SYSTEMS, required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--cap-bytes", type=int, default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", required=True)
    parser.add_argument("--plan", help="elixir_ray only: a Plan JSON file to run instead of searching one")
    parser.add_argument("--memory-margin", type=float, default=None,
                        help="elixir_ray only: the share of the cap its plan search keeps back")
    parser.add_argument("--data", default=None, help="a token dataset for the batches (default: random tokens)")
    parser.add_argument("--max-grad-norm", type=float, default=None, help="every system's gradient clipping")
    parser.add_argument("--fsdp2-pageable", action="store_true",
                        help="fsdp2_offload only: offload to pageable host memory instead of pinned")
    args = parser.parse_args()
    plan = None
    if args.plan:
        from elixir_ray.chunk_plan.plan import Plan

        with open(args.plan) as f:
            plan = Plan.from_json(f.read())
    alloc_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")  # the caching allocator's settings, in every result

    def keep(partial) -> None:  # the figures so far, in case the process dies in the steps after
        write_json(args.out, {**partial.to_dict(), "alloc_conf": alloc_conf})

    try:
        result = run_system(args.system, SHAPES[args.shape], torch.device(args.device), args.cap_bytes,
                            steps=args.steps, warmup=args.warmup, plan=plan, keep=keep,
                            memory_margin=args.memory_margin,
                            fsdp2_pin_memory=not args.fsdp2_pageable,
                            max_grad_norm=args.max_grad_norm, data=args.data).to_dict()
    except ImportError as exc:
        result = {"system": args.system, "shape": args.shape, "skipped": f"not importable: {exc}"}
    except Exception as exc:  # an OOM or a peer's crash is a result to report, not a harness failure
        traceback.print_exc()
        result = {"system": args.system, "shape": args.shape, "skipped": f"failed: {type(exc).__name__}: {exc}"[:500]}
    result["alloc_conf"] = alloc_conf
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
