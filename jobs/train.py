"""Entrypoint for `ray job submit -- python jobs/train.py --config jobs/configs/tiny.yaml`.

The job supervisor sets RAY_ADDRESS, so the run joins the cluster the job was submitted to.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from elixir_ray.cli import main  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Train under `ray job submit`.")
    parser.add_argument("--config", required=True, help="YAML config, e.g. jobs/configs/tiny.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--resume", metavar="CKPT_URI",
                        help="continue a stopped run from a checkpoint, or the newest valid one in a directory")
    args = parser.parse_args()
    argv = ["train", args.config, *sum((["--set", s] for s in args.set), [])]
    sys.exit(main(argv + (["--resume", args.resume] if args.resume else [])))
