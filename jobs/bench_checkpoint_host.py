"""The host time of the GPT's activation checkpointing modes: `python jobs/bench_checkpoint_host.py`.

A GPT with many blocks and tiny layers (48 blocks 16 wide by default, sequences of 16, batch 2)
runs its step in plain PyTorch on the CPU with every block "none" (kept), "selective" or "full"
(recomputed whole), the modes interleaved step by step so that the machine's noise falls on each
alike. Its kernels take almost nothing, so each step's thread time is the host's work: the Python
and the dispatch that bound gpt-1.5b's capped steps on the H100 (2026-11-27). Prints the
fastest and the median forward and backward of each mode, in milliseconds, and how many times a
kept block's host time each takes.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from elixir_ray.model.gpt import CHECKPOINT_MODES, build_gpt  # noqa: E402


def measure(layers: int, width: int, steps: int, warmup: int, modes: list[str]) -> dict:
    """{mode: (forward ms list, backward ms list)} of `steps` steps after `warmup`, thread time."""
    shape = dict(d_model=width, n_layers=layers, n_heads=2, vocab_size=257, seq_len=16)
    torch.manual_seed(0)
    batch = torch.randint(0, 257, (2, 17))
    models = {mode: build_gpt(shape, mode) for mode in modes}
    times = {mode: ([], []) for mode in modes}
    for step in range(warmup + steps):
        for mode, model in models.items():
            start = time.thread_time()
            loss = model(batch)
            middle = time.thread_time()
            loss.backward()
            end = time.thread_time()
            model.zero_grad(set_to_none=True)
            if step >= warmup:
                times[mode][0].append((middle - start) * 1e3)
                times[mode][1].append((end - middle) * 1e3)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=48, help="GPT blocks (default 48, as gpt-1.5b)")
    parser.add_argument("--width", type=int, default=16, help="model width (default 16: kernels that take nothing)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per mode (default 30)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--modes", nargs="+", default=list(CHECKPOINT_MODES), choices=CHECKPOINT_MODES,
                        help="checkpointing modes to time (default: all three)")
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads (default 1)")
    args = parser.parse_args(argv)
    if args.layers < 1 or args.width < 2 or args.width % 2 or args.steps < 1 or args.warmup < 0:
        parser.error("--layers and --steps must be at least 1, --warmup at least 0, --width an even number from 2")
    torch.set_num_threads(args.threads)
    times = measure(args.layers, args.width, args.steps, args.warmup, args.modes)
    kept = times.get("none")
    print(f"{args.layers} blocks {args.width} wide, {args.steps} steps after {args.warmup}, thread time, "
          f"fastest / median (ms; x: the fastest against every block kept)")
    print("| mode | forward | backward |")
    print("|---|---:|---:|")
    for mode, (forward, backward) in times.items():
        cells = []
        for i, values in enumerate((forward, backward)):
            cell = f"{min(values):.1f} / {statistics.median(values):.1f}"
            if kept is not None and mode != "none":
                cell += f" ({min(values) / min(kept[i]):.1f}x)"
            cells.append(cell)
        print(f"| {mode} | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
