"""Training while every checkpoint write fails with a real 'file too large' error from the OS.

RLIMIT_FSIZE caps the size of any file this driver process writes, which is how a full disk
looks to the writer: the write fails part-way. Run by tests/test_multinode.py in its own process,
because the limit applies to the whole process. Prints one JSON line.
"""

import json
import logging
import os
import resource
import signal
import sys

import ray

import elixir_ray
from elixir_ray.checkpoint import list_checkpoints


def main(dataset: str, out_dir: str) -> None:
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=100 * 2**20)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG from write() instead of a signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 2**10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    cfg = {
        "name": "fulldisk", "output_dir": out_dir,
        "model": {"size": "tiny", "n_layers": 2, "seq_len": 64},
        "data": {"path": dataset},
        "train": {"steps": 4, "micro_batch": 4},
        "cluster": {"num_workers": 2},
        "checkpoint": {"every_steps": 2},
    }
    logged = []

    class Keep(logging.Handler):
        def emit(self, record):
            logged.append(record.getMessage())

    logging.getLogger("elixir_ray").addHandler(Keep(level=logging.ERROR))
    result = elixir_ray.train(cfg, progress=False)
    ckpt_root = os.path.join(out_dir, "fulldisk", "checkpoints")
    print(json.dumps({
        "steps": result.metrics.column("step").to_pylist(),
        "checkpoint": result.checkpoint_uri,
        "errors": result.persist_errors,
        "reported": sum("could not persist" in m for m in logged),
        "committed": list_checkpoints(ckpt_root),
        "leftovers": sorted(os.listdir(ckpt_root)) if os.path.isdir(ckpt_root) else [],
    }))
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
