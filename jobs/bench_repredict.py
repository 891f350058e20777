"""The peak memory this version predicts for plans measured earlier: `python jobs/bench_repredict.py
RESULT.json...`, each an `elixir_ray.json` written by `elixir-ray bench` (its plan, shape and
measured peak). Each plan's model is traced on the meta device (no weights, a few seconds) and its
placement costed with `elixir_ray.planner.search.plan_memory`, so a change to the memory model is
checked against every GPU measurement already made, without a GPU."""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from elixir_ray.bench.systems import SHAPES  # noqa: E402
from elixir_ray.engine.plan import Plan  # noqa: E402
from elixir_ray.model.gpt import build_gpt  # noqa: E402
from elixir_ray.planner.model_profile import profile_model  # noqa: E402
from elixir_ray.planner.search import plan_memory  # noqa: E402
from elixir_ray.units import format_bytes  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="elixir_ray.json files from elixir-ray bench")
    args = parser.parse_args()
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
    for result in results:
        shape, plan = SHAPES[result["shape"]], Plan.from_dict(result["plan"])
        model = build_gpt(shape.model_shape(), shape.activation_checkpointing, device="meta")
        sample = torch.randint(0, shape.vocab_size, (shape.micro_batch, shape.seq_len + 1))
        dtype = getattr(torch, plan.dtype)
        profile = profile_model(model, (sample,), None, plan.activation_checkpointing, dtype)
        parts = plan_memory(plan, profile, torch.empty(0, dtype=dtype).element_size())
        now, measured, then = sum(parts.values()), result["peak_device_bytes"], result["predicted_peak_bytes"]
        largest = ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v)
        print(f"| {shape.name} | {format_bytes(result['cap_bytes'])} | {format_bytes(measured)} | "
              f"{format_bytes(then)} ({then / measured:.2f}x) | {format_bytes(now)} ({now / measured:.2f}x) | {largest} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
