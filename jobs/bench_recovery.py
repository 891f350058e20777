"""Recovery benchmark: kill a worker mid-run and time the way back; time the pause per checkpoint.

    python jobs/bench_recovery.py [--config jobs/configs/tiny.yaml] [--kill-at 12] [--via object_store]
                                  [--out runs/bench_recovery.json]

Runs on an embedded local Ray cluster (or RAY_ADDRESS): one uninterrupted run for the checkpoint
stall, then the same run with worker-1 SIGKILLed at a step, reporting kill -> failure noticed ->
first step after restore. Prints a markdown table and writes JSON.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ray  # noqa: E402

import elixir_ray  # noqa: E402
from elixir_ray.cluster.chaos import WorkerKiller  # noqa: E402
from elixir_ray.cluster.worker import worker_actor_name  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="jobs/configs/tiny.yaml")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5, help="checkpoint.every_steps")
    parser.add_argument("--kill-at", type=int, default=12, help="kill worker-1 after this step")
    parser.add_argument("--via", default="auto", choices=["auto", "object_store", "storage"],
                        help="checkpoint.via: storage restores from the checkpoint the workers wrote")
    parser.add_argument("--out", default="runs/bench_recovery.json")
    args = parser.parse_args()
    if not ray.is_initialized():  # RAY_ADDRESS, or a cluster of its own (never a `ray start` one found by chance)
        ray.init(address=os.environ.get("RAY_ADDRESS", "local"), include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"train.steps={args.steps}", f"checkpoint.every_steps={args.every}", f"output_dir={tmp}",
                     f"checkpoint.via={args.via}"]
        clean = elixir_ray.train(args.config, overrides=overrides + ["name=clean"], progress=False)
        killer = WorkerKiller(worker_actor_name("killed", 1), args.kill_at)
        killer.start()
        killed = elixir_ray.train(args.config, overrides=overrides + ["name=killed"], progress=False)
        killer.join(timeout=5)
    record = killed.restarts[0]
    step_s = statistics.median(clean.metrics.column("step_seconds").to_pylist())
    report = {
        "config": args.config, "steps": args.steps, "every_steps": args.every, "checkpoint_via": clean.checkpoint_via,
        "workers": clean.plan.world_size, "median_step_s": step_s,
        "snapshot_stall_median_s": statistics.median(clean.snapshot_stalls),
        "snapshot_stall_max_s": max(clean.snapshot_stalls),
        "killed_at_step": killer.killed_step, "restored_step": record.restored_step,
        "restored_from": record.restored_from,
        "detect_s": record.failed_at - killer.killed_at,
        "recovery_s": record.resumed_at - killer.killed_at,
        "loss_match": clean.metrics.column("loss").to_pylist() == killed.metrics.column("loss").to_pylist(),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print("| measure | value |\n|---|---|")
    for key, value in report.items():
        print(f"| {key} | {value:.3f} |" if isinstance(value, float) else f"| {key} | {value} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
