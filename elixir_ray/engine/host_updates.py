"""HostUpdates: the CPU AdamW of host chunks runs on a background thread, off the critical path.

The CPU update of a large model takes longer than its backward (about 0.8 s for 4.2B parameters
on 16 cores against 0.4 s of backward on an H100), so running it inside `optimizer.step()` makes
the GPU wait. Here each host chunk's update is a job on one background thread: it starts as soon
as the chunk's gradient is final (during the last backward when the engine knows it is the last,
otherwise at `step()`), and whoever next touches that chunk's state (the next forward's fetch,
a gradient reduction, a checkpoint) waits for that chunk alone. The update (the C kernel of
host_kernel.py, or torch's fused CPU Adam) releases the GIL and runs on threads of its own, so it
really runs beside the training thread.

Jobs run lowest chunk index first, not first come first served: backward finishes chunks in
reverse order, and the next forward needs chunk 0 first, so a queue in arrival order would make
that forward wait for every update. Among the jobs whose gradients have landed, that is: a job
still waiting for its gradient's copy does not hold up one that could run. On the H100 the
thread picked chunk 0 (the tied embedding, whose gradient is final last) at every `step()` and
sat 60 ms waiting for its copy with other updates ready, on a step the CPU updates bound. When
no queued job is ready, the thread waits for the oldest one's copy (copies to the host land in
the order they were queued), then looks again.

The thread sets torch's intra-op count, which the C kernel takes as its thread count too, to one
fewer than the process has (`update_threads`): the training thread keeps a core busy (launching kernels, or spinning in a
CUDA wait), and an OpenMP team with a member descheduled waits at every barrier for it. On the
2-core VM with one core taken, the update ran at 0.70 G params/s on two threads and 0.90 on one.
The thread count is torch's process-wide setting, so a thread that starts using torch after this
one starts with it too.

The thread makes the engine's device its current one before its first CUDA call (waiting on an
event): a new thread's current device is device 0, and a CUDA call there would create a context
on GPU 0 for every rank of a multi-GPU node.

An exception raised by a job is re-raised where its chunk is next settled. The thread is stopped
and joined when the HostUpdates is collected or the interpreter exits, so no thread that ran torch
code is still alive while the process tears down (a live one can abort the exit).
"""

from __future__ import annotations

import itertools
import multiprocessing.util
import os
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Callable, Optional, Sequence

import torch

from elixir_ray.engine.timing import profiled

UPDATE_THREADS_ENV = "ELIXIR_RAY_UPDATE_THREADS"


def update_threads(threads: Optional[int] = None) -> int:
    """Intra-op threads for the CPU updates: all but one of this process's (or of `threads`), at least
    one. The environment variable ELIXIR_RAY_UPDATE_THREADS, where set, caps this process's count
    (a tuning knob: on a machine whose cores are shared, fewer threads can update faster)."""
    count = max(1, (torch.get_num_threads() if threads is None else threads) - 1)
    cap = os.environ.get(UPDATE_THREADS_ENV, "").strip()
    if threads is None and cap:
        if not cap.isdigit() or int(cap) < 1:
            raise ValueError(f"{UPDATE_THREADS_ENV}={cap!r}: expected a whole number of threads, at least 1 "
                             f"(or unset it for all but one of this process's {torch.get_num_threads()})")
        count = min(count, int(cap))
    return count


class HostUpdates:
    """One background thread for CPU updates, and the per-chunk futures that order access to them."""

    def __init__(self, timer, device: torch.device = torch.device("cpu")):
        self.timer, self.device = timer, device
        self._queue: list = []  # (priority, sequence, job, ready events, future, elements), taken by _take_ready
        self._sequence = itertools.count()
        self._wakeup = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._stopping = threading.Event()

    def submit(self, job: Callable[[], None], ready: Sequence[torch.cuda.Event] = (), priority: int = 0,
               elements: int = 0) -> Future:
        """Run `job` on the background thread once the `ready` events have passed (on CUDA: the
        gradient's copy to the host, and any prefetch still reading the chunk's host copy; any
        object with CUDA events' `query()` and `synchronize()` will do).
        Queued jobs run lowest `priority` first (the engine passes the chunk index); `elements`, the
        parameters it updates, only labels the job in the timer's timeline."""
        future: Future = Future()
        with self._wakeup:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=_serve, args=(weakref.ref(self), self._wakeup, self._queue, self._stopping, self.device,
                                         update_threads()),
                    name="elixir-cpu-adam", daemon=True)
                self._thread.start()
                weakref.finalize(self, _stop, self._wakeup, self._stopping, self._thread)
                # and when a multiprocessing child (torch.multiprocessing.spawn) exits: its exit
                # function runs before the interpreter's, with an update perhaps still running
                multiprocessing.util.Finalize(None, _stop, args=(self._wakeup, self._stopping, self._thread),
                                              exitpriority=10)
            self._queue.append((priority, next(self._sequence), job, tuple(ready), future, elements))
            self._wakeup.notify()
        return future

    def _run(self, job: Callable[[], None], ready: tuple, priority: int, elements: int) -> None:
        for event in ready:
            event.synchronize()  # these events only: never a whole-device sync from this thread
        start = time.perf_counter()
        job()
        end = time.perf_counter()
        self.timer.add_background("cpu_adam", end - start)
        self.timer.event("cpu_adam", start, end, priority, elements)

    @profiled("elixir.wait_cpu_update")
    def wait(self, future: Optional[Future], chunk: int = -1) -> None:
        """Block until `future`'s job has finished, re-raising its exception; timed as "cpu_adam_wait"."""
        if future is None:
            return
        if not future.done():
            start = time.perf_counter()
            with self.timer.region("cpu_adam_wait"):
                future.result()
            self.timer.event("cpu_adam_wait", start, time.perf_counter(), chunk)
        else:
            future.result()


def _stop(wakeup: threading.Condition, stopping: threading.Event, thread: threading.Thread) -> None:
    """Stop the background thread and wait for it (at collection of its HostUpdates, or at exit)."""
    with wakeup:
        stopping.set()
        wakeup.notify()
    if thread is not threading.current_thread():
        thread.join(timeout=30)


def _take_ready(queue: list):
    """Under the lock: remove and return the lowest-priority queued entry whose ready events have all
    passed (`query`, which does not block), or None when none has."""
    for entry in sorted(queue):  # (priority, sequence, ...): the sequence is unique, so nothing further is compared
        if all(event.query() for event in entry[3]):
            queue.remove(entry)
            return entry
    return None


def _serve(owner_ref, wakeup: threading.Condition, queue: list, stopping: threading.Event,
           device: torch.device, threads: int) -> None:
    """The background thread: run queued jobs until told to stop."""
    torch.set_num_threads(threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    while True:
        with wakeup:
            while not queue and not stopping.is_set():
                wakeup.wait()
            if stopping.is_set():  # nobody can settle what is still queued any more
                return
            entry = _take_ready(queue)
            oldest = min(queue, key=lambda e: e[1])[3] if entry is None else ()
        if entry is None:
            for event in oldest:  # the first copy queued lands first; then look again
                event.synchronize()
            continue
        priority, _, job, ready, future, elements = entry
        owner = owner_ref()
        if owner is None:
            return
        if future.set_running_or_notify_cancel():
            try:
                owner._run(job, ready, priority, elements)
            except BaseException as exc:  # handed to whoever settles this chunk
                future.set_exception(exc)
            else:
                future.set_result(None)
        del owner, job, ready, future  # the job's closure holds its chunk's buffers: not until the next job
