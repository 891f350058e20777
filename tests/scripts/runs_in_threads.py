"""Two runs at once from threads of one process that has not started Ray, as a sweep would run
them: the first to end must not shut Ray down under the other. Run by tests/test_multinode.py in
its own process (it needs Ray not yet started). Prints one JSON line.
"""

import json
import sys
import threading
import time

import ray

import elixir_ray


def main(dataset: str, out_dir: str) -> None:
    results, errors = {}, {}

    def run(name: str, steps: int, delay_s: float) -> None:
        time.sleep(delay_s)
        cfg = {
            "name": name, "output_dir": out_dir,
            "model": {"size": "tiny", "n_layers": 2, "seq_len": 64},
            "data": {"path": dataset},
            "train": {"steps": steps, "micro_batch": 2},
            "cluster": {"num_workers": 1, "local_num_cpus": 4},
            "checkpoint": {"every_steps": 0},
        }
        try:
            results[name] = elixir_ray.train(cfg, progress=False).final_step
        except Exception as exc:  # reported, not raised: the other thread's outcome matters too
            errors[name] = f"{type(exc).__name__}: {exc}"

    # "short" ends while "long" still trains; "same-time" starts with "short" (both would ray.init)
    threads = [threading.Thread(target=run, args=args) for args in
               (("short", 3, 0.0), ("same-time", 3, 0.0), ("long", 40, 2.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"results": results, "errors": errors, "ray_left_running": ray.is_initialized()}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
