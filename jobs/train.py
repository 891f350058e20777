"""Entrypoint for `ray job submit -- python jobs/train.py --config jobs/configs/tiny.yaml`.

It takes what `elixir-ray train` takes (the config by path or shipped name, `--set`, `--resume`,
`--quiet`; `--help` prints that command's help), the config also as `--config PATH`. The job
supervisor sets RAY_ADDRESS, so the run joins the cluster the job was submitted to.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from elixir_ray.cli import main  # noqa: E402


def train_argv(argv: list[str]) -> list[str]:
    """`elixir-ray train`'s arguments: `--config PATH` (or `--config=PATH`) becomes the positional config."""
    out, args = ["train"], iter(argv)
    for arg in args:
        if arg == "--config":
            path = next(args, None)
            out.extend([path] if path is not None else [])  # none after it: train says the config is required
        elif arg.startswith("--config="):
            out.append(arg.split("=", 1)[1])
        else:
            out.append(arg)
    return out


HELP_HEADER = ("jobs/train.py: the entrypoint for `ray job submit`. The config is --config PATH (or the first "
               "argument); the rest is what `elixir-ray train` takes:\n")


if __name__ == "__main__":
    if any(arg in ("-h", "--help") for arg in sys.argv[1:]):
        print(HELP_HEADER)
    sys.exit(main(train_argv(sys.argv[1:])))
