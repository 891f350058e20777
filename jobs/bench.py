"""Peer benchmark: `python jobs/bench.py --shape gpt-4b --cap 24GiB` (same as `elixir-ray bench`)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from elixir_ray.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
