"""Entrypoint for `ray job submit -- python jobs/sweep.py SWEEP.yaml`.

It takes what `elixir-ray sweep` takes (the sweep file, `--set`, `--quiet`), and always continues
the sweep of that name when its storage holds one (`--resume auto`): submitting the same command
again after the job was stopped or its driver lost finishes the sweep, the trials already finished
kept, so a scheduler (cron, Airflow) can start or restart it without bookkeeping. The job
supervisor sets RAY_ADDRESS, so the sweep runs on the cluster the job was submitted to.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from elixir_ray.cli import main  # noqa: E402


def sweep_argv(argv: list[str]) -> list[str]:
    """`elixir-ray sweep`'s arguments, continuing the sweep when there is one to continue."""
    if any(arg == "--resume" or arg.startswith("--resume=") for arg in argv):
        return ["sweep", *argv]
    return ["sweep", *argv, "--resume=auto"]


if __name__ == "__main__":
    sys.exit(main(sweep_argv(sys.argv[1:])))
