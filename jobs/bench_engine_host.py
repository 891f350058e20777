"""The engine's host time against plain PyTorch, with a plan measured on the GPU: `python
jobs/bench_engine_host.py [RESULT.json]`.

RESULT.json is an `elixir_ray.json` (or `elixir_ray-CAP.json`) of `elixir-ray bench` for a GPT
shape (default: tests/data/h100/2026-11-27-c/call3/gpt-1.5b-caps/elixir_ray-24GiB.json, gpt-1.5b at
24 GiB on one H100, 2026-11-27). The same GPT, its blocks as many but
`--width` wide (tiny, so that a step on the CPU is host work: the Python and the dispatch that
bound gpt-1.5b's capped steps on the H100), runs through the engine with that plan's layout
(its parameter order, chunks scaled to the smaller model, placements, pool blocks, Deep Optimizer
States gap and activation checkpointing) beside plain PyTorch with the same checkpointing, the
two interleaved step by step, one thread. Prints the fastest and median thread time of forward
and backward (the optimizer steps are not timed; the engine's device chunks update in backward,
so its backward holds their AdamW).
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from elixir_ray import wrap  # noqa: E402
from elixir_ray.bench.systems import SHAPES, reference_parameters  # noqa: E402
from elixir_ray.chunk_plan.layout import pack  # noqa: E402
from elixir_ray.chunk_plan.plan import Plan  # noqa: E402
from elixir_ray.engine.trace import unique_parameters  # noqa: E402
from elixir_ray.model.gpt import build_gpt, init_gpt_weights  # noqa: E402

DEFAULT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data", "h100",
                       "2026-11-27-c", "call3", "gpt-1.5b-caps", "elixir_ray-24GiB.json")


def small_plan(measured: Plan, model: torch.nn.Module, full_params: int) -> Plan:
    """The measured plan's layout for the small model: chunk size scaled by the parameter counts,
    then grown until the parameters pack into no more chunks than the plan placed."""
    named = dict(unique_parameters(model))
    numels = [named[n].numel() for n in measured.param_order]
    size = -(-sum(numels) * measured.chunk_size // full_params)
    while len(pack(numels, size, 1)[1]) > len(measured.placements):
        size = int(size * 1.02) + 1
    n_chunks = len(pack(numels, size, 1)[1])
    return Plan(chunk_size=size, n_blocks=min(measured.n_blocks, n_chunks), param_order=measured.param_order,
                placements=measured.placements[:n_chunks], sharded=[False] * n_chunks, dos_gap=measured.dos_gap,
                activation_checkpointing=measured.activation_checkpointing, dtype="float32", grad_accum=1,
                updates_in_backward=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result", nargs="?", default=DEFAULT, help="an elixir_ray result of `elixir-ray bench`")
    parser.add_argument("--width", type=int, default=50, help="model width (default 50)")
    parser.add_argument("--steps", type=int, default=22, help="timed steps of each (default 22)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    args = parser.parse_args(argv)
    try:
        with open(args.result) as f:
            result = json.load(f)
        measured, shape = Plan.from_dict(result["plan"]), SHAPES[result["shape"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        parser.error(f"{args.result} is not an elixir_ray result of `elixir-ray bench` with a plan and a GPT "
                     f"shape ({type(exc).__name__}: {exc})")
    if args.width < 2 or args.steps < 1 or args.warmup < 0:
        parser.error("--width must be at least 2, --steps at least 1, --warmup at least 0")
    torch.set_num_threads(1)
    heads = next(h for h in range(min(shape.n_heads, args.width), 0, -1) if args.width % h == 0)
    small = dict(d_model=args.width, n_layers=shape.n_layers, n_heads=heads, vocab_size=257, seq_len=16)
    batch = torch.randint(0, 257, (2, 17), generator=torch.Generator().manual_seed(0))
    checkpointing = measured.activation_checkpointing

    torch.manual_seed(0)
    plain = build_gpt(small, "selective")
    plain.set_checkpointing(checkpointing)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4)

    torch.manual_seed(0)
    meta = build_gpt(small, "selective", device="meta")
    meta.set_checkpointing(checkpointing)
    plan = small_plan(measured, meta, result.get("params") or reference_parameters(shape))
    engine, engine_opt = wrap(meta, torch.optim.AdamW(meta.parameters(), lr=1e-4), sample_inputs=(batch,), plan=plan,
                              device="cpu", init_fn=lambda m: init_gpt_weights(m, shape.n_layers),
                              accumulation_steps=1)

    def plain_step():
        return plain(batch), plain_opt

    def engine_step():
        return engine(batch), engine_opt

    times = {"plain PyTorch": ([], []), "the engine": ([], [])}
    for step in range(args.warmup + args.steps):
        for name, run in (("plain PyTorch", plain_step), ("the engine", engine_step)):
            start = time.thread_time()
            loss, opt = run()
            middle = time.thread_time()
            loss.backward()
            end = time.thread_time()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step >= args.warmup:
                times[name][0].append((middle - start) * 1e3)
                times[name][1].append((end - middle) * 1e3)
    whole = sum(1 for m in checkpointing if m in ("full", True))
    print(f"{os.path.basename(args.result)}'s plan ({len(plan.placements)} chunks, "
          f"{plan.placements.count('device')} on the device, pool {plan.n_blocks}, {whole} of {len(checkpointing)} "
          f"blocks recomputed whole), {args.width} wide: thread time, fastest / median of {args.steps} steps (ms)")
    print("| | forward | backward |")
    print("|---|---:|---:|")
    for name, (forward, backward) in times.items():
        print(f"| {name} | {min(forward):.1f} / {statistics.median(forward):.1f} | "
              f"{min(backward):.1f} / {statistics.median(backward):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
