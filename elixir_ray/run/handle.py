"""`elixir_ray.start(config) -> RunHandle`: a run in the background that the caller can stop.

The run is checked and claims its directories in the caller's thread (bad input raises there, at
once), then trains in a thread of its own, exactly as `train()` does. `RunHandle.stop()` asks the
controller to end after the step the ranks agree on: the step's checkpoint is persisted, the
workers are killed, and `result()` returns the run's `Result` with `stopped` set. A Ray Tune
trial of a sweep is built on it: the scheduler's stop is `RunHandle.stop()`.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional, Union

from elixir_ray.config import RunConfig
from elixir_ray.run.outputs import Result
from elixir_ray.run.train import RunOptions, checked_and_claimed, train_claimed


class RunHandle:
    """A run training in a thread of this process (a daemon: the run ends with the process)."""

    def __init__(self, run, claim, options: RunOptions):
        self._stop = options.stop_requested
        self._result: Optional[Result] = None
        self._error: Optional[BaseException] = None
        self._done = threading.Event()
        self.config: RunConfig = run.config
        self._thread = threading.Thread(target=self._main, args=(run, claim, options), daemon=True,
                                        name=f"elixir-ray-run-{run.config.name}")
        self._thread.start()

    def _main(self, run, claim, options: RunOptions) -> None:
        try:
            self._result = train_claimed(run, options)
        except BaseException as exc:  # handed to the caller of result()
            self._error = exc
        finally:
            claim.release()
            self._done.set()

    def stop(self, timeout: Optional[float] = None) -> Optional[Result]:
        """End the run after the step under way, with a checkpoint of that step. Waits up to
        `timeout` seconds (None: until it has ended) and returns its `Result`, or None when the
        run is still stopping; a run that failed raises its error here, as `result()` does."""
        self._stop.set()
        return self.result(timeout) if self._done.wait(timeout) else None

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Whether the run has ended, waiting up to `timeout` seconds for it."""
        return self._done.wait(timeout)

    def result(self, timeout: Optional[float] = None) -> Result:
        """The run's `Result` once it has ended (waiting up to `timeout` seconds: TimeoutError after
        it); the run's error if it failed."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the run {self.config.name!r} is still training after {timeout:g}s")
        if self._error is not None:
            raise self._error
        return self._result


def start(config: Union[RunConfig, dict, str], overrides: Optional[list[str]] = None, *, progress: bool = False,
          resume: Optional[str] = None, on_metrics: Optional[Callable[[dict], None]] = None,
          on_checkpoint: Optional[Callable[[int, str], None]] = None, worker_group_cls: Optional[type] = None,
          placement=None, plan_cache=None) -> RunHandle:
    """Start a run in the background and return its handle (`stop()`, `result()`, `done()`).

    Takes what `train()` takes. `on_metrics(row)` and `on_checkpoint(step, uri)` are called from
    the run's threads as rows arrive and checkpoints are committed: keep them short (hand the row
    to a queue). `placement` (a `cluster.worker_group.GivenPlacement`) puts the ranks into bundles
    of a placement group reserved by the caller, one rank per bundle; `plan_cache` (a
    `cluster.plan_cache.PlanCache`) shares profiles and plans with runs of the same shape."""
    options = RunOptions(progress=progress, resume=resume, on_metrics=on_metrics, worker_group_cls=worker_group_cls,
                         placement=placement, stop_requested=threading.Event(), on_checkpoint=on_checkpoint,
                         plan_cache=plan_cache)
    run, claim, options = checked_and_claimed(config, overrides, options)
    try:
        return RunHandle(run, claim, options)
    except BaseException:
        claim.release()
        raise
