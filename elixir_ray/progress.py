"""A terminal progress bar for training: step, loss, tokens/s and ETA on one line.

On a terminal it redraws in place; in a log (ray job logs, CI) it prints a line every
`every` steps instead, so logs stay readable.
"""

from __future__ import annotations

import sys
import time


def _fmt_seconds(s: float) -> str:
    s = int(max(0, s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _fmt_rate(r: float) -> str:
    return f"{r / 1e6:.2f}M" if r >= 1e6 else f"{r / 1e3:.1f}k" if r >= 1e3 else f"{r:.0f}"


class ProgressBar:
    def __init__(self, total: int, every: int = 10, stream=None, width: int = 24):
        self.total, self.every, self.width = total, max(1, every), width
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = None  # set at the first step, so start-up time does not skew the ETA
        self._first_step = 0
        self._last_len = 0

    def line(self, step: int, loss: float, tokens_per_s: float) -> str:
        if self.start is None:
            self.start, self._first_step = time.monotonic(), step
        done = step - self._first_step
        # no estimate before a second step has timed one ("--")
        eta = _fmt_seconds((time.monotonic() - self.start) / done * (self.total - step)) if done else "--"
        filled = int(self.width * step / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        return (f"[{bar}] step {step}/{self.total}  loss {loss:.4f}  "
                f"{_fmt_rate(tokens_per_s)} tok/s  ETA {eta}")

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        first = self.start is None  # the first step shown (a resumed run's starts past 1)
        text = self.line(step, loss, tokens_per_s)
        if self.tty:
            self.stream.write("\r" + text.ljust(self._last_len))
            self._last_len = len(text)
        elif step % self.every == 0 or step == self.total or first:
            self.stream.write(text + "\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        """A line about something other than a step (a long checkpoint write), kept above the bar."""
        if self.tty and self._last_len:
            self.stream.write("\r" + " " * self._last_len + "\r")
        self.stream.write(text + "\n")
        if self.tty and self._last_len:
            self._last_len = 0
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class ByteProgress:
    """Progress of a long write (exporting a large model's weights: tens of GiB, minutes on network
    storage): bytes done of the total, rate and time left. On a terminal it redraws in place a few
    times a second; in a log it prints a line every `every_s` seconds, so a short write prints
    only its last line."""

    def __init__(self, what: str, stream=None, every_s: float = 10.0, clock=time.monotonic):
        self.what, self.every_s, self.clock = what, every_s, clock
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.total = self.done = 0
        self.start = self._shown = 0.0
        self._last_len = 0

    def begin(self, total_bytes: int) -> None:
        self.total, self.done = total_bytes, 0
        self.start = self._shown = self.clock()

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        now = self.clock()
        if now - self._shown >= (0.2 if self.tty else self.every_s):
            self._shown = now
            self._show(self.line(now))

    def line(self, now: float) -> str:
        seconds = now - self.start
        rate = self.done / seconds if seconds > 0 else 0.0
        share = self.done / self.total if self.total else 1.0
        left = (self.total - self.done) / rate if rate > 0 else 0.0
        return (f"{self.what}: {_fmt_bytes(self.done)} of {_fmt_bytes(self.total)} ({share:.0%}), "
                f"{_fmt_bytes(rate)}/s, {_fmt_seconds(left)} left")

    def finish(self) -> None:
        now = self.clock()
        seconds = now - self.start
        text = f"{self.what}: {_fmt_bytes(self.done)} in {_fmt_seconds(seconds)}"
        self._show(text)
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def close(self) -> None:
        """Stopped short (an error): end the line on a terminal, so the error starts on its own."""
        if self.tty and self._last_len:
            self.stream.write("\n")
            self.stream.flush()
            self._last_len = 0

    def _show(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r" + text.ljust(self._last_len))
            self._last_len = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
