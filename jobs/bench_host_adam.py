"""The engine's CPU AdamW (from bf16 gradients) alone and beside a busy training thread, per update
thread count, through the one-pass C kernel (its threads claiming blocks, as the engine runs it, and an
even share each) and through torch's passes: `python jobs/bench_host_adam.py [--million 256] [--out FILE]`.

On a GPU machine the training stand-in launches bf16 matmuls and waits for the device; on a CPU
it runs tiny tensor ops. `--smoke` times 2M parameters, for tests.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from elixir_ray.bench.host_adam import markdown, run  # noqa: E402
from elixir_ray.bench.run import write_json  # noqa: E402
from elixir_ray.engine.device import resolve_device  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--million", type=int, default=128, help="parameters updated per timing, in millions "
                        "(default 128, about a chunk: 2 GB of host memory)")
    parser.add_argument("--smoke", action="store_true", help="2M parameters (tests)")
    parser.add_argument("--out", default="runs/bench_host_adam.json")
    args = parser.parse_args()
    if args.million < 1:
        parser.error("--million must be at least 1")
    device = resolve_device(None)  # with its index: the update thread makes it current
    numel = 2 * 2**20 if args.smoke else args.million * 10**6
    rows = run(numel, device)
    print(markdown(rows))
    write_json(os.path.abspath(args.out), {"device": str(device), "params": numel, "cpu_threads": torch.get_num_threads(),
                                           "rows": [r.to_dict() for r in rows]})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
