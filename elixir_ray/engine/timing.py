"""StepTimer: opt-in wall-clock seconds per engine activity, for the benchmark's step breakdown.

The engine's step is forward/backward compute interleaved with chunk copies and a per-chunk
optimizer. To say where a step's time goes, the ChunkStore times its own regions:

- "h2d": `ChunkStore.fetch`, the host-to-device copy and cast of a chunk, plus its all-gather;
- "d2h": `ChunkStore.reduce`, the reduce-scatter or all-reduce of a chunk's gradient and the copy
  of this rank's gradient shard to where its optimizer state lives (the host, usually);
- "cpu_adam_wait": the training thread blocked on a host chunk's CPU AdamW (which runs on a
  background thread, see host_updates.py) because it needed that chunk's state;
- "device_adam": AdamW updates of device chunks and of Deep Optimizer States chunks, including
  the latter's copies to the device and back (which in an untimed step run on their own streams
  beside the rest of backward, where updates start there, and the next forward; timed, the
  region's syncs make them wait for them whole).

These four are measured on the training thread and add up, with the untimed rest (forward and
backward kernels, hook overhead, gradient clipping), to the step's wall time. Beside them,
`background()` gives "cpu_adam": the seconds the background thread spent on CPU AdamW. That time
overlaps the others, so it is not part of the sum; what it failed to hide is "cpu_adam_wait".

`timeline`, when set to a list (it is None by default), also receives one tuple per event, timed
without any device sync so that steps run as they do in training: ("cpu_adam", start, end, chunk,
elements) per background update, ("cpu_adam_wait", start, end, chunk, 0) per wait on one, and
("backward", t, t, -1, 0) / ("step", t, t, -1, 0) marks, all on `time.perf_counter()`'s clock. It says
which updates ran slowly and what the training thread was doing then. On CUDA each mark also
records an event on the compute stream (`device_marks`), so that `device_timeline()` can say when
the device got there: a device that reaches each mark right after the host does was waiting for
the host (Python, hooks, waits on copies); one far behind it was busy. Marks on the device alone
(`device_mark`) say when each chunk's load ran on its stream ("device load" to "device load
done") and how long the compute stream stalled for it ("device load wait" to "device load
waited": at a prefetched chunk's first use, at the forward's end for backward's first chunks,
and the whole of a load on the compute stream itself). Each mark costs a CUDA event.

Disabled by default: a disabled timer hands out one shared no-op context, so training pays an
attribute check and a method call per chunk move, nothing per element. When enabled on CUDA,
each region synchronizes the device on entry and on exit, because GPU work is asynchronous and
without the syncs a copy's time would land in whichever later region happened to wait for it.
The syncs also stop copies from overlapping compute, so timed steps are slower than untimed
ones: enable the timer for benchmarks and diagnosis, not for training runs.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from typing import Optional

import torch

CATEGORIES = ("h2d", "d2h", "cpu_adam_wait", "device_adam")  # on the training thread; they add up
BACKGROUND = ("cpu_adam",)  # on the background thread; overlaps the rest

_UNTIMED = contextlib.nullcontext()  # reusable: entering it does nothing


def profiled(name: str):
    """Decorate an engine method so that, while torch's profiler runs, its calls show as a range
    called `name` (the benchmark profiles one step to see where the training thread's time goes:
    which of the engine's calls block on the device or on the background thread). Otherwise one
    check per call."""
    def decorate(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            if not torch.autograd._profiler_enabled():
                return fn(*args, **kwargs)
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)
        return run
    return decorate


class StepTimer:
    """Accumulated seconds and region counts per category; `enabled = True` to start timing."""

    def __init__(self, device: torch.device):
        self.device = device
        self.enabled = False
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        self.calls = dict.fromkeys(CATEGORIES, 0)
        self.background_seconds = dict.fromkeys(BACKGROUND, 0.0)
        self.background_calls = dict.fromkeys(BACKGROUND, 0)
        self._lock = threading.Lock()
        self._open = False  # a region is being timed: nested ones are already inside its time
        self.timeline: Optional[list] = None  # a list: events appended (see the module's docstring)
        self.device_marks: list = []  # (category, host time, CUDA event, chunk) per mark while the timeline is on
        # (host time, CUDA event): an event known to have run by that time (`anchor`), which places the marks
        self.device_anchor: Optional[tuple] = None

    def region(self, category: str):
        """A context timing its body under `category` (a no-op when disabled or nested)."""
        if category not in self.seconds:
            raise KeyError(f"unknown timing category {category!r} (choose from {', '.join(CATEGORIES)})")
        if not self.enabled or self._open:
            return _UNTIMED
        return _Region(self, category)

    def event(self, category: str, start: float, end: float, chunk: int = -1, elements: int = 0) -> None:
        """One timeline event (thread-safe; kept only while `timeline` is a list)."""
        timeline = self.timeline
        if timeline is not None:
            with self._lock:
                timeline.append((category, start, end, chunk, elements))

    def mark(self, category: str) -> None:
        if self.timeline is not None:
            now = time.perf_counter()
            self.event(category, now, now)
            if self.device.type == "cuda":
                self._record(category, now, torch.cuda.current_stream(self.device), -1)

    def device_mark(self, category: str, stream, chunk: int) -> None:
        """A mark on the device alone (on `stream`, for `chunk`): where the host's time says nothing,
        as when a chunk's load ran on the copy stream, or how long the compute stream stalled for
        it (`ChunkStore`'s "load", "load done", "load wait" and "load waited" marks). A no-op unless
        the timeline is on, on CUDA."""
        if self.timeline is not None and self.device.type == "cuda":
            self._record(category, time.perf_counter(), stream, chunk)

    def _record(self, category: str, now: float, stream, chunk: int) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        self.device_marks.append((category, now, event, chunk))

    def anchor(self, host_time: float, event) -> None:
        """Note that `event` (a CUDA event with timing) had run by `host_time` on the host clock, as
        one just synchronized has: `device_timeline` places the marks from it. The benchmark anchors
        on its window's closing event, synchronized at the window's end, because its steps start with
        the device still busy with the warm-up's work, so that a mark at their start ran later on the
        device than the host recorded it."""
        self.device_anchor = (host_time, event)

    def device_timeline(self) -> list:
        """("device " + category, t, t, chunk, 0) per mark: when its stream (the compute stream's,
        or the one `device_mark` named) reached it, on the host clock (chunk -1 for `mark`'s), and
        forget the marks and the anchor. Each is placed by its event's elapsed time to the anchor's
        event (`anchor`), or without one, from the first mark, taken to have run on the device when
        the host recorded it (true only where the stream was idle then, as after a device sync).
        Syncs the device (for after the timed steps); [] off CUDA or without marks."""
        marks, self.device_marks = self.device_marks, []
        anchor, self.device_anchor = self.device_anchor, None
        if not marks:
            return []
        self._sync()
        if anchor is None:
            _, origin, first, _ = marks[0]
            anchor = (origin, first)
        at_anchor, anchor_event = anchor
        out = []
        for category, _, event, chunk in marks:
            at = at_anchor - event.elapsed_time(anchor_event) / 1e3  # negative for one after the anchor's
            out.append(("device " + category, at, at, chunk, 0))
        return out

    def add_background(self, category: str, seconds: float) -> None:
        """Time spent by a background thread (thread-safe; recorded only while enabled)."""
        if self.enabled:
            with self._lock:
                self.background_seconds[category] += seconds
                self.background_calls[category] += 1

    def totals(self) -> dict[str, float]:
        """A copy of the seconds so far, per training-thread category."""
        return dict(self.seconds)

    def background(self) -> dict[str, float]:
        """A copy of the background thread's seconds so far (overlapping the training thread's)."""
        with self._lock:
            return dict(self.background_seconds)

    def reset(self) -> None:
        for k in CATEGORIES:
            self.seconds[k] = 0.0
            self.calls[k] = 0
        with self._lock:
            for k in BACKGROUND:
                self.background_seconds[k] = 0.0
                self.background_calls[k] = 0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class _Region:
    """One timed region: device synced before the clock starts and before it stops."""

    __slots__ = ("timer", "category", "start")

    def __init__(self, timer: StepTimer, category: str):
        self.timer, self.category, self.start = timer, category, 0.0

    def __enter__(self):
        self.timer._sync()  # work queued before the region is not the region's
        self.timer._open = True
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        try:
            self.timer._sync()  # the region's own queued work is
            self.timer.seconds[self.category] += time.perf_counter() - self.start
            self.timer.calls[self.category] += 1
        finally:
            self.timer._open = False
        return False
