"""What a failing run says: a non-finite loss ends it at that step, a stopped or dead worker is
named (not the healthy peer whose collective timed out after it), and the console carries one line
per failure, never a survivor's traceback. Real Ray, real gloo, real signals."""

import os
import re

import pytest
import yaml

from conftest import tiny_config

pytestmark = pytest.mark.slow


def test_a_non_finite_loss_stops_the_run_at_that_step_naming_the_last_good_checkpoint(
        ray_cluster, tiny_dataset, tmp_path, capsys):
    """optim.lr=1e6 trains to a NaN loss in a few steps: the run ends there with exit 2 (not a
    restart, which would replay the same steps), naming the step and the newest checkpoint whose
    weights still gave a finite loss, and the metrics of the steps before it are kept."""
    from elixir_ray.checkpoint import read_manifest
    from elixir_ray.cli import main
    from elixir_ray.run.outputs import read_metrics

    cfg = tiny_config(tiny_dataset, tmp_path, optim={"lr": 1e6}, train={"steps": 12},
                      checkpoint={"every_steps": 1, "keep": 3}, fault={"max_restarts": 2})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if line.startswith("elixir-ray: error:"))
    found = re.search(r"step (\d+): the loss is (nan|inf|-inf), not finite: the run stops there "
                      r"\(train.stop_on_nonfinite\); the last good checkpoint is step (\d+): fix the cause "
                      r"\(optim.lr too high\?\) and continue with --resume (\S+)$", line)
    assert found, err
    step, good, uri = int(found.group(1)), int(found.group(3)), found.group(4)
    assert 1 <= good < step - 1 and read_manifest(uri)["step"] == good
    assert "restart" not in err
    steps = [row["step"] for row in read_metrics(str(tmp_path / "runs" / "t" / "metrics.parquet"))]
    assert steps == list(range(1, step)), steps


class _Faults:
    """In a thread: SIGKILL worker-0 once it has trained `at_step` steps, then SIGSTOP the next
    worker-1 (the restarted group's) once it has too, noting when each signal went."""

    def __init__(self, run: str, at_step: int):
        import threading

        self.run, self.at_step = run, at_step
        self.killed_at = self.stopped_at = None
        self.stopped_pid = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._inject, daemon=True)

    def _pid_once_trained(self, rank: int):
        """The pid of worker `rank` once it has trained `at_step` steps, else None."""
        import ray

        from elixir_ray.cluster.worker import worker_actor_name

        try:
            actor = ray.get_actor(worker_actor_name(self.run, rank), namespace="elixir_ray")
            if ray.get(actor.current_step.remote(), timeout=5) >= self.at_step:
                return ray.get(actor.node_info.remote(), timeout=5)["pid"]
        except (ValueError, ray.exceptions.RayError):  # not started yet, being replaced, or killed
            pass
        return None

    def _inject(self) -> None:
        import signal
        import time

        deadline = time.monotonic() + 240
        first_group = set()  # the pids of the group worker-0 was killed in
        while time.monotonic() < deadline and not self.done.is_set():
            if self.killed_at is None:
                pids = [self._pid_once_trained(0), self._pid_once_trained(1)]
                if None not in pids:
                    first_group = set(pids)
                    os.kill(pids[0], signal.SIGKILL)
                    self.killed_at = time.time()
            else:
                pid = self._pid_once_trained(1)
                if pid is not None and pid not in first_group:
                    os.kill(pid, signal.SIGSTOP)
                    self.stopped_pid, self.stopped_at = pid, time.time()
                    return
            time.sleep(0.02)

    def release(self) -> None:
        import signal

        self.done.set()
        self.thread.join(timeout=10)
        if self.stopped_pid is not None:
            try:
                os.kill(self.stopped_pid, signal.SIGCONT)  # the teardown SIGKILLs it; be sure
            except ProcessLookupError:
                pass


def test_a_dead_worker_0_then_a_stopped_worker_1_are_named_in_one_line_each(
        ray_cluster, tiny_dataset, tmp_path, capfd, caplog):
    """A SIGKILLed worker-0 is named as dead (its survivor's "connection closed" is not what is
    reported, nor printed as a traceback); after the restart a SIGSTOPped worker-1 is named as the
    one that stopped answering within fault.detect_timeout_s + 1 s, not the healthy worker-0 whose
    gloo receive timed out waiting for it."""
    from elixir_ray import ClusterError, train

    detect = 5
    faults = _Faults("faults", at_step=2)
    cfg = {**tiny_config(tiny_dataset, tmp_path, train={"steps": 200}, checkpoint={"every_steps": 100},
                         fault={"max_restarts": 1, "detect_timeout_s": detect}), "name": "faults"}
    faults.thread.start()
    try:
        with caplog.at_level("WARNING", logger="elixir_ray"):
            with pytest.raises(ClusterError, match="giving up after 1 restart") as err:
                train(cfg, progress=False)
    finally:
        faults.release()
    assert faults.killed_at is not None and faults.stopped_at is not None, "the faults were not injected"
    failures = [r for r in caplog.records if r.getMessage().startswith("worker group failed")]
    assert len(failures) == 2, [r.getMessage() for r in failures]
    died, stalled = failures
    assert died.getMessage().startswith("worker group failed: worker 0 died"), died.getMessage()
    assert re.match(r"worker group failed: worker\(s\) 1 did not answer for [\d.]+s", stalled.getMessage()), \
        stalled.getMessage()
    assert "worker(s) 1 did not answer" in str(err.value) and "rank 0" not in str(err.value)
    assert stalled.created - faults.stopped_at <= detect + 1, stalled.created - faults.stopped_at
    out, errs = capfd.readouterr()
    console = out + errs
    assert "Traceback" not in console and "Unhandled error" not in console, console
    assert len(console.splitlines()) < 20, console


@pytest.mark.extended
def test_a_run_that_queues_for_resources_says_it_is_waiting_and_for_how_long(ray_cluster, tiny_dataset, tmp_path,
                                                                               caplog):
    """Another run holds the CPUs (here a placement group, released after a few seconds): the run
    says once that it is waiting and for how long it will, instead of silence, then trains."""
    import threading

    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from elixir_ray import train

    hold = placement_group([{"CPU": 3}])
    ray.get(hold.ready(), timeout=60)
    release = threading.Timer(4.0, remove_placement_group, [hold])
    release.start()
    try:
        with caplog.at_level("WARNING", logger="elixir_ray"):
            result = train(tiny_config(tiny_dataset, tmp_path, train={"steps": 1}), progress=False)
    finally:
        release.join()
    waits = [r.getMessage() for r in caplog.records if "waiting for the cluster" in r.getMessage()]
    assert len(waits) == 1, waits
    assert "2 x {'CPU': 1} for the workers (free now: 1 CPU): up to cluster.placement_timeout_s=60s" in waits[0]
    assert result.metrics.column("step").to_pylist() == [1]
