"""Entrypoint for `ray job submit -- python jobs/train.py --config jobs/configs/tiny.yaml`.

It takes what `elixir-ray train` takes (the config by path or shipped name, `--set`, `--resume`,
`--quiet`; `--help` prints that command's help), the config also as `--config PATH`. The job
supervisor sets RAY_ADDRESS, so the run joins the cluster the job was submitted to. With
`--resume auto` a job submitted again after its driver was lost goes on from the run's newest
checkpoint (and a first submission starts afresh); the job's log says which.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from elixir_ray.cli import main  # noqa: E402


# `elixir-ray train`'s options that take the next argument as their value
VALUED = ("--set", "--resume")


def train_argv(argv: list[str]) -> list[str]:
    """`elixir-ray train`'s arguments: `--config PATH` (or `--config=PATH`) becomes the positional
    config. A config given twice raises ValueError saying so (train would call the second one an
    unrecognised argument)."""
    out, args, configs = ["train"], iter(argv), []
    for arg in args:
        if arg == "--config":
            path = next(args, None)
            configs.append(path)
            out.extend([path] if path is not None else [])  # none after it: train says the config is required
        elif arg.startswith("--config="):
            configs.append(arg.split("=", 1)[1])
            out.append(configs[-1])
        elif arg in VALUED:
            out.append(arg)
            value = next(args, None)
            out.extend([value] if value is not None else [])
        else:
            if not arg.startswith("-"):
                configs.append(arg)
            out.append(arg)
    if len(configs) > 1:
        raise ValueError(f"the config is given {len(configs)} times ({', '.join(map(str, configs))}): give it "
                         f"once, as --config PATH or as the first argument")
    return out


HELP_HEADER = ("jobs/train.py: the entrypoint for `ray job submit`. The config is --config PATH (or the first "
               "argument); the rest is what `elixir-ray train` takes:\n")


if __name__ == "__main__":
    if any(arg in ("-h", "--help") for arg in sys.argv[1:]):
        print(HELP_HEADER)
    try:
        argv = train_argv(sys.argv[1:])
    except ValueError as exc:
        print(f"jobs/train.py: error: {exc}", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(argv))
