import sys

from elixir_ray.cli import main

sys.exit(main())
