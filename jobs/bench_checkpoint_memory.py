"""Checkpoint memory benchmark: the machine's peak memory while a run checkpoints, per checkpoint.via.

    python jobs/bench_checkpoint_memory.py [--via object_store storage] [--repeat 2] [--size gpt-124m]

Each run trains the built-in GPT of `--size` on two CPU workers of a fresh local Ray cluster (an
object store of `--object-store` GiB), checkpointing every 2 of 6 steps, and samples
MemTotal - MemAvailable every 50 ms. Runs of the two ways alternate. Prints a markdown table and
writes JSON. A measurement for this machine's RAM, not a test: run it on an otherwise idle machine.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ray  # noqa: E402

import elixir_ray  # noqa: E402
from elixir_ray.data.dataset import builtin_corpus_files, prepare_dataset  # noqa: E402

def used_bytes() -> int:
    info = dict(line.split(":", 1) for line in open("/proc/meminfo"))
    return (int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])) * 1024

def one_run(via: str, size: str, data: str, object_store_gib: float) -> dict:
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=int(object_store_gib * 2**30))
    try:
        with tempfile.TemporaryDirectory() as out:
            base = used_bytes()
            peak = [base]
            stop = threading.Event()

            def sample():
                while not stop.is_set():
                    peak[0] = max(peak[0], used_bytes())
                    time.sleep(0.05)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            cfg = {"name": f"ckmem-{via}", "output_dir": out, "model": {"size": size, "seq_len": 64},
                   "data": {"path": data}, "train": {"steps": 6, "micro_batch": 2, "log_every": 1},
                   "checkpoint": {"every_steps": 2, "keep": 1, "via": via}, "cluster": {"num_workers": 2, "use_gpu": False}}
            start = time.time()
            result = elixir_ray.train(cfg, progress=False)
            stop.set()
            sampler.join()
            return {"via": result.checkpoint_via, "seconds": round(time.time() - start, 1),
                    "peak_over_idle_gib": round((peak[0] - base) / 2**30, 2),
                    "stalls_s": [round(s, 3) for s in result.snapshot_stalls],
                    "persist_errors": result.persist_errors}
    finally:
        ray.shutdown()

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--via", nargs="+", default=["object_store", "storage"], choices=["object_store", "storage"])
    parser.add_argument("--repeat", type=int, default=2, help="runs of each way, alternating")
    parser.add_argument("--size", default="gpt-124m", help="model.size of the built-in GPT")
    parser.add_argument("--object-store", type=float, default=6.0, help="the object store's size in GiB")
    parser.add_argument("--data", default=None, help="a token dataset (default: the built-in corpus, prepared once)")
    parser.add_argument("--out", default="runs/bench_checkpoint_memory.json")
    args = parser.parse_args()
    data = args.data
    tmp = None
    if data is None:
        tmp = tempfile.TemporaryDirectory()
        data = os.path.join(tmp.name, "corpus.arrow")
        prepare_dataset(builtin_corpus_files(max_bytes=2_000_000), data)
    runs = []
    for i in range(args.repeat):
        for via in args.via:
            runs.append(one_run(via, args.size, data, args.object_store))
            print(json.dumps(runs[-1]), flush=True)
    print("\n| checkpoint.via | peak over idle (GiB) | median checkpoint stall (s) | run (s) |\n|---|---|---|---|")
    for via in args.via:
        mine = [r for r in runs if r["via"] == via]
        print(f"| {via} | {', '.join(str(r['peak_over_idle_gib']) for r in mine)} | "
              f"{', '.join(str(statistics.median(r['stalls_s'])) for r in mine)} | "
              f"{', '.join(str(r['seconds']) for r in mine)} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"size": args.size, "object_store_gib": args.object_store, "runs": runs}, f, indent=1)
    if tmp is not None:
        tmp.cleanup()
    return 0

if __name__ == "__main__":
    sys.exit(main())
